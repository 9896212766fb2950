"""flex's BlockMasks, built on the device from the block table and per-row page spans, against a
dense oracle of what each query may see: its own sequence's keys at logical positions up to its
own (and within its window), on fragmented tables with shared pages, multi-token decodes, windows
and pages smaller than a KV block."""

import numpy as np
import pytest
import torch
from pagedbench.backends.flex import FlexBackend

from pagedbench.bench.problems import place, random_problem

CPU = torch.device("cpu")


def dense_visible(meta, num_pages: int, block_size: int, window: int | None) -> torch.Tensor:
    """[tokens, slots]: whether token t's query may see cache slot s (the oracle)."""
    slots = num_pages * block_size
    table = meta.block_table.tolist()
    seen = torch.zeros(meta.num_tokens, slots, dtype=torch.bool)
    qsl, ctx = meta.query_start_loc_cpu, meta.context_lens_cpu
    for seq in range(len(ctx)):
        for i, token in enumerate(range(qsl[seq], qsl[seq + 1])):
            pos = ctx[seq] + i
            lo = 0 if window is None else max(0, pos - window + 1)
            for key in range(lo, pos + 1):
                seen[token, table[seq][key // block_size] * block_size + key % block_size] = True
    return seen


def mask_visible(backend: FlexBackend, state, meta, num_pages: int) -> torch.Tensor:
    """[tokens, slots]: what the step's BlockMasks let each real query row see (full blocks whole
    where compiled, through the mask_mod as eager flex applies it everywhere; masked blocks through
    the mask_mod; unlisted blocks nothing), mapped back to flat tokens."""
    kv_block = backend.kv_block_size
    seen = torch.zeros(meta.num_tokens, num_pages * backend.block_size, dtype=torch.bool)
    slot = torch.arange(kv_block)
    for call in state.calls:
        mask, decode = call.block_mask, call.kind == "decode"
        g = backend.packed_heads if decode else 1
        rows = mask.kv_num_blocks.shape[0 if decode else 2]
        view = (lambda t: t[:, 0, 0]) if decode else (lambda t: t[0, 0])
        lists = [(view(mask.kv_num_blocks), view(mask.kv_indices), False)]
        if mask.full_kv_num_blocks is not None:
            lists.append((view(mask.full_kv_num_blocks), view(mask.full_kv_indices), True))
        tokens = call.gather if call.gather is not None else torch.arange(call.batch * call.q_len)
        real = call.real if call.real is not None else torch.arange(call.batch * call.q_len)
        is_real = torch.zeros(call.batch * call.q_len, dtype=torch.bool)
        is_real[real] = True
        q_rows = backend._masks.decode_q_block if decode else backend.q_block_size
        for r in range(rows):
            for counts, table, full in lists:
                for block in table[r, : counts[r]].tolist():
                    keys = block * kv_block + slot
                    for q in range(q_rows):
                        flat = r * call.q_len + q // g if decode else r * q_rows + q
                        if (decode and q >= call.q_len * g) or flat >= len(is_real) or not is_real[flat]:
                            continue
                        if full and backend.compiled:
                            keep = torch.ones(kv_block, dtype=torch.bool)
                        else:
                            b, qi = (r, q) if decode else (0, flat)
                            keep = mask.mask_mod(torch.tensor(b), torch.tensor(0), torch.tensor(qi), keys)
                        seen[tokens[flat], keys[keep]] = True
    return seen


CASES = [
    # (context, query) per sequence, block size, window, shared: b -> (a, tokens)
    ([(40, 1), (0, 1), (15, 1), (70, 1)], 16, None, {}),
    ([(40, 3), (7, 8), (33, 1)], 16, None, {}),  # multi-token decodes
    ([(40, 1), (40, 1), (60, 2)], 16, None, {1: (0, 40), 2: (0, 32)}),  # shared prefix pages, a fork
    ([(100, 1), (5, 30), (60, 17)], 16, 24, {}),  # a window, decodes and prefill chunks
    ([(30, 1), (20, 9), (0, 40)], 8, None, {}),  # pages of 8 share 16-slot KV blocks
    ([(50, 2), (9, 40)], 8, 12, {}),  # shared KV blocks and a window
    ([(64, 1), (128, 1), (31, 70)], 32, None, {}),
]


@pytest.mark.parametrize("spec,block_size,window,shared", CASES, ids=[f"case{i}" for i in range(len(CASES))])
@pytest.mark.parametrize("compiled", [True, False], ids=["full-blocks", "eager"])
def test_device_built_block_masks_see_exactly_what_each_query_may(spec, block_size, window, shared, compiled):
    from pagedbench.backends.base import AttentionVariant

    problem = random_problem(spec, 4, 2, 16, seed=len(spec), shared=shared)
    meta = place(problem, block_size, layout_seed=block_size, spare_blocks=5).metadata
    variant = AttentionVariant(sliding_window=window)
    backend = FlexBackend(4, 2, 16, 0.25, block_size, CPU, torch.float32, variant=variant, compile=compiled)
    backend.decode_full_blocks = True  # CPU's choice; checked here for the listing, not the kernel
    other = place(problem, block_size, layout_seed=block_size + 1, spare_blocks=5).metadata
    backend.plan(other)  # a step on other pages first: its inverse entries must not leak into the next
    state = backend.plan(meta)
    num_pages = meta.num_cache_blocks
    want = dense_visible(meta, num_pages, block_size, window)
    got = mask_visible(backend, state, meta, num_pages)
    assert torch.equal(got, want), np.argwhere((got != want).numpy())[:5]
