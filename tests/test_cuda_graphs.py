"""Decode CUDA graphs, checked on CPU: bucket choice, padding, and replay. A fake capture stands
for a CUDA graph — its replay reruns the captured call with the objects captured, so a backend
whose plan() does not refill static buffers in place replays stale state and is caught."""

import functools
import gc
import weakref

import numpy as np
import pytest
import torch
from pagedbench.backends.flash_attn import FlashAttnBackend

from pagedbench import LLM, SamplingParams
from pagedbench.device.transfer import counting
from pagedbench.engine.sequence import Sequence
from pagedbench.worker.cuda_graphs import DecodeGraphs, bucket_for, decode_buckets, graphable, pad_decode_batch
from pagedbench.worker.step_batch import step_batch
from tests.test_flash_attn import install_only

CPU = torch.device("cpu")


def fake_capture(fn, pool):
    return fn, pool


def test_buckets_follow_vllm_sizes_up_to_max_num_seqs():
    assert decode_buckets(256) == [1, 2, 4, *range(8, 257, 8)]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_buckets(1) == [1]
    assert decode_buckets(300)[-4:] == [256, 272, 288, 300]
    buckets = decode_buckets(20)
    assert [bucket_for(n, buckets) for n in (1, 3, 4, 5, 9, 17, 20, 21)] == [1, 4, 4, 8, 16, 20, 20, None]


