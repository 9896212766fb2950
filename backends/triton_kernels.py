"""The Triton kernels of the `triton` backend, as plain functions: `backends/triton.py` compiles
them with `triton.jit` for CUDA tensors or wraps them in Triton's interpreter for CPU ones.

`paged_attention` is one kernel for every step kind. A program takes one query tile (up to
BLOCK_Q tokens of one sequence x the GROUP query heads of one KV head, packed as BLOCK_M rows,
so each K/V tile is read once per KV head) and one segment of that sequence's keys, and walks
the keys BLOCK_N at a time through the block table (pages read in place, any page size), with
an online softmax in fp32. Decode launches split the keys into NUM_SEGMENTS segments processed
in parallel ("flash-decoding") and `combine_segments` merges them; prefill launches use one.

Query tiles of a launch over sequences s0..s0+n-1 are numbered without host work: sequence j's
tiles start at `(qsl[s0+j] - qsl[s0] - j) // BLOCK_Q + j`, which never undercounts the tiles of
the sequences before it, and a program finds its sequence by binary search over that.

`kv_tile`, `tile_scores` and `softmax_step` (one K/V tile read and dequantized, its scores, one
online-softmax step) are `triton.jit` helpers the kernels call, this one and cascade's prefix pass
(triton_cascade_kernels.py) alike; the code generator inlines them.
"""

import triton
import triton.language as tl


