"""FlexAttention backend: compiled and eager against `reference`, compile counts, and the pitfalls
of a BlockMask built from a page table.

Split between the two modes: tests/test_backends.py already runs the whole matrix (dtypes x head
dims x block sizes x MHA/GQA/MQA x decode/prefill/mixed) through the default, compiled backend:
one graph per configuration, ~10 s each on a CPU. Eager flex (mask_mod alone, no block sparsity)
is cheap, so here it covers a representative slice of that matrix; the pitfall cases run in both
modes, mostly on the configuration that test_backends has already compiled (GQA, d64, fp32).
"""

import dataclasses
import importlib.util
import random

import pytest
import torch
from pagedbench.backends import flex
from pagedbench.backends.base import AttentionVariant
from pagedbench.backends.flex import FlexBackend

from pagedbench import LLM, SamplingParams
from pagedbench.bench.kernels import batch_spec
from pagedbench.bench.problems import random_attention_batch
from tests.helpers import DEVICES
from tests.test_backends import HEADS, TOLERANCE, ragged_batch_spec, run_backend

MODES = [pytest.param(True, id="compiled"), pytest.param(False, id="eager")]


def check_flex(
    spec,
    device="cpu",
    compile=True,
    block_size=16,
    heads=(8, 2),
    head_dim=64,
    dtype=torch.float32,
    seed=0,
    spare_blocks=3,
    null_block=True,
    **kwargs,
):
    """flex == reference on the batch `spec` (context_len, query_len per sequence); returns the batch."""
    batch = random_attention_batch(
        spec, *heads, head_dim, block_size, dtype, device, seed=seed, spare_blocks=spare_blocks, null_block=null_block
    )
    args = (batch, *heads, head_dim, block_size, dtype, device)
    expected = run_backend("reference", *args)
    got = run_backend("flex", *args, compile=compile, **kwargs)
    torch.testing.assert_close(
        got.float(),
        expected.float(),
        atol=TOLERANCE[dtype],
        rtol=TOLERANCE[dtype],
        msg=lambda m: f"flex (compile={compile}) vs reference on {spec}: {m}",
    )
    return batch


