"""The triton backend beyond the shared matrix (tests/test_backends.py, `check`, generation against
Hugging Face): its split-KV path and segment merge, graph safety (forward reads every length from
the device), and that its kernels compile for Hopper and Ampere without a GPU."""

import importlib.util
import os
from dataclasses import replace

import pytest
import torch
from pagedbench.backends.registry import get_backend

from pagedbench import LLM, SamplingParams
from pagedbench.bench.problems import attend_dense, place, random_problem
from tests.test_cuda_graphs import graph_engine

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2}


def triton_backend(num_heads, num_kv_heads, head_dim, block_size=16, dtype=torch.float32):
    return get_backend("triton")(
        num_heads, num_kv_heads, head_dim, head_dim**-0.5, block_size, torch.device("cpu"), dtype
    )


def attend(backend, batch, dtype):
    state = backend.plan(batch.metadata)
    out = backend.forward(batch.q.to(dtype), batch.k_cache.to(dtype), batch.v_cache.to(dtype), state)
    return out, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "spec",
    [
        [(300, 1), (65, 1), (7, 1), (129, 1)],  # decodes: keys split into up to 4 segments, some empty
        [(200, 3), (150, 5), (64, 2)],  # multi-token decode (a verify step): split as well
        [(190, 1), (0, 40), (70, 9)],  # mixed: a split decode launch and an unsplit one
    ],
    ids=["decode", "multi-token", "mixed"],
)
def test_split_kv_segments_merge_to_the_oracle(spec, dtype):
    problem = random_problem(spec, 8, 2, 64, seed=5)
    batch = place(problem, 16, layout_seed=9)
    backend = triton_backend(8, 2, 64, dtype=dtype)
    out, state = attend(backend, batch, dtype)
    assert state.launches[0].num_segments > 1  # the path under test ran
    expected = attend_dense(problem, 64**-0.5, torch.float64)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_a_window_bounds_the_decode_split():
    """Windowed decodes split the keys the window reaches, not the whole context: 2000-key
    sequences under a 100-key window are one 64-key segment's work (min_segment_keys on CPU)."""
    from pagedbench.backends.base import AttentionVariant

    problem = random_problem([(2000, 1), (1500, 1)], 8, 2, 64, seed=3)
    batch = place(problem, 16, layout_seed=1)
    windowed = AttentionVariant(sliding_window=100)
    backend = get_backend("triton")(8, 2, 64, 64**-0.5, 16, torch.device("cpu"), torch.float32, windowed)
    out, state = attend(backend, batch, torch.float32)
    plain = attend(triton_backend(8, 2, 64), batch, torch.float32)[1]
    assert plain.launches[0].num_segments == 4 and state.launches[0].num_segments == 1
    expected = attend_dense(problem, 64**-0.5, torch.float64, variant=windowed)
    torch.testing.assert_close(out.double(), expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("block_size,head_dim,heads", [(8, 128, (4, 1)), (32, 96, (6, 2)), (16, 256, (2, 2))])
def test_page_sizes_head_dims_and_groups(block_size, head_dim, heads):
    """Pages of 8 and 32 tokens, head dims that are not powers of two, a group of 3 (padded to 4)."""
    problem = random_problem([(3 * block_size + 1, 1), (0, 2 * block_size + 3), (block_size, 5)], *heads, head_dim)
    batch = place(problem, block_size, layout_seed=2)
    out, _ = attend(triton_backend(*heads, head_dim, block_size), batch, torch.float32)
    torch.testing.assert_close(out.double(), attend_dense(problem, head_dim**-0.5, torch.float64), atol=2e-4, rtol=2e-4)


def test_forward_reads_lengths_from_the_device():
    """Graph safety: the state planned for one decode step, reused after the step's tensors were
    refilled in place with another step of the same shape (as a graph replay does), attends to the
    new step -- nothing about lengths or pages is baked into the state on the host."""
    first = place(random_problem([(40, 1), (100, 1), (3, 1)], 4, 2, 64, seed=1), 16, layout_seed=1)
    second_problem = random_problem([(90, 1), (17, 1), (64, 1)], 4, 2, 64, seed=2)
    second = place(second_problem, 16, layout_seed=2)
    backend = triton_backend(4, 2, 64)
    graph_shaped = replace(first.metadata, max_seq_len=512)
    state = backend.plan(graph_shaped)
    assert backend.plan(replace(second.metadata, max_seq_len=512)).launches == state.launches
    for name in ("query_start_loc", "seq_lens", "block_table"):
        old, new = getattr(first.metadata, name), getattr(second.metadata, name)
        old.zero_()[tuple(slice(0, n) for n in new.shape)] = new
    out = backend.forward(second.q, second.k_cache, second.v_cache, state)
    torch.testing.assert_close(out.double(), attend_dense(second_problem, 0.125, torch.float64), atol=2e-4, rtol=2e-4)


@pytest.mark.slow
def test_triton_replays_decode_steps_exactly(monkeypatch):
    """Greedy tokens with (fake-captured) decode graphs equal eager ones; every bucket replays."""
    from pagedbench.backends.triton import TritonBackend

    assert TritonBackend.cuda_graph_reason is None
    prompts = [{"prompt_token_ids": list(range(3 + i, 3 + i + 3 * i + 2))} for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True) for i in range(5)]  # 5..1 running
    eager_llm = LLM("tiny-llama", backend="triton", device="cpu", num_blocks=64, max_num_seqs=5, max_model_len=128)
    expected = [o.outputs[0].token_ids for o in eager_llm.generate(prompts, params, use_tqdm=False)]
    llm, graphs = graph_engine(monkeypatch, backend_cls=TritonBackend, max_num_seqs=5)
    assert graphs.verify() is None
    llm.engine.runner.graphs = graphs
    replayed = []
    original = graphs.replay
    graphs.replay = lambda inputs: replayed.append(inputs.graph) or original(inputs)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert set(replayed) == set(graphs.buckets)