def paged_attention(
    out_ptr,  # [T, H, D]
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, PAGE_SIZE, H_kv, D]
    v_cache_ptr,
    block_table_ptr,  # [B, max_blocks]
    query_start_loc_ptr,  # [B+1]
    seq_lens_ptr,  # [B]: tokens in the cache after this step's write
    sinks_ptr,  # [H] fp32: each head's sink logit (read when HAS_SINKS)
    k_scale_ptr,  # quantized pages' scales (KV_SCALES): [1] fp32, or [num_blocks, PAGE_SIZE, H_kv] fp16
    v_scale_ptr,
    part_out_ptr,  # [NUM_SEGMENTS, tokens of the launch, H, V_DIM] fp32: unnormalised partial outputs
    part_max_ptr,  # [NUM_SEGMENTS, tokens of the launch, H] fp32: running max (log2 units)
    part_sum_ptr,  # [NUM_SEGMENTS, tokens of the launch, H] fp32: softmax denominators
    scale,  # softmax scale
    seq_start,  # the launch's first sequence
    num_seqs,  # and how many it covers
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_table,
    stride_scale_block,
    stride_scale_slot,
    num_heads,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows of a program: BLOCK_Q tokens x GROUP_P2 heads
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per inner step (any multiple or fraction of a page)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    V_DIM: tl.constexpr,  # the values' dims: HEAD_DIM, or latent attention's first V_DIM dims of each key
    V_DIM_P2: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    SEGMENT_STEPS: tl.constexpr,  # BLOCK_N steps per segment; 0: the keys split evenly into NUM_SEGMENTS
    WINDOW: tl.constexpr,  # sliding window in keys (0: none): a query at p sees p - WINDOW + 1 .. p
    SOFTCAP: tl.constexpr,  # scores -> SOFTCAP * tanh(scores / SOFTCAP) (0: none)
    HAS_SINKS: tl.constexpr,
    FP32_DOTS: tl.constexpr,  # exact fp32 dots: fp32 inputs (not TF32), bf16 in the interpreter (no bf16 dot)
    # Pages as stored: 0 in the query's dtype, 1 fp8 x a per-layer scale, 2 int8 x a scale per slot and head.
    KV_SCALES: tl.constexpr = 0,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    # Which sequence owns query tile `tile`: the last j whose first tile is <= tile.
    first_token = tl.load(query_start_loc_ptr + seq_start).to(tl.int32)
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        mid_first = tl.load(query_start_loc_ptr + seq_start + mid).to(tl.int32)
        mid_first_tile = (mid_first - first_token - mid) // BLOCK_Q + mid
        if mid_first_tile <= tile:
            lo = mid
        else:
            hi = mid
    seq = seq_start + lo
    q_begin = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_end = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32)
    tile_q_start = q_begin + (tile - ((q_begin - first_token - lo) // BLOCK_Q + lo)) * BLOCK_Q
    if tile_q_start < q_end:
        seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
        context_len = seq_len - (q_end - q_begin)

        rows = tl.arange(0, BLOCK_M)
        tok = tile_q_start + rows // GROUP_P2  # [BLOCK_M] flat token index of each row
        head = kv_head * GROUP + rows % GROUP_P2
        row_ok = (tok < q_end) & (rows % GROUP_P2 < GROUP)
        dims = tl.arange(0, HEAD_DIM_P2)
        dim_ok = dims < HEAD_DIM
        q = tl.load(
            q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if FP32_DOTS:
            q = q.to(tl.float32)
        q_pos = context_len + (tok - q_begin)  # [BLOCK_M] position of each row's token

        # Keys the tile sees: up to its last token's, from its first token's window start; the
        # BLOCK_N steps over them split evenly into segments. Pages before the window are never read.
        last_tok = tl.minimum(tile_q_start + BLOCK_Q, q_end) - 1
        kv_len = context_len + (last_tok - q_begin) + 1
        first_step = 0
        if WINDOW > 0:
            first_step = tl.maximum(context_len + (tile_q_start - q_begin) - WINDOW + 1, 0) // BLOCK_N
        num_steps = (kv_len + BLOCK_N - 1) // BLOCK_N - first_step
        if SEGMENT_STEPS > 0:  # fixed-length segments (batch_invariant): a row's split is its own
            steps_per_segment = SEGMENT_STEPS
        else:
            steps_per_segment = (num_steps + NUM_SEGMENTS - 1) // NUM_SEGMENTS
        step_lo = first_step + segment * steps_per_segment
        step_hi = tl.minimum(first_step + num_steps, step_lo + steps_per_segment)

        row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_M], tl.float32)
        if HAS_SINKS:  # the sink is one more logit in the denominator: segment 0 starts with it
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            row_max = tl.where(segment == 0, sink, row_max)
            row_sum = tl.where(segment == 0, 1.0, row_sum)
        vdims = tl.arange(0, V_DIM_P2)
        vdim_ok = vdims < V_DIM
        acc = tl.zeros([BLOCK_M, V_DIM_P2], tl.float32)
        table_row = block_table_ptr + seq * stride_table
        for step in range(step_lo, step_hi):
            pos = step * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
            pos_ok = pos < kv_len
            page = tl.load(table_row + pos // PAGE_SIZE, mask=pos_ok, other=0).to(tl.int64)
            slot = pos % PAGE_SIZE
            k, v = kv_tile(
                k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, q_ptr, page, slot, pos_ok, kv_head,
                dims, dim_ok, vdims, vdim_ok, stride_k_block, stride_k_slot, stride_k_head,
                stride_v_block, stride_v_slot, stride_v_head, stride_scale_block, stride_scale_slot,
                KV_SCALES, FP32_DOTS,
            )  # fmt: skip
            scores = tile_scores(q, k, scale, FP32_DOTS, SOFTCAP)
            visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
            if WINDOW > 0:
                visible = visible & (q_pos[:, None] - pos[None, :] < WINDOW)
            scores = tl.where(visible, scores * 1.4426950408889634, float("-inf"))  # log2(e): exp2 below
            row_max, row_sum, acc = softmax_step(scores, v, row_max, row_sum, acc, FP32_DOTS)

        if NUM_SEGMENTS == 1:
            out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]  # 0 only in rows never stored
            tl.store(
                out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + vdims[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None] & vdim_ok[None, :],
            )
        else:
            # Partials of launch-local token t, head h, segment s live at ((s * tokens + t) * H + h).
            launch_tokens = tl.load(query_start_loc_ptr + seq_start + num_seqs).to(tl.int32) - first_token
            row = (segment * launch_tokens + tok - first_token).to(tl.int64) * num_heads + head
            tl.store(part_max_ptr + row, row_max, mask=row_ok)
            tl.store(part_sum_ptr + row, row_sum, mask=row_ok)
            tl.store(part_out_ptr + row[:, None] * V_DIM + vdims[None, :], acc, mask=row_ok[:, None] & vdim_ok[None, :])


def combine_segments(
    out_ptr,  # [T, H, D]
    part_out_ptr,  # [NUM_SEGMENTS, tokens, H, D] fp32
    part_max_ptr,  # [NUM_SEGMENTS, tokens, H] fp32
    part_sum_ptr,
    token_start,  # the launch's first flat token
    num_tokens,  # tokens of the launch
    stride_o_tok,
    stride_o_head,
    num_heads,
    BLOCK_H: tl.constexpr,  # heads per program
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    """One program per (token, BLOCK_H heads): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s."""
    tok = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    segs = tl.arange(0, NUM_SEGMENTS)
    dims = tl.arange(0, HEAD_DIM_P2)
    head_ok = heads < num_heads
    row = (segs[:, None].to(tl.int64) * num_tokens + tok) * num_heads + heads[None, :]  # [NUM_SEGMENTS, BLOCK_H]
    seg_max = tl.load(part_max_ptr + row, mask=head_ok[None, :], other=0.0)
    seg_sum = tl.load(part_sum_ptr + row, mask=head_ok[None, :], other=1.0)
    weight = tl.exp2(seg_max - tl.max(seg_max, 0)[None, :])  # an empty segment (max -inf) weighs 0
    ok = head_ok[None, :, None] & (dims[None, None, :] < HEAD_DIM)
    acc = tl.load(part_out_ptr + row[:, :, None] * HEAD_DIM + dims[None, None, :], mask=ok, other=0.0)
    out = tl.sum(acc * weight[:, :, None], 0) / tl.sum(seg_sum * weight, 0)[:, None]  # [BLOCK_H, HEAD_DIM_P2]
    tl.store(
        out_ptr + (token_start + tok) * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None] & (dims[None, :] < HEAD_DIM),
    )


@triton.jit
def kv_tile(
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, q_ptr, page, slot, pos_ok, kv_head,
    dims, dim_ok, vdims, vdim_ok, stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head, stride_scale_block, stride_scale_slot,
    KV_SCALES: tl.constexpr, FP32_DOTS: tl.constexpr,
):  # fmt: skip
    """The K tile [HEAD_DIM_P2, BLOCK_N] and V tile [BLOCK_N, V_DIM_P2] of the keys at (page, slot) of
    one KV head, read in place and dequantized in registers (the pages stay 1 byte per value in
    memory), in the dots' dtype: q's, or fp32 with FP32_DOTS."""
    k = tl.load(
        k_cache_ptr + page[None, :] * stride_k_block + slot[None, :] * stride_k_slot + kv_head * stride_k_head
        + dims[:, None],
        mask=pos_ok[None, :] & dim_ok[:, None],
        other=0.0,
    )  # fmt: skip
    v = tl.load(
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
    return k, v


@triton.jit
def tile_scores(q, k, scale, FP32_DOTS: tl.constexpr, SOFTCAP: tl.constexpr):
    """q . k^T times `scale`, soft-capped (tanh(x) = 1 - 2 / (e^2x + 1), exact at both infinities)."""
    if FP32_DOTS:
        scores = tl.dot(q, k, input_precision="ieee")
    else:
        scores = tl.dot(q, k)
    scores = scores * scale
    if SOFTCAP > 0:
        scores = SOFTCAP * (1.0 - 2.0 / (tl.exp2(scores * (2.8853900817779268 / SOFTCAP)) + 1.0))
    return scores


@triton.jit
def softmax_step(scores, v, row_max, row_sum, acc, FP32_DOTS: tl.constexpr):
    """One online-softmax step over a tile's masked scores (log2 units): the new (row_max, row_sum, acc)."""
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    # A row that has seen no key yet keeps max -inf; subtracting 0 keeps exp2 finite.
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    p = tl.exp2(scores - shift[:, None])
    alpha = tl.exp2(row_max - shift)
    row_sum = row_sum * alpha + tl.sum(p, 1)
    if FP32_DOTS:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return new_max, row_sum, acc