@pytest.mark.parametrize(
    "dtype,head_dim,block_size",
    [(torch.float32, 64, 16), (torch.bfloat16, 128, 128)],
    ids=["fp32-d64-bs16", "bf16-d128-bs128"],
)
@pytest.mark.parametrize("phase", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("heads", HEADS)
def test_eager_matches_reference(dtype, head_dim, block_size, phase, heads):
    rng = random.Random(f"eager-{phase}-{heads}-{block_size}")
    for trial in range(2):
        check_flex(
            ragged_batch_spec(phase, block_size, rng),
            compile=False,
            block_size=block_size,
            heads=HEADS[heads],
            head_dim=head_dim,
            dtype=dtype,
            seed=trial,
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compile", MODES)
def test_stale_table_entries_are_masked(device, compile):
    """Table rows are padded with 0, here a live page of another sequence (no null block, no spare pages)."""
    spec = [(3, 1), (17, 1), (0, 5), (0, 40), (20, 7)]
    batch = check_flex(spec, device, compile, spare_blocks=0, null_block=False)
    meta = batch.metadata
    used = [-(-n // 16) for n in meta.seq_lens_cpu]
    assert any(n < meta.block_table.shape[1] for n in used)  # some rows do have stale entries
    assert 0 in [p for row, n in zip(meta.block_table.tolist(), used) for p in row[:n]]  # page 0 is live


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compile", MODES)
def test_page_boundary_at_seq_len_and_partial_pages(device, compile):
    spec = [(15, 1), (31, 1), (16, 1), (0, 16), (0, 32), (16, 16), (15, 2), (0, 17)]
    check_flex(spec, device, compile)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compile", MODES)
@pytest.mark.parametrize(
    "spec", [[(0, 1)], [(7, 1)], [(0, 1), (0, 1), (5, 1), (0, 3), (4, 1)]], ids=["one-token", "one-decode", "several"]
)
def test_length_one_sequences(device, compile, spec):
    check_flex(spec, device, compile)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compile", MODES)
@pytest.mark.parametrize("q_block_size", [None, 128])
def test_many_short_sequences_in_one_query_block(device, compile, q_block_size):
    """Rows of the mask span many sequences; each may only see its own pages."""
    rng = random.Random(1)
    spec = [(rng.randint(0, 40), 1) for _ in range(30)] + [(rng.randint(0, 40), rng.randint(2, 4)) for _ in range(20)]
    check_flex(spec, device, compile, q_block_size=q_block_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compile", MODES)
@pytest.mark.parametrize("phase", ["decode", "mixed"])
def test_pages_smaller_than_a_kv_block(device, compile, phase):
    """8-slot pages: two pages, maybe of two sequences, share one 16-slot KV block."""
    for trial in range(2):
        check_flex(
            ragged_batch_spec(phase, 8, random.Random(trial)),
            device,
            compile,
            block_size=8,
            heads=(4, 2),
            head_dim=16,
            seed=trial,
        )


def step_metadata(spec, block_size):
    """The step's AttentionMetadata for `spec` on fragmented block tables: a batch of one head of one
    dimension holds it at little cost at any size."""
    return random_attention_batch(spec, 1, 1, 1, block_size).metadata


def test_block_mask_lists_each_sequences_own_pages():
    """Decodes get one BlockMask row each, listing exactly their own pages (the ones every query
    sees whole as full blocks); prefill chunks get query blocks of their own sequence only."""
    spec = [(15, 1), (40, 1), (0, 20), (9, 30)]
    meta = step_metadata(spec, 16)
    backend = FlexBackend(8, 2, 64, 0.125, 16, torch.device("cpu"), torch.float32, q_block_size=16)
    decode, prefill = backend.plan(meta).calls
    table, num_pages = meta.block_table.tolist(), meta.num_cache_blocks
    assert (decode.kind, decode.batch, decode.q_len) == ("decode", 2, 1) and decode.gather is None
    mask = decode.block_mask
    # On CPU a row's 4 query heads per KV head are packed into its query rows, one query block.
    assert mask.seq_lengths == (4, num_pages * 16) and mask.BLOCK_SIZE == (32, 16)
    assert mask.kv_indices.shape[-1] >= num_pages  # as wide as the cache's KV-block count
    # Sequence 0: 16 tokens, one page, seen whole by its query at position 15. Sequence 1: 41 tokens,
    # pages 0-1 full, page 2 holds its query's own position.
    assert mask.full_kv_num_blocks.flatten().tolist() == [1, 2] and mask.kv_num_blocks.flatten().tolist() == [0, 1]
    assert mask.full_kv_indices[0, 0, 0, :1].tolist() == table[0][:1]
    assert mask.full_kv_indices[1, 0, 0, :2].tolist() == table[1][:2]
    assert mask.kv_indices[1, 0, 0, :1].tolist() == table[1][2:3]
    # Prefill: 20 tokens -> blocks at positions 0-15, 16-19; 30 after 9 cached -> 9-24, 25-38; a spare row.
    mask = prefill.block_mask
    assert (prefill.kind, prefill.batch, prefill.q_len) == ("prefill", 1, 64)
    assert mask.seq_lengths == (64, num_pages * 16)
    assert mask.kv_num_blocks.flatten().tolist() == [1, 1, 2, 2, 0]
    assert mask.full_kv_num_blocks.flatten().tolist() == [0, 1, 0, 1, 0]
    assert mask.full_kv_indices[0, 0, 3, :1].tolist() == table[3][:1]
    assert mask.kv_indices[0, 0, 3, :2].tolist() == table[3][1:3]
    assert prefill.real.tolist() == [*range(20), *range(32, 62)]
    assert prefill.dest.tolist() == list(range(2, 52))


def share_pages(batch, pairs):
    """Point sequence b's logical page j at sequence a's page i, for (a, i, b, j) in `pairs` (those
    pages must hold context only): the shared-page case of prefix caching, forks and beams."""
    table = batch.metadata.block_table.clone()
    for a, i, b, j in pairs:
        table[b, j] = table[a, i]
    return dataclasses.replace(batch, metadata=dataclasses.replace(batch.metadata, block_table=table))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("compile", MODES)
def test_shared_pages_give_every_sequence_its_answer(compile, dtype):
    """A shared prefix (same logical pages), a page shared at different logical positions, and two
    forks with identical tables including a partial last page: each sequence equals `reference`."""
    spec = [(40, 1), (47, 1), (33, 1), (33, 1), (36, 12), (50, 20)]
    batch = random_attention_batch(spec, 8, 2, 64, 16, dtype)
    fork_table = batch.metadata.block_table[2]
    batch = share_pages(batch, [(0, 0, 1, 0), (0, 1, 1, 1), (0, 0, 4, 1), (1, 0, 5, 2), (0, 1, 5, 0)])
    batch.metadata.block_table[3] = fork_table  # sequence 3 is a fork of 2: the same pages, the same length
    batch.q[3] = batch.q[2]  # and the same last token
    args = (batch, 8, 2, 64, 16, dtype, "cpu")
    expected = run_backend("reference", *args)
    got = run_backend("flex", *args, compile=compile)
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    torch.testing.assert_close(got[3], got[2], atol=1e-6, rtol=0)  # forks: same pages, same query -> same answer
    unshared = random_attention_batch(spec, 8, 2, 64, 16, dtype)
    assert not torch.allclose(
        got[4].float(), run_backend("flex", unshared, *args[1:], compile=compile)[4].float(), atol=0.1
    )  # sharing mattered


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("compile", MODES)
@pytest.mark.parametrize("phase", ["decode", "mixed"])
def test_output_depends_on_logical_content_not_placement(compile, phase, dtype):
    """Moving every page to another physical block (and the table with it) changes nothing."""
    batch = random_attention_batch(ragged_batch_spec(phase, 16, random.Random(7)), 8, 2, 64, 16, dtype, seed=7)
    num_pages = batch.k_cache.shape[0]
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(1))
    moved_k, moved_v = torch.empty_like(batch.k_cache), torch.empty_like(batch.v_cache)
    moved_k[perm], moved_v[perm] = batch.k_cache, batch.v_cache
    meta = batch.metadata
    moved_meta = dataclasses.replace(
        meta,
        block_table=perm[meta.block_table.long()].to(torch.int32),
        slot_mapping=perm[meta.slot_mapping // 16] * 16 + meta.slot_mapping % 16,
    )
    moved = dataclasses.replace(batch, k_cache=moved_k, v_cache=moved_v, metadata=moved_meta)
    args = (8, 2, 64, 16, dtype, "cpu")
    here = run_backend("flex", batch, *args, compile=compile)
    there = run_backend("flex", moved, *args, compile=compile)
    torch.testing.assert_close(there, here, atol=1e-5, rtol=1e-5)  # the same computation, only other addresses


def efficiency(spec, block_size=16, q_block_size=None):
    backend = FlexBackend(16, 8, 128, 0.088, block_size, torch.device("cpu"), torch.bfloat16, q_block_size=q_block_size)
    return backend.tile_efficiency(backend.plan(step_metadata(spec, block_size)))


@pytest.mark.parametrize("batch_size", [1, 16, 64, 256])
@pytest.mark.parametrize("context_len", [512, 2048, 16384])
def test_decode_tile_efficiency(batch_size, context_len):
    """Score entries computed for a decode batch are almost all kept: each row reads its own pages."""
    assert efficiency(batch_spec("decode", batch_size, context_len)) >= 0.9


@pytest.mark.parametrize("q_block_size", [16, 128])
@pytest.mark.parametrize("batch_size,context_len", [(1, 512), (16, 2048), (64, 4096)])
def test_mixed_tile_efficiency(batch_size, context_len, q_block_size):
    assert efficiency(batch_spec("mixed", batch_size, context_len), q_block_size=q_block_size) >= 0.5


def test_tile_efficiency_counts_what_the_mask_drops():
    """Independent numbers: one decode at position 20 (21 keys in pages of 16) computes 2 blocks = 32
    entries and keeps 21; a 16-token prompt in one 16-row block computes 256 entries, keeps 136.
    Together they count per query token (a decode row's packed heads weigh as much as a prefill row)."""
    assert efficiency([(20, 1)]) == pytest.approx(21 / 32)
    assert efficiency([(0, 16)], q_block_size=16) == pytest.approx(136 / 256)
    assert efficiency([(20, 1), (0, 16)], q_block_size=16) == pytest.approx((21 + 136) / (32 + 256))


def test_int32_overflow_is_refused():
    batch = random_attention_batch([(3, 1)], 2, 1, 8, 16)
    backend = FlexBackend(2, 1, 8, 0.125, 16, torch.device("cpu"), torch.float32)
    huge = dataclasses.replace(batch.metadata, num_cache_blocks=2**27 + 1)  # 2**31 + 16 slots
    with pytest.raises(ValueError, match="int32"):
        backend.plan(huge)


def test_recompiles_stay_within_capacity_buckets():
    """Token counts and batch sizes are dynamic: a run of varied batches compiles one graph per call
    kind (decodes of 1 to 8 tokens, whose query heads are packed into their rows on CPU, and
    prefill chunks), and crossing the token capacity one more. The configuration is used by no other test."""
    before = flex.compile_stats["graphs"]
    rng = random.Random(0)
    for step in range(8):
        spec = [(rng.randint(0, 90), 1) for _ in range(rng.randint(0, 9))] + [
            (rng.randint(0, 60), rng.randint(2, 120)) for _ in range(rng.randint(1 if step % 3 else 0, 4))
        ]
        check_flex(spec or [(0, 1)], block_size=32, heads=(2, 1), head_dim=32, seed=step)
    assert flex.compile_stats["graphs"] - before == 2
    check_flex([(0, flex.MIN_TOKEN_CAPACITY + 50)], block_size=32, heads=(2, 1), head_dim=32)
    assert flex.compile_stats["graphs"] - before == 3


def test_engine_run_compiles_once(tiny_models):
    """Varied batch sizes, chunked prefills and decodes through the engine: at most one graph per
    call kind (none when test_generate_hf already compiled this configuration), and sdpa's greedy tokens."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 90))] for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {}
    before = flex.compile_stats["graphs"]
    for backend in ("sdpa", "flex"):
        llm = LLM(
            tiny_models["llama"][0],
            backend=backend,
            device="cpu",
            dtype="float32",
            max_num_batched_tokens=64,
            max_num_seqs=6,
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs[backend] = [o.outputs[0].token_ids for o in outs]
    assert outputs["flex"] == outputs["sdpa"]
    assert flex.compile_stats["graphs"] - before <= 2  # decodes (GQA packed), prefill


def test_compile_switches():
    args = (4, 2, 64, 0.125, 16, torch.device("cpu"), torch.float32)
    assert FlexBackend(*args).compiled and not FlexBackend(*args, compile=False).compiled
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDBENCH_FLEX_COMPILE", "0")
        assert not FlexBackend(*args).compiled
        assert FlexBackend.provider() == f"torch {torch.__version__} flex eager"
    assert FlexBackend.provider() == f"torch {torch.__version__} flex compiled"


def test_unavailable_reason():
    assert FlexBackend.unavailable_reason("cpu", torch.float32, 64, 16) is None
    assert FlexBackend.unavailable_reason("cpu", torch.bfloat16, 128, 8) is None
    assert "power of two" in FlexBackend.unavailable_reason("cpu", torch.float32, 64, 24)
    assert FlexBackend.unavailable_reason("cpu", torch.float64, 64, 16) is not None


def test_flash_kernel_choice(monkeypatch):
    """PAGEDBENCH_FLEX_KERNEL=flash asks for FlexAttention's FA4 kernels: refused, with the reason,
    where they cannot run; a bad value is a reason too."""
    monkeypatch.setenv("PAGEDBENCH_FLEX_KERNEL", "flash")
    assert FlexBackend.unavailable_reason("cpu", torch.float32, 64, 16) == (
        "PAGEDBENCH_FLEX_KERNEL=flash: FA4 kernels need CUDA (device is cpu)"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    assert FlexBackend.unavailable_reason("cuda", torch.bfloat16, 128, 16) == (
        "PAGEDBENCH_FLEX_KERNEL=flash: flash_attn.cute (FA4) is not installed (pip install 'pagedbench[fa4]')"
    )
    assert "flex compiled, FA4 prefill kernels (BACKEND=FLASH)" in FlexBackend.provider(device="cuda")
    assert FlexBackend.provider(device="cpu").endswith("flex compiled")
    monkeypatch.setenv("PAGEDBENCH_FLEX_KERNEL", "cutlass")
    assert FlexBackend.unavailable_reason("cpu", torch.float32, 64, 16) == (
        "PAGEDBENCH_FLEX_KERNEL='cutlass' is not one of triton, flash"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's FA4 kernels need CUDA")
@pytest.mark.parametrize("phase", ["decode", "mixed"])
def test_flash_kernels_match_triton_on_cuda(monkeypatch, phase):
    monkeypatch.setenv("PAGEDBENCH_FLEX_KERNEL", "flash")
    reason = FlexBackend.unavailable_reason("cuda", torch.bfloat16, 128, 16)
    if reason:
        pytest.skip(reason)
    batch = random_attention_batch(
        ragged_batch_spec(phase, 16, random.Random(3)), 16, 8, 128, 16, torch.bfloat16, "cuda"
    )
    args = (batch, 16, 8, 128, 16, torch.bfloat16, "cuda")
    flash = run_backend("flex", *args)
    monkeypatch.setenv("PAGEDBENCH_FLEX_KERNEL", "triton")
    triton = run_backend("flex", *args)
    torch.testing.assert_close(flash.float(), triton.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(flash.float(), run_backend("reference", *args).float(), atol=2e-2, rtol=2e-2)


def test_recompile_limit_raises_instead_of_falling_back(monkeypatch):
    """Dynamo past its recompile limit would silently run flex unfused; the backend makes it an error."""
    check_flex([(5, 1), (0, 9)])  # at least one graph exists
    monkeypatch.setattr(flex, "RECOMPILE_LIMIT", 1)
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        check_flex([(5, 1), (0, 9)], heads=(3, 3), head_dim=16)  # a new configuration needs a new graph
    monkeypatch.undo()
    before = flex.compile_stats["graphs"]
    check_flex([(5, 1), (0, 9)], heads=(3, 3), head_dim=16)
    assert flex.compile_stats["graphs"] - before == 2  # decode and prefill graphs after all: no eager path left behind


@pytest.mark.parametrize("compile", MODES)
def test_decode_without_full_blocks_as_on_cuda(compile):
    """On CUDA decodes list every page as masked (flex's decoding kernel then splits each row's own
    pages across thread blocks); the same mask, run here, still equals reference."""
    spec = ragged_batch_spec("mixed", 16, random.Random(4))
    batch = random_attention_batch(spec, 8, 2, 64, 16, seed=4)
    backend = FlexBackend(8, 2, 64, 64**-0.5, 16, torch.device("cpu"), torch.float32, compile=compile)
    backend.decode_full_blocks = False
    state = backend.plan(batch.metadata)
    assert state.calls[0].kind == "decode" and state.calls[0].block_mask.full_kv_num_blocks is None
    got = backend.forward(batch.q, batch.k_cache, batch.v_cache, state)
    expected = run_backend("reference", batch, 8, 2, 64, 16, torch.float32, "cpu")
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("compile", MODES)
def test_prefill_mask_as_narrow_as_flash_requires(compile):
    """FA4's flex kernels (BACKEND=FLASH, on H200: "n-block dimension must be <= 16") take a prefill
    index table no wider than the cache's KV-block count; the narrowed mask, run here, still equals
    reference (the CUDA kernel itself is checked by test_flash_kernels_match_triton_on_cuda)."""
    spec = ragged_batch_spec("mixed", 16, random.Random(3))
    batch = random_attention_batch(spec, 8, 2, 64, 16, seed=3)
    backend = FlexBackend(8, 2, 64, 64**-0.5, 16, torch.device("cpu"), torch.float32, compile=compile)
    backend._masks.exact_prefill_width = True
    state = backend.plan(batch.metadata)
    prefill = next(call for call in state.calls if call.kind == "prefill")
    num_pages = batch.k_cache.shape[0]
    assert prefill.block_mask.kv_indices.shape[-1] == num_pages  # pages of 16 = KV blocks of 16
    assert prefill.block_mask.full_kv_indices.shape[-1] == num_pages
    got = backend.forward(batch.q, batch.k_cache, batch.v_cache, state)
    expected = run_backend("reference", batch, 8, 2, 64, 16, torch.float32, "cpu")
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


def test_page_size_is_a_compile_time_constant():
    """The mask_mod reads the page size from a static shape, not a captured int (which dynamo would
    make a dynamic symbol, and FLASH refuses): another page size compiles its own graph."""
    check_flex([(20, 1), (0, 40)], block_size=16, heads=(2, 1), head_dim=32)
    before = flex.compile_stats["graphs"]
    check_flex([(20, 1), (0, 40)], block_size=64, heads=(2, 1), head_dim=32)
    assert flex.compile_stats["graphs"] - before == 2  # decode and prefill graphs for pages of 64


@pytest.mark.parametrize("block_size", [16, 8])  # 8: pages share a KV block of 16
def test_a_window_leaves_the_pages_before_it_out_of_the_block_mask(block_size):
    """Pages wholly before every query's window are not listed (not merely masked): a decode at
    position 300 with a 33-token window lists the 3 pages of keys 268..300, not all 19; a prefill
    block lists pages from its first query's window start. Pages inside every query's window and
    before the first query are full blocks (no mask_mod)."""
    window = AttentionVariant(sliding_window=33)
    meta = step_metadata([(300, 1), (40, 1), (200, 20)], block_size)
    counts = {}
    for variant in (window, AttentionVariant()):
        backend = FlexBackend(8, 2, 64, 0.125, block_size, torch.device("cpu"), torch.float32, variant, compile=False)
        state = backend.plan(meta)
        for call in state.calls:
            mask = call.block_mask
            full = (
                mask.full_kv_num_blocks if mask.full_kv_num_blocks is not None else torch.zeros_like(mask.kv_num_blocks)
            )
            counts[variant, call.kind] = (mask.kv_num_blocks + full).reshape(-1).tolist()

    def pages(first: int, last: int) -> int:  # pages holding keys first..last
        return last // block_size - first // block_size + 1

    # Pages of 8 share KV blocks of 16 (listed once per block): at most one listing per page.
    listed = (lambda got, want: got == want) if block_size >= 16 else (lambda got, want: 0 < got <= want)
    assert listed(counts[window, "decode"][0], pages(268, 300)) and listed(counts[window, "decode"][1], pages(8, 40))
    assert counts[AttentionVariant(), "decode"][0] > 2 * pages(268, 300)
    # The chunk (positions 200..219) starts its window at key 168.
    assert listed(counts[window, "prefill"][0], pages(168, 219))