def _ptxas() -> str | None:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return path if os.path.exists(path) else None


def _arg_type(name: str, constants: dict, element: str, kv: str | None = None) -> str:
    """Triton's signature type of a kernel argument, by the kernels' naming (`kv`: the pages' type)."""
    if name in constants:
        return "constexpr"
    if name in ("k_cache_ptr", "v_cache_ptr") and kv:
        return f"*{kv}"
    if name in ("k_scale_ptr", "v_scale_ptr"):
        return "*fp16" if kv == "i8" else "*fp32"
    if name.startswith("part_") or name == "sinks_ptr":
        return "*fp32"
    if name in ("block_table_ptr", "query_start_loc_ptr", "seq_lens_ptr"):
        return "*i32"
    if name.endswith("_ptr"):
        return f"*{element}"
    return "fp32" if name == "scale" else "i32"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or _ptxas() is None, reason="no bundled ptxas")
@pytest.mark.parametrize(
    "arch,dtype,head_dim,query_len,kv",
    [
        (90, torch.bfloat16, 128, 1, None),
        (90, torch.bfloat16, 128, 64, None),
        (90, torch.bfloat16, 128, 1, torch.int8),  # quantized pages, dequantized in the kernel
        (90, torch.bfloat16, 128, 4, torch.float8_e4m3fn),
        (80, torch.float16, 64, 4, None),
        (86, torch.float32, 128, 64, None),  # 99 KiB of shared memory: smaller tiles than on an H100
        pytest.param(90, torch.float32, 256, 64, None, marks=pytest.mark.slow),  # the most shared memory
        pytest.param(86, torch.float32, 256, 64, None, marks=pytest.mark.slow),
    ],
)
def test_kernels_compile_for_the_gpu(arch, dtype, head_dim, query_len, kv):
    """Triton's front end and ptxas accept the CUDA launch configurations (for a 132-SM GPU), within
    the arch's shared memory per block (227 KiB sm_90, 163 KiB sm_80, 99 KiB sm_86), as the tile
    rule estimates it: what the CPU interpreter cannot show."""
    import triton
    from pagedbench.backends import triton as backend_module
    from pagedbench.backends import triton_kernels
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend = triton_backend(16, 4, head_dim, dtype=dtype)
    backend.device = torch.device("cuda")  # constants as on a GPU (bf16 dots stay bf16)
    limit = {90: 227, 80: 163, 86: 99}[arch] * 1024
    backend.tuning = backend_module.cuda_tuning(dtype, head_dim, num_sms=132, shared_limit=limit)
    problem = random_problem([(2000, query_len)] * 4, 16, 4, head_dim)
    meta = place(problem, 16, layout_seed=0).metadata
    launch = backend.plan(meta).launches[0]
    assert (launch.num_segments > 1) == (query_len <= 16)
    kernels = [(triton_kernels.paged_attention, backend.constants(launch, 16, kv), launch.num_warps)]
    if launch.num_segments > 1:
        merge = dict(BLOCK_H=1, HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim, NUM_SEGMENTS=launch.num_segments)
        kernels.append((triton_kernels.combine_segments, merge, 4))
    element = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    for fn, constants, warps in kernels:
        jit = triton.jit(fn)
        kv_type = {None: None, torch.int8: "i8", torch.float8_e4m3fn: "fp8e4nv"}[kv]
        signature = {name: _arg_type(name, constants, element, kv_type) for name in jit.arg_names}
        compiled = triton.compile(
            ASTSource(jit, signature, constexprs=constants),
            target=GPUTarget("cuda", arch, 32),
            options={"num_warps": warps},
        )
        assert compiled.metadata.shared <= limit, (fn.__name__, compiled.metadata.shared)
        if fn is triton_kernels.paged_attention and kv is None:  # the rule's estimate bounds what Triton allots
            estimate = backend_module.shared_bytes(dtype, head_dim, constants["BLOCK_M"], constants["BLOCK_N"])
            assert estimate - 1024 <= compiled.metadata.shared <= estimate, (compiled.metadata.shared, estimate)