def decode_seqs(lens, block_size, rng, num_blocks):
    """Sequences in decode: `lens[i]` tokens, the last not yet computed, pages scattered."""
    free = rng.permutation(num_blocks).tolist()
    seqs = []
    for i, n in enumerate(lens):
        seq = Sequence(str(i), None, rng.integers(3, 300, n).tolist(), SamplingParams())
        seq.num_computed_tokens = n - 1
        seq.block_table = [free.pop() for _ in range(-(-n // block_size))]
        seqs.append(seq)
    return seqs


def test_padding_rows_live_in_the_padding_page():
    rng = np.random.default_rng(0)
    seqs = decode_seqs([5, 17, 33], 16, rng, 20)
    batch = step_batch(seqs, [1, 1, 1], 16, 21)
    assert graphable(batch)
    padded = pad_decode_batch(batch, 8, 6, pad_block=20)
    assert padded.block_table.shape == (8, 6) and np.array_equal(padded.block_table[:3, :3], batch.block_table)
    assert (padded.block_table[3:, 0] == 20).all() and (padded.slot_mapping[3:] == 20 * 16).all()
    assert padded.seq_lens.tolist() == [5, 17, 33, 1, 1, 1, 1, 1]
    assert padded.query_start_loc.tolist() == list(range(9)) and padded.logits_indices.tolist() == list(range(8))
    assert padded.sampling_rows == batch.sampling_rows == [0, 1, 2]
    with pytest.raises(ValueError, match="exceeds"):
        pad_decode_batch(batch, 2, 6, 20)
    seqs[2].num_computed_tokens -= 1  # a two-token chunk: not a decode step
    prefill = step_batch(seqs, [1, 1, 2], 16, 21)
    assert not graphable(prefill)


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_padding_does_not_change_the_real_rows(backend):
    llm = LLM("tiny-llama", backend=backend, device="cpu", num_blocks=40)
    runner = llm.engine.runner
    rng = np.random.default_rng(1)
    seqs = decode_seqs([3, 20, 45, 9], 16, rng, 40)
    batch = step_batch(seqs, [1] * 4, 16, runner.num_cache_blocks)
    inputs = batch.to(CPU)
    eager = runner.run_eager(inputs, runner.backend.plan(inputs.metadata))
    padded = pad_decode_batch(batch, 8, 8, runner.pad_block).to(CPU)
    got = runner.run_eager(padded, runner.backend.plan(padded.metadata))
    torch.testing.assert_close(got[:4], eager, atol=1e-5, rtol=1e-5)


def graph_engine(monkeypatch, backend_cls=FlashAttnBackend, max_num_seqs=8, capture=fake_capture):
    """A tiny engine whose runner replays fake-captured decode graphs through `backend_cls`
    (flash-attn with the FA4 fake: the backend whose plan() is graph-safe)."""
    install_only(monkeypatch, "fa4")
    llm = LLM("tiny-llama", device="cpu", num_blocks=64, max_num_seqs=max_num_seqs, max_model_len=128)
    engine = llm.engine
    cfg = engine.model_config
    engine.runner.backend = backend_cls(
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5, 16, CPU, torch.float32
    )
    graphs = DecodeGraphs(engine.runner, max_num_seqs, engine.max_model_len, capture=capture)
    graphs.capture_all()
    return llm, graphs


def test_graphs_keep_the_state_their_kernels_write(monkeypatch):
    """A CUDA graph records addresses, not objects: the state plan() gave each capture (here
    triton's split-KV scratch) must live as long as its graph. Freed, its memory goes to other
    tensors that every replay then overwrites: on an H200, `compare` at batch 256 died of an
    illegal memory access."""
    from pagedbench.backends.triton import TritonBackend

    scratch = []
    launch = TritonBackend._launch

    def recording_launch(self, *args, **kwargs):
        result = launch(self, *args, **kwargs)
        if result.partials is not None:
            scratch.append(weakref.ref(result.partials[0]))
        return result

    def graph_like_capture(fn, pool):  # keeps the output, as torch.cuda.graph does, not `fn` or its state
        out = fn()
        return (lambda: out), pool

    monkeypatch.setattr(TritonBackend, "_launch", recording_launch)
    llm, graphs = graph_engine(monkeypatch, backend_cls=TritonBackend, max_num_seqs=4, capture=graph_like_capture)
    assert sorted(graphs.graphs) == [1, 2, 4] and len(scratch) == 3  # every bucket's decode splits its keys
    gc.collect()
    assert all(ref() is not None for ref in scratch)


def test_graphs_replay_decode_steps_exactly(monkeypatch):
    """Greedy generation with ragged lengths (the batch shrinks through every bucket as requests
    finish) gives the same tokens with graphs as eagerly; every decode step replays a graph."""
    prompts = [{"prompt_token_ids": list(range(3 + i, 3 + i + 4 * i + 2))} for i in range(7)]
    params = [SamplingParams(temperature=0, max_tokens=3 + 4 * i, ignore_eos=True) for i in range(7)]
    eager_llm, _ = graph_engine(monkeypatch)
    expected = [o.outputs[0].token_ids for o in eager_llm.generate(prompts, params, use_tqdm=False)]

    llm, graphs = graph_engine(monkeypatch)
    assert sorted(graphs.graphs) == [1, 2, 4, 8] and graphs.verify() is None
    llm.engine.runner.graphs = graphs
    replayed = []
    original = graphs.replay
    graphs.replay = lambda inputs: replayed.append(inputs.graph) or original(inputs)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert set(replayed) == {1, 2, 4, 8}
    # A replayed step copies its padded inputs into the graph's buffers: one copy per dtype.
    engine = llm.engine
    for i in range(3):
        engine.add_request({"prompt_token_ids": [5 + i, 6, 7]}, SamplingParams(temperature=0, max_tokens=8))
    engine.step()  # the prefill (eager)
    with counting() as copies:
        engine.step()
    assert replayed[-1] == 4 and copies == {"h2d": 2, "d2h": 1}


@pytest.mark.slow
def test_flex_replays_decode_steps_exactly(monkeypatch):
    """flex's decode graphs (powers of two from 2, its kernel's static batches): every replay
    reads the BlockMask, inverse page table and positions that plan() refilled in place."""
    from pagedbench.backends.flex import FlexBackend

    monkeypatch.setenv("PAGEDBENCH_FLEX_COMPILE", "0")  # the buffers are what is tested; eager is quicker

    def static_flex(*args):
        backend = FlexBackend(*args)
        backend.static_decode_batch = True  # as on CUDA
        return backend

    prompts = [{"prompt_token_ids": list(range(3 + i, 3 + i + 7 * i + 2))} for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=3 + 5 * i, ignore_eos=True) for i in range(5)]
    eager_llm, _ = graph_engine(monkeypatch, backend_cls=static_flex, max_num_seqs=5)
    expected = [o.outputs[0].token_ids for o in eager_llm.generate(prompts, params, use_tqdm=False)]
    llm, graphs = graph_engine(monkeypatch, backend_cls=static_flex, max_num_seqs=5)
    assert graphs.buckets == [2, 4, 8] and graphs.verify() is None
    llm.engine.runner.graphs = graphs
    replayed = []
    original = graphs.replay
    graphs.replay = lambda inputs: replayed.append(inputs.graph) or original(inputs)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert set(replayed) == {2, 4, 8}


def test_a_backend_that_rebuilds_its_state_replays_stale_inputs(monkeypatch):
    """Why sdpa says it cannot be captured: its replayed step attends with the capture's masks."""
    from pagedbench.backends.sdpa import SDPABackend

    assert SDPABackend.cuda_graph_reason and FlashAttnBackend.cuda_graph_reason is None
    llm, graphs = graph_engine(monkeypatch, backend_cls=SDPABackend, max_num_seqs=4)
    runner = llm.engine.runner
    seqs = decode_seqs([7, 30, 12], 16, np.random.default_rng(2), 60)
    batch = step_batch(seqs, [1] * 3, 16, runner.num_cache_blocks)
    inputs = batch.to(CPU)
    eager = runner.run_eager(inputs, runner.backend.plan(inputs.metadata))
    static = graphs.inputs(batch, graphs.bucket(batch))
    runner.backend.plan(static.metadata)  # a fresh state the captured call never sees
    assert not torch.allclose(graphs.replay(static)[:3], eager, atol=1e-3)
    # The engine's start-up check catches it before anything is measured, and runs eagerly.
    assert graphs.verify().startswith("the batch-1 graph's logits differ from eager ones by")


def test_engine_takes_vllm_memory_and_graph_settings():
    llm = LLM("tiny-llama", device="cpu", num_blocks=16, enforce_eager=True, gpu_memory_utilization=0.5)
    assert llm.engine.cuda_graphs == "off: enforce_eager"
    assert LLM("tiny-llama", device="cpu", num_blocks=16).engine.cuda_graphs == "off: no CUDA device (device is cpu)"
    with pytest.raises(ValueError, match="gpu_memory_utilization must be <= 1, got 1.5"):
        LLM("tiny-llama", device="cpu", gpu_memory_utilization=1.5)


def fake_cuda_engine(monkeypatch, total_gib, free_gib, activation_gib, utilization=0.9, graphs=False):
    """The blocks `size_kv_cache` finds on a pretend GPU: memory figures and the profiled step."""
    from types import SimpleNamespace

    from pagedbench.config import EngineConfig
    from pagedbench.engine import kv_budget
    from pagedbench.model.loader import resolve_model_config
    from pagedbench.model.parallel import NO_TP

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free_gib * gib), int(total_gib * gib)))
    monkeypatch.setattr(kv_budget, "profile_activation_bytes", lambda *args: int(activation_gib * gib))
    config = EngineConfig(model="qwen3-0.6b", gpu_memory_utilization=utilization, max_num_seqs=256, max_model_len=4096)
    model = SimpleNamespace(config=resolve_model_config("qwen3-0.6b")[0])
    backend = SimpleNamespace(cuda_graph_powers_of_two=False)
    where = (torch.device("cuda"), torch.bfloat16, NO_TP, 1)
    return lambda: kv_budget.size_kv_cache(config, model, None, backend, *where, graphs).num_blocks


