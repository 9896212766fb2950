"""FlexAttention over the paged cache viewed as one long sequence.

Per layer, the cache `[num_pages, block_size, H_kv, D]` is viewed (no copy) as keys
`[1, H_kv, num_pages * block_size, D]`; the flat query batch `[T, H, D]` as `[1, H, T, D]`.
Once per step a BlockMask is built straight from the block table: each row of `q_block_size`
flat tokens lists the union of the pages its sequences need (KV block = one page; pages under
16 slots share one), and the mask_mod maps a physical slot to (owning sequence, logical
position) through inverse page tables, so a row spanning several sequences never lets one see
another's pages, nor stale table entries, nor the unwritten tail of a last page.

Compilation: one `torch.compile(dynamic=True)` function per process, so token counts and cache
sizes need no buckets. The mask_mod's buffers have static power-of-two capacities instead
(dynamic sizes in them break the CPU kernel's codegen): a graph is compiled per (heads,
head_dim, dtype, page size, capacity bucket); `compile_stats` counts them. `compile=False` or
PAGEDBENCH_FLEX_COMPILE=0 runs flex eager (debugging: it materializes [H, T, cache slots] scores).

Assumes a page belongs to one sequence per step (no prefix sharing in this engine); shared pages
would need a block-table membership test in the mask_mod and deduplicated rows.
"""
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from pagedbench.backends.base import AttentionBackend, AttentionMetadata, to_device

_INT32_MAX = 2**31 - 1
MIN_TOKEN_CAPACITY = 1024
MIN_PAGE_CAPACITY = 1024
MIN_KV_BLOCK = 16
RECOMPILE_LIMIT = 256
compile_stats = {"graphs": 0}  # graphs compiled by this process (each one is a recompile of `_attend`)


def _attend(q, k, v, block_mask: BlockMask, scale: float, kernel_options: dict | None):
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True,
                          kernel_options=kernel_options)


def _inductor_counting(gm, example_inputs):
    from torch._inductor.compile_fx import compile_fx

    compile_stats["graphs"] += 1
    return compile_fx(gm, example_inputs)


_attend_compiled = torch.compile(_attend, backend=_inductor_counting, fullgraph=True, dynamic=True)


def _attend_fused(*args):
    """Compiled `_attend`. Past the recompile limit dynamo would silently run flex's unfused eager
    path instead; here that raises. Sizes equal by chance must not become guards (duck shapes)."""
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True,
                                    specialize_float=True), \
            torch.fx.experimental._config.patch(use_duck_shape=False):
        return _attend_compiled(*args)


def _capacity(n: int, minimum: int) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


def _index_in_group(counts: np.ndarray) -> np.ndarray:
    """[sum(counts)]: 0..counts[i]-1 for each group i, concatenated."""
    return np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)


@dataclass(slots=True)
class _Pages:
    """Which pages each query block reads, from the host copies of the metadata (no device sync)."""

    num_q_rows: int  # query rows given to flex: T, or 2 when T == 1 (a size-1 dim compiles its own graph)
    row_counts: torch.Tensor  # [2, 1, R] int32: pages each query block masks, then those it reads in full
    entry_row: torch.Tensor  # [E] row of each (query block, page) entry: its block, + R when full
    entry_col: torch.Tensor  # [E] its column in the kv index table
    entry_page: torch.Tensor  # [E] physical page
    valid_page: torch.Tensor  # [V] every page holding tokens of this step's sequences
    valid_seq: torch.Tensor  # [V] its sequence
    valid_start: torch.Tensor  # [V] logical position of its first slot
    q_seq: torch.Tensor  # [token_capacity] int32 sequence of each query row; -2 past the real tokens
    q_pos: torch.Tensor  # [token_capacity] int32 position of each query row in its sequence
    block_mask: BlockMask | None = None  # set at the end of prepare
    shapes_seen: bool = False  # after the step's first layer every layer hits the same compiled graph