def latent_backend(num_heads: int, value_dim: int, rope_dim: int, dtype=torch.float32, block_size=64):
    from pagedbench.backends.base import AttentionVariant

    head_dim = value_dim + rope_dim
    return get_backend("triton")(
        num_heads, 1, head_dim, head_dim**-0.5, block_size, torch.device("cpu"), dtype,
        AttentionVariant(value_dim=value_dim),
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "spec",
    [[(300, 1), (65, 1), (7, 1), (129, 1)], [(190, 1), (0, 40), (70, 9)]],
    ids=["decode", "mixed"],
)
def test_latent_kernel_splits_heads_and_keys_to_the_oracle(spec, dtype):
    """Absorbed MLA: 40 query heads (3 blocks of 16, the last partial) over one latent head of
    64 + 16 dims whose first 64 are the values; decodes split along their keys, prefill unsplit."""
    problem = random_problem(spec, 40, 1, 80, seed=4, value_dim=64)
    batch = place(problem, 64, layout_seed=3)
    backend = latent_backend(40, 64, 16, dtype)
    backend.tuning = replace(backend.tuning, latent_block_h=16, latent_block_n=32)
    out, state = attend(backend, batch, dtype)
    assert state.launches[0].num_segments > 1 and state.launches[0].block_m == 16
    expected = attend_dense(problem, 80**-0.5, torch.float64)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or _ptxas() is None, reason="no bundled ptxas")
@pytest.mark.parametrize("arch,dtype,kv", [(90, torch.bfloat16, None), (90, torch.bfloat16, torch.float8_e4m3fn),
                                           (80, torch.float16, torch.int8), (90, torch.float32, None)])  # fmt: skip