def test_kv_cache_gets_what_utilization_leaves_after_weights_and_activations(monkeypatch):
    """vLLM's rule: utilization x total, less memory in use (weights...) and the profiled peak."""
    from pagedbench.model.loader import resolve_model_config
    from pagedbench.worker.model_runner import kv_bytes_per_block

    per_block = kv_bytes_per_block(resolve_model_config("qwen3-0.6b")[0], 16, torch.bfloat16)
    blocks = fake_cuda_engine(monkeypatch, total_gib=80, free_gib=78, activation_gib=3)()
    assert blocks == int(0.9 * 80 * 2**30 - 2 * 2**30 - 3 * 2**30) // per_block
    half = fake_cuda_engine(monkeypatch, total_gib=80, free_gib=78, activation_gib=3, utilization=0.5)()
    assert half < blocks / 1.5
    # With CUDA graphs: a profiled decode step for their pool, and their logits buffer, come off too.
    with_graphs = fake_cuda_engine(monkeypatch, total_gib=80, free_gib=78, activation_gib=3, graphs=True)()
    logits_buffer = 256 * 151936 * 4  # max_num_seqs x vocab x fp32
    assert with_graphs == max(0, int(0.9 * 80 * 2**30 - 2 * 2**30 - 6 * 2**30) - logits_buffer) // per_block


def test_a_model_that_does_not_fit_is_a_clear_error(monkeypatch):
    too_small = fake_cuda_engine(monkeypatch, total_gib=8, free_gib=2, activation_gib=1, utilization=0.5)
    with pytest.raises(ValueError, match=r"the model does not fit: gpu_memory_utilization=0.5 of 8.0 GiB leaves"):
        too_small()