class FlexBackend(AttentionBackend):
    name = "flex"

    def __init__(self, num_heads, num_kv_heads, head_dim, scale, block_size, device, dtype,
                 compile: bool = True, q_block_size: int | None = None):
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size, device, dtype)
        self.compiled = compile and os.environ.get("PAGEDBENCH_FLEX_COMPILE", "1") != "0"
        # A row of decodes computes every page of its sequences for each of its tokens, so CPU (compute
        # bound) takes short rows; Triton wants tiles of 64+ rows.
        self.q_block_size = q_block_size or (128 if self.device.type == "cuda" else 16)
        # KV blocks under 16 slots miscompute on CPU (torch 2.13's micro-GEMM N tail) and are below
        # Triton's minimum tile, so small pages share a KV block; the mask_mod maps each slot to its page.
        self.kv_block_size = max(block_size, MIN_KV_BLOCK)
        # CUDA: Triton tiles must divide the blocks; the decode kernel only takes short queries.
        self.kernel_options = ({"BACKEND": "TRITON", "BLOCK_M": min(64, self.q_block_size),
                                "BLOCK_N": min(64, self.kv_block_size)} if self.device.type == "cuda" else None)

    @classmethod
    def unavailable_reason(cls, device, dtype, head_dim, block_size, **kwargs):
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            return f"flex backend runs on cpu and cuda, not {device.type}"
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"flex attention supports float32/bfloat16/float16, not {dtype}"
        if block_size & (block_size - 1):
            return f"block_size {block_size} must be a power of two (a BlockMask KV block holds whole pages)"
        if device.type == "cpu" and os.environ.get("PAGEDBENCH_FLEX_COMPILE", "1") != "0":
            from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported

            if not check_cpu_supported():
                return "compiled flex on CPU needs x86 with AVX2 (PAGEDBENCH_FLEX_COMPILE=0 runs it eager)"
        return None

    @torch.inference_mode()  # the mask's tensors must be alike whether built here or in forward (guards)
    def prepare(self, meta: AttentionMetadata) -> _Pages:
        bs, qb = self.block_size, self.q_block_size
        qsl = np.asarray(meta.query_start_loc_cpu, dtype=np.int64)
        ctx = np.asarray(meta.context_lens_cpu, dtype=np.int64)
        num_tokens = int(qsl[-1])
        num_q_rows = max(num_tokens, 2)
        num_q_blocks = -(-num_tokens // qb)
        # (query block, sequence) pairs: the sequences whose tokens fall in each block.
        block_start = np.arange(num_q_blocks) * qb
        block_end = np.minimum(block_start + qb, num_tokens)
        first = np.searchsorted(qsl, block_start, side="right") - 1
        last = np.searchsorted(qsl, block_end - 1, side="right") - 1
        pair_block = np.repeat(np.arange(num_q_blocks), last - first + 1)
        pair_seq = first[pair_block] + _index_in_group(last - first + 1)
        # Each pair needs the pages up to its last query token's position in that block (causal).
        last_token = np.minimum(qsl[pair_seq + 1], block_end[pair_block]) - 1
        has_tokens = last_token >= np.maximum(qsl[pair_seq], block_start[pair_block])
        pair_pages = np.where(has_tokens, (ctx[pair_seq] + last_token - qsl[pair_seq]) // bs + 1, 0)
        entry_pair = np.repeat(np.arange(len(pair_pages)), pair_pages)
        entry_logical = _index_in_group(pair_pages)
        # A page is "full" for a block of one sequence that it wholly precedes: flex skips its mask_mod.
        first_pos = ctx[pair_seq] + np.maximum(qsl[pair_seq], block_start[pair_block]) - qsl[pair_seq]
        entry_full = (first == last)[pair_block[entry_pair]] & ((entry_logical + 1) * bs <= first_pos[entry_pair] + 1)
        entry_full &= self.kv_block_size == bs
        # Rows 0..R-1 of one table list the masked pages of each query block, rows R..2R-1 the full ones.
        num_mask_rows = num_q_blocks + 1  # plus an empty one, never a size-1 dim
        order = np.lexsort((pair_block[entry_pair], entry_full))
        entry_row = (pair_block[entry_pair] + num_mask_rows * entry_full)[order]
        row_counts = np.bincount(entry_row, minlength=2 * num_mask_rows)
        entry_col = _index_in_group(row_counts)  # entries are now ordered by row
        # Every page of every sequence (never the stale entries past seq_len), for the inverse tables.
        seq_pages = -(-np.asarray(meta.seq_lens_cpu, dtype=np.int64) // bs)
        valid_seq = np.repeat(np.arange(len(seq_pages)), seq_pages)
        valid_logical = _index_in_group(seq_pages)

        host = np.concatenate([row_counts, entry_row, entry_col, pair_seq[entry_pair][order], entry_logical[order],
                               valid_seq, valid_logical])
        dev = to_device(host, self.device)
        row_counts_dev, e_row, e_col, e_seq, e_logical, v_seq, v_logical = dev.split(
            [len(row_counts)] + [len(entry_row)] * 4 + [len(valid_seq)] * 2)
        table = meta.block_table
        token_capacity = _capacity(num_q_rows, MIN_TOKEN_CAPACITY)
        q_seq = torch.full((token_capacity,), -2, dtype=torch.int32, device=self.device)
        q_seq[:num_tokens] = meta.token_seq_idx
        q_pos = torch.zeros(token_capacity, dtype=torch.int32, device=self.device)
        q_pos[:num_tokens] = meta.positions
        pages = _Pages(num_q_rows, row_counts_dev.to(torch.int32).view(2, 1, -1), e_row, e_col,
                       table[e_seq, e_logical], table[v_seq, v_logical].long(), v_seq.to(torch.int32),
                       (v_logical * bs).to(torch.int32), q_seq, q_pos)
        pages.block_mask = self._block_mask(pages, meta.num_cache_blocks)
        return pages

    @torch.inference_mode()
    def _block_mask(self, pages: _Pages, num_pages: int) -> BlockMask:
        """Inverse page tables and kv_indices sized for a cache of `num_pages` pages."""
        bs, kv_block = self.block_size, self.kv_block_size
        if num_pages * bs > _INT32_MAX:
            raise ValueError(f"cache of {num_pages} x {bs} slots exceeds int32, the type of flex's kv_idx")
        if self.device.type == "cuda" and num_pages * bs * self.num_kv_heads * self.head_dim > _INT32_MAX:
            raise ValueError(f"a layer's cache of {num_pages} pages overflows Triton flex's int32 element offsets")
        page_capacity = _capacity(num_pages, MIN_PAGE_CAPACITY)
        page_seq = torch.full((page_capacity,), -1, dtype=torch.int32, device=self.device)  # -1: not in this step
        page_seq[pages.valid_page] = pages.valid_seq
        page_start = torch.zeros(page_capacity, dtype=torch.int32, device=self.device)
        page_start[pages.valid_page] = pages.valid_start
        # Rows as wide as the cache (flex asserts kv_len <= kv_indices.size(-1) * KV_BLOCK), plus a spare
        # column that collects the non-listed blocks when several pages share one KV block.
        width = _capacity(-(-num_pages * bs // kv_block) + 1, MIN_PAGE_CAPACITY)
        rows = pages.row_counts.shape[-1]
        if kv_block == bs:  # pages of one row are distinct: scatter them straight into their columns
            kv_num_blocks, full_num_blocks = pages.row_counts.view(2, 1, 1, rows)
            kv_indices = torch.zeros(2 * rows, width, dtype=torch.int32, device=self.device)
            kv_indices[pages.entry_row, pages.entry_col] = pages.entry_page
            kv_indices, full_indices = kv_indices.view(2, 1, 1, rows, width)
        else:  # pages of one row may share a KV block: list each block once, without a device sync
            listed = torch.zeros(rows, width, dtype=torch.bool, device=self.device)
            listed[pages.entry_row, pages.entry_page // (kv_block // bs)] = True
            kv_num_blocks = listed.sum(-1, dtype=torch.int32).view(1, 1, rows)
            column = torch.where(listed, listed.cumsum(-1) - 1, width - 1)
            blocks = torch.arange(width, dtype=torch.int32, device=self.device).expand(rows, width)
            kv_indices = torch.zeros(rows, width, dtype=torch.int32, device=self.device).scatter_(1, column, blocks)
            kv_indices, full_num_blocks, full_indices = kv_indices.view(1, 1, rows, width), None, None
        q_seq, q_pos = pages.q_seq, pages.q_pos
        for buffer in (page_seq, page_start, q_seq, q_pos):
            torch._dynamo.mark_static(buffer)

        def same_sequence_causal(b, h, q_idx, kv_idx):
            page = kv_idx // bs
            return (page_seq[page] == q_seq[q_idx]) & (page_start[page] + kv_idx % bs <= q_pos[q_idx])

        return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, full_num_blocks, full_indices,
                                        BLOCK_SIZE=(self.q_block_size, kv_block), mask_mod=same_sequence_causal,
                                        seq_lengths=(pages.num_q_rows, num_pages * bs), compute_q_blocks=False)

    def forward(self, q, k_cache, v_cache, state: _Pages) -> torch.Tensor:
        num_tokens = q.shape[0]
        if num_tokens < state.num_q_rows:
            q = torch.cat([q, q.new_zeros(state.num_q_rows - num_tokens, *q.shape[1:])])
        # [num_pages, bs, H_kv, D] -> [1, H_kv, num_pages * bs, D]: a view; flex takes any strides
        # with a unit last dim, and the CPU kernel reads this [B, L, H, D] layout natively.
        k = k_cache.view(1, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v_cache.view(1, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # Only the step's first layer can miss the compile cache, so only it pays for the config patch.
        attend = _attend if not self.compiled else _attend_compiled if state.shapes_seen else _attend_fused
        state.shapes_seen = True
        out = attend(q.unsqueeze(0).transpose(1, 2), k, v, state.block_mask, self.scale, self.kernel_options)
        return out.transpose(1, 2)[0, :num_tokens]
