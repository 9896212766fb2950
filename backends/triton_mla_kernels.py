"""The `triton` backend's kernel for latent attention (DeepSeek's MLA, run absorbed), as a plain
function that `backends/triton.py` compiles for CUDA or interprets for CPU tensors.

Every query head reads the same one-"head" latent cache: per token, kv_lora_rank latent dims
(which are also the values) and rope_dim rotated key dims, 512 + 64 for DeepSeek-V3. Its heads
(128 for DeepSeek-V3) are too many, and its head dim too wide, for one program of the generic
kernel, so here a program takes one query token x BLOCK_H of its heads and one segment of its
keys: the latent tile is loaded once per BLOCK_N keys and used twice, as keys (with the rope
tile) and, transposed, as values. The key dims are two dots (latent + rope), so nothing pads
576 up to 1024. Decode launches split the keys into NUM_SEGMENTS segments and write partials in
the generic kernel's layout, merged by its `combine_segments`; other tokens (prefill chunks)
run one program per token and head block, unsplit.

Sparse attention (DeepSeek-V3.2, SPARSE): the keys are the TOPK cache slots the indexer selected for
the token (-1: none), read through the slot numbers instead of the block table; the rest is alike.
"""

import triton.language as tl


def mla_attention(
    out_ptr,  # [T, H, V_DIM]
    q_ptr,  # [T, H, V_DIM + ROPE_DIM]: the absorbed query, latent dims then rope dims
    cache_ptr,  # [num_blocks, PAGE_SIZE, 1, V_DIM + ROPE_DIM]: the latent, then the rotated key part
    block_table_ptr,  # [B, max_blocks]
    query_start_loc_ptr,  # [B+1]
    seq_lens_ptr,  # [B]: tokens in the cache after this step's write
    scale_ptr,  # quantized pages' scale (KV_SCALES): [1] fp32, or [num_blocks, PAGE_SIZE, 1] fp16
    part_out_ptr,  # [NUM_SEGMENTS, tokens of the launch, H, V_DIM] fp32: unnormalised partial outputs
    part_max_ptr,  # [NUM_SEGMENTS, tokens of the launch, H] fp32: running max (log2 units)
    part_sum_ptr,  # [NUM_SEGMENTS, tokens of the launch, H] fp32: softmax denominators
    selected_ptr,  # SPARSE: [T, TOPK] int64 cache slots each token reads (-1: none)
    scale,  # softmax scale
    seq_start,  # the launch's first sequence
    num_seqs,  # and how many it covers
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_block,
    stride_c_slot,
    stride_table,
    stride_scale_block,
    stride_scale_slot,
    stride_selected,
    num_heads,
    BLOCK_H: tl.constexpr,  # query heads per program
    BLOCK_N: tl.constexpr,  # keys per inner step
    V_DIM: tl.constexpr,  # kv_lora_rank: the latent dims, which are the values
    V_DIM_P2: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    ROPE_P2: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    FP32_DOTS: tl.constexpr,
    # Pages as stored: 0 in the query's dtype, 1 fp8 x a per-layer scale, 2 int8 x a scale per slot.
    KV_SCALES: tl.constexpr = 0,
    SPARSE: tl.constexpr = False,
    TOPK: tl.constexpr = 1,
):
    token = tl.program_id(0)  # of the launch
    head_block = tl.program_id(1)
    segment = tl.program_id(2)

    # Which sequence owns the token: the last j with query_start_loc[seq_start + j] <= it.
    first_token = tl.load(query_start_loc_ptr + seq_start).to(tl.int32)
    tok = first_token + token
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + seq_start + mid).to(tl.int32) <= tok:
            lo = mid
        else:
            hi = mid
    seq = seq_start + lo
    q_end = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32)
    kv_len = tl.load(seq_lens_ptr + seq).to(tl.int32) - (q_end - tok) + 1  # keys up to the token's own

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    vdims = tl.arange(0, V_DIM_P2)
    vdim_ok = vdims < V_DIM
    rdims = tl.arange(0, ROPE_P2)
    rdim_ok = rdims < ROPE_DIM
    q_row = q_ptr + tok * stride_q_tok + heads[:, None] * stride_q_head
    q_lat = tl.load(q_row + vdims[None, :], mask=head_ok[:, None] & vdim_ok[None, :], other=0.0)
    q_rope = tl.load(q_row + V_DIM + rdims[None, :], mask=head_ok[:, None] & rdim_ok[None, :], other=0.0)
    if FP32_DOTS:
        q_lat = q_lat.to(tl.float32)
        q_rope = q_rope.to(tl.float32)

    num_steps = (kv_len + BLOCK_N - 1) // BLOCK_N
    if SPARSE:
        num_steps = (TOPK + BLOCK_N - 1) // BLOCK_N
    steps_per_segment = (num_steps + NUM_SEGMENTS - 1) // NUM_SEGMENTS
    step_lo = segment * steps_per_segment
    step_hi = tl.minimum(num_steps, step_lo + steps_per_segment)

    row_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, V_DIM_P2], tl.float32)
    table_row = block_table_ptr + seq * stride_table
    for step in range(step_lo, step_hi):
        pos = step * BLOCK_N + tl.arange(0, BLOCK_N)
        if SPARSE:  # the selected slots, not the sequence's positions
            chosen = tl.load(selected_ptr + tok * stride_selected + pos, mask=pos < TOPK, other=-1).to(tl.int64)
            pos_ok = chosen >= 0
            page = tl.where(pos_ok, chosen // PAGE_SIZE, 0)
            slot = tl.where(pos_ok, chosen % PAGE_SIZE, 0)
        else:
            pos_ok = pos < kv_len
            page = tl.load(table_row + pos // PAGE_SIZE, mask=pos_ok, other=0).to(tl.int64)
            slot = pos % PAGE_SIZE
        at = cache_ptr + page[None, :] * stride_c_block + slot[None, :] * stride_c_slot
        lat = tl.load(at + vdims[:, None], mask=pos_ok[None, :] & vdim_ok[:, None], other=0.0)  # [V_DIM_P2, N]
        rope = tl.load(at + V_DIM + rdims[:, None], mask=pos_ok[None, :] & rdim_ok[:, None], other=0.0)
        # Quantized pages: fp8 and int8 values are exact in 16 bits, and a key's scale multiplies
        # its whole column, so it scales the scores and the probabilities, not the [576, N] tile.
        key_scale = tl.full([BLOCK_N], 1.0, tl.float32)
        if KV_SCALES == 1:
            key_scale = key_scale * tl.load(scale_ptr)
        if KV_SCALES == 2:
            at_scale = scale_ptr + page * stride_scale_block + slot * stride_scale_slot
            key_scale = tl.load(at_scale, mask=pos_ok, other=0.0).to(tl.float32)
        if KV_SCALES > 0 and not FP32_DOTS:
            lat = lat.to(q_ptr.dtype.element_ty)
            rope = rope.to(q_ptr.dtype.element_ty)
        if FP32_DOTS:
            lat = lat.to(tl.float32)
            rope = rope.to(tl.float32)
            scores = tl.dot(q_lat, lat, input_precision="ieee") + tl.dot(q_rope, rope, input_precision="ieee")
        else:
            scores = tl.dot(q_lat, lat) + tl.dot(q_rope, rope)
        if KV_SCALES > 0:
            scores = scores * key_scale[None, :]
        scores = tl.where(pos_ok[None, :], scores * (scale * 1.4426950408889634), float("-inf"))  # log2 units
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp2(scores - shift[:, None])
        alpha = tl.exp2(row_max - shift)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        if KV_SCALES > 0:
            p = p * key_scale[None, :]  # the values' scale, after the denominator took p
        if FP32_DOTS:
            acc = acc * alpha[:, None] + tl.dot(p, tl.trans(lat), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), tl.trans(lat))
        row_max = new_max

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(
            out_ptr + tok * stride_o_tok + heads[:, None] * stride_o_head + vdims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_ok[:, None] & vdim_ok[None, :],
        )
    else:  # the generic kernel's partial layout: ((segment * tokens + token) * H + head)
        row = segment * (tl.load(query_start_loc_ptr + seq_start + num_seqs).to(tl.int32) - first_token) + token
        row = row.to(tl.int64) * num_heads + heads
        tl.store(part_max_ptr + row, row_max, mask=head_ok)
        tl.store(part_sum_ptr + row, row_sum, mask=head_ok)
        tl.store(part_out_ptr + row[:, None] * V_DIM + vdims[None, :], acc, mask=head_ok[:, None] & vdim_ok[None, :])
