"""The Triton kernel of cascade attention's prefix pass (backends/cascade.py) for the `triton` backend.

A program takes BLOCK_R stacked query rows of one group (tokens of its member sequences, any order)
x the GROUP query heads of one KV head, packed as BLOCK_M rows, and walks the group's shared prefix
pages BLOCK_N keys at a time: each K/V tile is read once for all the rows of the program, and a
group's tiles once per BLOCK_R rows (the whole group when it fits one program). Every prefix key
precedes every row (prefix pages are full and written before the step), so there is no causal mask;
windows take the shared torch path instead. It stores each row's output, normalised, and its
log-sum-exp (natural log) for the merge with the suffix pass.
"""

import triton.language as tl
from pagedbench.backends.triton_kernels import kv_tile, softmax_step, tile_scores


def cascade_prefix(
    out_ptr,  # [R, H, V_DIM] fp32
    lse_ptr,  # [R, H] fp32
    q_ptr,  # [T, H, D]
    rows_ptr,  # [R] flat token of each stacked row
    k_cache_ptr,  # [num_blocks, PAGE_SIZE, H_kv, D]
    v_cache_ptr,
    pages_ptr,  # [prefix pages] the group's shared pages, in order
    k_scale_ptr,  # quantized pages' scales (KV_SCALES), as paged_attention's
    v_scale_ptr,
    num_rows,
    prefix_len,
    scale,
    stride_q_tok,
    stride_q_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_scale_block,
    stride_scale_slot,
    num_heads,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,  # BLOCK_R rows x GROUP_P2 heads
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    V_DIM: tl.constexpr,
    V_DIM_P2: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FP32_DOTS: tl.constexpr,
    KV_SCALES: tl.constexpr = 0,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    row = tile * BLOCK_R + m // GROUP_P2  # [BLOCK_M] stacked row of each packed row
    head = kv_head * GROUP + m % GROUP_P2
    row_ok = (row < num_rows) & (m % GROUP_P2 < GROUP)
    tok = tl.load(rows_ptr + row, mask=row < num_rows, other=0).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if FP32_DOTS:
        q = q.to(tl.float32)
    vdims = tl.arange(0, V_DIM_P2)
    vdim_ok = vdims < V_DIM
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, V_DIM_P2], tl.float32)
    for start in range(0, prefix_len, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < prefix_len
        page = tl.load(pages_ptr + pos // PAGE_SIZE, mask=pos_ok, other=0).to(tl.int64)
        slot = pos % PAGE_SIZE
        k, v = kv_tile(
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, q_ptr, page, slot, pos_ok, kv_head,
            dims, dim_ok, vdims, vdim_ok, stride_k_block, stride_k_slot, stride_k_head,
            stride_v_block, stride_v_slot, stride_v_head, stride_scale_block, stride_scale_slot,
            KV_SCALES, FP32_DOTS,
        )  # fmt: skip
        scores = tile_scores(q, k, scale, FP32_DOTS, SOFTCAP)
        scores = tl.where(pos_ok[None, :], scores * 1.4426950408889634, float("-inf"))  # log2 units
        row_max, row_sum, acc = softmax_step(scores, v, row_max, row_sum, acc, FP32_DOTS)
    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    at = row.to(tl.int64) * num_heads + head
    tl.store(out_ptr + at[:, None] * V_DIM + vdims[None, :], out, mask=row_ok[:, None] & vdim_ok[None, :])
    lse = (row_max + tl.log2(tl.where(row_sum == 0.0, 1.0, row_sum))) * 0.6931471805599453  # natural log
    tl.store(lse_ptr + at, tl.where(row_sum == 0.0, float("-inf"), lse), mask=row_ok)