def test_latent_kernel_compiles_for_the_gpu(arch, dtype, kv, tmp_path):
    """DeepSeek-V3's decode shape (128 heads over a 512 + 64 latent, pages of 64) on CUDA: the
    latent kernel and its merge compile within the arch's shared memory, without spilling."""
    import triton
    from pagedbench.backends import triton as backend_module
    from pagedbench.backends import triton_kernels, triton_mla_kernels
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend = latent_backend(128, 512, 64, dtype)
    backend.device = torch.device("cuda")
    limit = {90: 227, 80: 163}[arch] * 1024
    backend.tuning = backend_module.cuda_tuning(dtype, 576, num_sms=132, shared_limit=limit)
    meta = place(random_problem([(4000, 1)] * 4, 128, 1, 576, value_dim=512), 64, layout_seed=0).metadata
    launch = backend.plan(meta).launches[0]
    assert launch.num_segments > 1
    element = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    kv_type = {None: None, torch.int8: "i8", torch.float8_e4m3fn: "fp8e4nv"}[kv]
    constants = backend.latent_constants(launch, 64, kv or dtype)
    merge = dict(BLOCK_H=1, HEAD_DIM=512, HEAD_DIM_P2=512, NUM_SEGMENTS=launch.num_segments)
    for fn, consts in ((triton_mla_kernels.mla_attention, constants), (triton_kernels.combine_segments, merge)):
        jit = triton.jit(fn)
        signature = {}
        for name in jit.arg_names:
            if name == "cache_ptr" and kv_type:
                signature[name] = f"*{kv_type}"
            elif name == "scale_ptr":
                signature[name] = "*fp16" if kv_type == "i8" else "*fp32"
            else:
                signature[name] = _arg_type(name, consts, element)
        warps = backend_module.LATENT_WARPS if fn is triton_mla_kernels.mla_attention else 4
        source, target = ASTSource(jit, signature, constexprs=consts), GPUTarget("cuda", arch, 32)
        compiled = triton.compile(source, target=target, options={"num_warps": warps})
        assert compiled.metadata.shared <= limit, (fn.__name__, compiled.metadata.shared)
        assert spilled_bytes(compiled.asm["cubin"], tmp_path) == 0, (fn.__name__, arch, dtype, kv)


def spilled_bytes(cubin: bytes, folder) -> int:
    """Bytes of stack a compiled kernel uses (register spills), as cuobjdump reports them."""
    import re
    import subprocess

    path = folder / "kernel.cubin"
    path.write_bytes(cubin)
    tool = os.path.join(os.path.dirname(_ptxas()), "cuobjdump")
    usage = subprocess.run([tool, "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    return sum(int(n) for n in re.findall(r"STACK:(\d+)", usage))


def test_batch_invariant_decodes_split_in_fixed_length_segments():
    """Under batch_invariant a decode's keys split into segments of a fixed length (128 keys on the
    interpreter), however many that makes: the count follows the batch's longest row, and each row's
    output is bitwise the same alone, beside a longer row (more, empty, segments) and against the oracle."""
    invariant = lambda: get_backend("triton")(
        8, 2, 64, 64**-0.5, 16, torch.device("cpu"), torch.float32, batch_invariant=True
    )
    problem = random_problem([(300, 1), (700, 1), (50, 1)], 8, 2, 64, seed=4)
    together = place(problem, 16, layout_seed=2)
    out, state = attend(invariant(), together, torch.float32)
    assert state.launches[0].num_segments == 8 and state.launches[0].segment_steps == 2  # 701 keys / 128
    torch.testing.assert_close(out.double(), attend_dense(problem, 64**-0.5, torch.float64), atol=2e-4, rtol=2e-4)
    for i, seq in enumerate(problem.seqs):
        alone = replace(problem, seqs=[seq], q=problem.q[i : i + 1], k=[problem.k[i]], v=[problem.v[i]])
        single, single_state = attend(invariant(), place(alone, 16, layout_seed=7), torch.float32)
        assert single_state.launches[0].num_segments == {0: 4, 1: 8, 2: 1}[i]
        assert torch.equal(single[0], out[i]), f"row {i} differs alone"