def test_engine_runs_eagerly_when_its_graphs_fail(monkeypatch):
    """A capture that raises, or replays that disagree with eager steps, leave the engine eager
    and the reports saying why (checked at start-up, before anything is measured)."""
    from pagedbench.backends.sdpa import SDPABackend

    from pagedbench.worker import cuda_graphs

    llm = LLM("tiny-llama", device="cpu", num_blocks=64, max_num_seqs=4)
    engine = llm.engine.executor
    monkeypatch.setattr(engine, "device", torch.device("cuda"))  # as if on a GPU
    monkeypatch.setattr(SDPABackend, "cuda_graph_reason", None)  # as if sdpa claimed graph safety
    monkeypatch.setattr(cuda_graphs, "DecodeGraphs", functools.partial(DecodeGraphs, capture=fake_capture))
    assert engine.capture_graphs().startswith("off: the batch-1 graph's logits differ from eager ones")
    assert engine.runner.graphs is None

    def failing_capture(fn, pool):
        raise RuntimeError("operation not permitted when stream is capturing\nCUDA kernel errors ...")

    monkeypatch.setattr(cuda_graphs, "DecodeGraphs", functools.partial(DecodeGraphs, capture=failing_capture))
    assert engine.capture_graphs() == (
        "off: capture failed: RuntimeError: operation not permitted when stream is capturing"
    )
    monkeypatch.undo()  # back on the CPU: the engine steps eagerly
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


# --- on a GPU: real capture and replay ------------------------------------------------------


def cuda_reason(backend: str, dtype: str, head_dim: int, num_heads: int, num_kv_heads: int) -> str | None:
    """Why the real-GPU test of `backend` cannot run here, or None."""
    from pagedbench.backends.registry import resolve

    if not torch.cuda.is_available():
        return "needs a CUDA device"
    heads = dict(num_heads=num_heads, num_kv_heads=num_kv_heads)
    found = resolve(backend, "cuda", getattr(torch, dtype), head_dim, 16, **heads)
    return f"{backend}: {found.reason}" if found.reason else None


# (backend, dtype, preset, its head_dim / heads, the graphs' batch sizes); flash-attn has no fp32 kernels
CUDA_GRAPH_CASES = [
    ("flash-attn", "bfloat16", "qwen3-0.6b", (128, 16, 8), [1, 2, 4, 8]),
    ("flex", "float32", "tiny-llama", (32, 8, 4), [2, 4, 8]),
    ("triton", "float32", "qwen3-0.6b", (128, 16, 8), [1, 2, 4, 8]),
]


def cuda_graph_params():
    params = []
    for case in CUDA_GRAPH_CASES:
        reason = cuda_reason(case[0], case[1], *case[3])
        params.append(pytest.param(*case, id=case[0], marks=[pytest.mark.skip(reason=reason)] if reason else []))
    return params


@pytest.mark.parametrize("backend,dtype,model,heads,buckets", cuda_graph_params())
def test_cuda_graphs_on_cuda_give_the_eager_tokens(backend, dtype, model, heads, buckets):
    """On a GPU, fp32: graphs are captured and pass their start-up check, every decode step replays
    one, and the tokens equal an enforce_eager engine's, through batches shrinking across the buckets.
    Not bf16 where a backend has fp32: a graph runs the GEMMs of its padded batch, whose kernels round
    differently from the eager batch's, and on the H200 bf16 greedy tokens parted after 2-10 steps."""
    settings = dict(backend=backend, device="cuda", dtype=dtype, num_blocks=128, max_num_seqs=8)
    prompts = [{"prompt_token_ids": list(range(100 + i, 100 + i + 5 * i + 1))} for i in range(7)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 6 * i, ignore_eos=True) for i in range(7)]
    graphed = LLM(model, max_model_len=512, **settings)
    status = graphed.engine.cuda_graphs
    assert status.startswith(f"on: {len(buckets)} decode sizes up to 8"), status
    replayed = []
    graphs = graphed.engine.runner.graphs
    original = graphs.replay
    graphs.replay = lambda inputs: replayed.append(inputs.graph) or original(inputs)
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    del graphed
    eager = LLM(model, max_model_len=512, enforce_eager=True, **settings)
    assert eager.engine.cuda_graphs == "off: enforce_eager"
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert set(replayed) == set(buckets)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_backends_without_static_state_say_why_they_run_eagerly():
    llm = LLM("tiny-llama", backend="sdpa", device="cuda", num_blocks=16, max_num_seqs=4)
    assert llm.engine.cuda_graphs == "off: plan() sizes its padded K/V gather by each step's longest sequence"
