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
        k = tl.load(  # [HEAD_DIM_P2, BLOCK_N]
            k_cache_ptr + page[None, :] * stride_k_block + slot[None, :] * stride_k_slot + kv_head * stride_k_head
            + dims[:, None],
            mask=pos_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )  # fmt: skip
        v = tl.load(  # [BLOCK_N, V_DIM_P2]
            v_cache_ptr + page[:, None] * stride_v_block + slot[:, None] * stride_v_slot + kv_head * stride_v_head
            + vdims[None, :],
            mask=pos_ok[:, None] & vdim_ok[None, :],
            other=0.0,
        )  # fmt: skip
        if KV_SCALES == 1:
            k = k.to(tl.float32) * tl.load(k_scale_ptr)
            v = v.to(tl.float32) * tl.load(v_scale_ptr)
        if KV_SCALES == 2:
            at = page * stride_scale_block + slot * stride_scale_slot + kv_head
            k = k.to(tl.float32) * tl.load(k_scale_ptr + at, mask=pos_ok, other=0.0).to(tl.float32)[None, :]
            v = v.to(tl.float32) * tl.load(v_scale_ptr + at, mask=pos_ok, other=0.0).to(tl.float32)[:, None]
        if KV_SCALES > 0 and not FP32_DOTS:
            k = k.to(q_ptr.dtype.element_ty)
            v = v.to(q_ptr.dtype.element_ty)
        if FP32_DOTS:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            scores = tl.dot(q, k, input_precision="ieee")
        else:
            scores = tl.dot(q, k)
        scores = scores * scale
        if SOFTCAP > 0:
            scores = SOFTCAP * (1.0 - 2.0 / (tl.exp2(scores * (2.8853900817779268 / SOFTCAP)) + 1.0))
        scores = tl.where(pos_ok[None, :], scores * 1.4426950408889634, float("-inf"))  # log2 units
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp2(scores - shift[:, None])
        alpha = tl.exp2(row_max - shift)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        if FP32_DOTS:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        row_max = new_max
    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    at = row.to(tl.int64) * num_heads + head
    tl.store(out_ptr + at[:, None] * V_DIM + vdims[None, :], out, mask=row_ok[:, None] & vdim_ok[None, :])
    lse = (row_max + tl.log2(tl.where(row_sum == 0.0, 1.0, row_sum))) * 0.6931471805599453  # natural log
    tl.store(lse_ptr + at, tl.where(row_sum == 0.0, float("-inf"), lse), mask=row_ok)
