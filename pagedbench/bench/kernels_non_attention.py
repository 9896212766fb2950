"""What `pagedbench kernels` times beside paged attention: a hybrid model's gated DeltaNet layer
(variant gdn, its own rows) and DeepSeek-V3.2's indexer (the dsa variant's `indexer` columns).
The grid and the attention rows are kernels.py's."""

import statistics
from dataclasses import replace

import torch

from pagedbench.bench.timing import forward_columns, time_kernel

# Not attention: a hybrid model's gated DeltaNet layer (projections, conv window, gated delta rule, gated
# norm) through each linear_attention_kernel; --heads reads as value/key heads, --head-dim as both head dims.
GDN = "gdn"
INDEXER_HEADS, INDEXER_DIM = 64, 128  # DeepSeek-V3.2's index_n_heads, index_head_dim


def indexer_columns(batch, topk: int, grid, device, dtype) -> dict:
    """DeepSeek-V3.2's selection at the point, timed apart from attention: 64 index heads of 128 score
    every cached token of each query's sequence (index keys paged beside the latents) and keep the
    top-k (model/sparse_index.py, the engine's own step). `grid`: the kernels.KernelGrid."""
    from pagedbench.model.sparse_index import SparseStep, sequence_slots

    meta = batch.metadata
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(*batch.k_cache.shape[:2], INDEXER_DIM, generator=gen).to(device, dtype)
    layout = (sequence_slots(meta), meta.positions, meta.query_start_loc_cpu, meta.num_decodes)
    step = SparseStep([(cache, None)], meta.slot_mapping, *layout, topk, INDEXER_DIM**-0.5)
    q = torch.randn(meta.num_tokens, INDEXER_HEADS, INDEXER_DIM, generator=gen).to(device, dtype)
    keys = torch.randn(meta.num_tokens, INDEXER_DIM, generator=gen).to(device, dtype)
    weights = torch.randn(meta.num_tokens, INDEXER_HEADS, generator=gen).to(device)
    times = time_kernel(lambda: step.select(0, q, keys, weights), device, grid.warmup, grid.repeats)
    return {"indexer_min_ms": 1e3 * min(times), "indexer_median_ms": 1e3 * statistics.median(times)}


def gdn_rows(spec, shape: tuple, grid, device, dtype, head: dict) -> list[dict]:
    """Variant gdn at one point: a gated DeltaNet layer's forward over the point's batch (each
    sequence's state in a slot: a decode or a chunk after cached tokens continues it, a prompt starts
    from zeros) through each of grid.linear_kernels, one row each. kv_bytes are the fp32 states read
    and written; flops the recurrence's (S^T k, the rank-one update, S^T q: 6 x value heads x d^2 per
    token). fla interpreted on CPU runs once, with the caveat as its reason. `grid`: the kernels.KernelGrid;
    `head`: the environment and bandwidth columns."""
    from pagedbench.bench.check_linear import linear_config, linear_layer
    from pagedbench.model.delta_rule import fla_unavailable_reason, kernel_provider, timing_caveat
    from pagedbench.model.layers import AttentionContext
    from pagedbench.worker.linear_state import LinearStateCache, LinearStep

    phase, batch_size, context_len, value_heads, key_heads = shape
    d, tokens = grid.head_dim, sum(q for _, q in spec)
    point = {
        "variant": GDN,
        "phase": phase,
        "query_len": 1,
        "batch_size": batch_size,
        "context_len": context_len,
        "num_heads": value_heads,
        "num_kv_heads": key_heads,
        "head_dim": d,
        "num_query_tokens": tokens,
        "kv_bytes": 2 * len(spec) * value_heads * d * d * 4,
        "flops": 6 * tokens * value_heads * d * d,
        **head,
    }
    cfg = linear_config(key_heads, value_heads, d, value_heads * d)
    layer = linear_layer(0, device, dtype, cfg)
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    qsl = [0]
    for _, q in spec:
        qsl.append(qsl[-1] + q)
    rows = []
    for kernel in grid.linear_kernels:
        row = {"backend": f"{GDN}-{kernel}", "linear_attention_kernel": kernel, **point}
        reason = fla_unavailable_reason(device.type) if kernel == "fla" else None
        if reason:
            rows.append({**row, "provider": "", "status": "unavailable", "reason": reason})
            continue
        cache = LinearStateCache.allocate(cfg, [0], len(spec), device, dtype)
        cache.kernel = kernel
        cache.recurrent[0].normal_(std=0.1)  # states of the cached tokens
        # One step view for every call: its index tensors are built once, as once per step for all layers.
        step = LinearStep(cache, list(range(len(spec))), qsl, [cached for cached, _ in spec])
        ctx = AttentionContext([], [], None, [], linear=step)
        caveat = timing_caveat(kernel, device)
        timing = replace(grid, warmup=0, repeats=1) if caveat else grid

        def forward(ctx=ctx):
            with torch.no_grad():
                layer(x, ctx)

        if not timing.warmup:
            forward()  # the step's index tensors (and fla's first-call work) untimed
        times = time_kernel(forward, device, timing.warmup, timing.repeats)
        rows.append(
            {
                **row,
                "provider": kernel_provider(kernel, device),
                "status": "ok",
                "reason": caveat or "",
                **forward_columns(times, point),
                "warmup": timing.warmup,
                "repeats": timing.repeats,
            }
        )
    return rows
