"""Device side of a flex step: each call's BlockMask over the paged cache's block table.

One mask_mod rule for both call kinds: a key slot is visible if it is in the query's own sequence
at a logical position <= the query's (and, with a sliding window, within the window). An inverse
page table `inv[seq, physical page]` (logical page, or -1), rewritten where it changed each step,
answers it without any global page->sequence map, so pages shared by several sequences (prefix
caching, forks) are right, and stale table entries past a sequence's length are never visible.

Every tensor a BlockMask holds is a view of a persistent buffer that plan() refills in place and
that only grows, in power-of-two capacities: a CUDA graph replays it, and a compiled graph sees the
same static sizes step after step (dynamic sizes in the mask_mod's buffers break the CPU kernel's
codegen).
"""

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from pagedbench.backends.flex_plan import MAX_DECODE_QUERY, CallArrays, CallPlan, index_in_group
from torch.nn.attention.flex_attention import BlockMask

MIN_ROW_CAPACITY = 64
MIN_TOKEN_CAPACITY = 1024
MIN_PAGE_CAPACITY = 1024
NO_WINDOW = 2**31 - 1  # a window past every position (int32): the plain mask


INT32_MAX = 2**31 - 1


def check_int32_offsets(num_pages: int, block_size: int, kv_width: int, device: torch.device) -> None:
    """A ValueError where a cache of `num_pages` pages overflows flex's int32 indices: a slot (kv_idx), or on
    CUDA an element offset in a layer's K/V (`kv_width` = KV heads x head dim elements a slot)."""
    slots = num_pages * block_size
    if slots > INT32_MAX:
        raise ValueError(f"cache of {num_pages} x {block_size} slots exceeds int32, the type of flex's kv_idx")
    if device.type == "cuda" and slots * kv_width > INT32_MAX:
        raise ValueError(f"a layer's cache of {num_pages} pages overflows Triton flex's int32 element offsets")


def capacity(n: int, minimum: int) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


def visible_slot(
    inv: torch.Tensor,
    page: torch.Tensor,
    seq: torch.Tensor,
    kv_idx: torch.Tensor,
    pos: torch.Tensor,
    window: torch.Tensor,
) -> torch.Tensor:
    """The mask_mod rule: cache slot `kv_idx` holds a token of sequence `seq` at a logical position
    in (pos - window, pos]. `inv` [seqs, pages] is the inverse page table; `page` a marker whose
    length is the page size; `window` a 0-d tensor (NO_WINDOW without one)."""
    bs = page.shape[0]  # static: a constant in the compiled kernel
    logical = inv[seq, kv_idx // bs]
    key_pos = logical * bs + kv_idx % bs
    return (logical >= 0) & (key_pos <= pos) & (key_pos > pos - window)


class PageList(NamedTuple):
    """[rows, columns]: column c's logical and physical page in its row's listing, and whether the
    row lists that many."""

    logical: torch.Tensor
    pages: torch.Tensor
    listed: torch.Tensor


class RowPages(NamedTuple):
    """What a call's BlockMask rows list: masked blocks, and full ones where the plan has them."""

    seq: torch.Tensor  # [rows, 1] sequence of each row
    masked: PageList
    full: PageList | None


def _as_mask_rows(t: torch.Tensor, kind: str) -> torch.Tensor:
    """Counts [rows] or tables [rows, width] as BlockMask's [B, H, Q blocks, ...]: decode rows are
    the batch, prefill rows the query blocks of batch 1."""
    rows, rest = t.shape[0], t.shape[1:]
    return t.view(rows, 1, 1, *rest) if kind == "decode" else t.view(1, 1, rows, *rest)


class PagedBlockMasks:
    """The persistent buffers behind a backend's BlockMasks, and the builders that refill them."""

    def __init__(
        self,
        block_size: int,
        kv_block_size: int,
        q_block_size: int,
        device: torch.device,
        sliding_window: int | None = None,
        packed_heads: int = 1,
        exact_prefill_width: bool = False,
    ):
        self.block_size, self.kv_block_size, self.q_block_size = block_size, kv_block_size, q_block_size
        # FA4's flex kernels (BACKEND=FLASH, prefill only) refuse index tables wider than the KV-block count.
        self.exact_prefill_width = exact_prefill_width
        self.device = device
        # Decode rows hold `packed_heads` query heads per query token (q-major, see FlexBackend):
        # one query block holds a whole row.
        self.packed_heads = packed_heads
        self.decode_q_block = capacity(MAX_DECODE_QUERY * packed_heads, q_block_size)
        # The page size must be a compile-time constant in the mask_mod (a captured int would become a
        # dynamic symbol): it is the static length of this marker tensor.
        self._page = torch.empty(block_size, dtype=torch.int8, device=device)
        torch._dynamo.mark_static(self._page)
        # The window is a value, not a constant: windowed and plain layers (Gemma's, the check's
        # variants) share their compiled graphs.
        self._window = torch.tensor(sliding_window or NO_WINDOW, dtype=torch.int32, device=device)
        self._buffers: dict[str, torch.Tensor] = {}
        self._inv_written: tuple[torch.Tensor, ...] | None = None  # (inv, flat index) entries of the last step

    def _buffer(self, name: str, shape: tuple[int, ...], fill: int = 0) -> torch.Tensor:
        """A persistent int32 buffer of at least `shape`, reallocated (filled) only to grow."""
        buf = self._buffers.get(name)
        if buf is None or any(have < want for have, want in zip(buf.shape, shape)):
            if buf is not None:
                shape = tuple(max(have, want) for have, want in zip(buf.shape, shape))
            buf = torch.full(shape, fill, dtype=torch.int32, device=self.device)
            torch._dynamo.mark_static(buf)
            self._buffers[name] = buf
        return buf

    def row_pages(self, plan: CallPlan, arrays: CallArrays[torch.Tensor], block_table: torch.Tensor) -> RowPages:
        """The pages the call's BlockMask rows list, gathered from the block table on the device
        ([rows, columns] entries; no host work per page). Masked pages lie before and after the
        full run, so those after skip its columns."""
        seq, start = arrays.row_seq.long()[:, None], arrays.row_start[:, None]
        full_start = arrays.row_full_start[:, None]
        num_masked, num_full = arrays.num_masked[:, None], arrays.num_full[:, None]

        def listing(first: torch.Tensor, count: torch.Tensor, columns: int, skip=None) -> PageList:
            c = torch.arange(columns, device=self.device)
            logical = first + c if skip is None else first + c + (c >= full_start - start) * skip
            pages = block_table[seq, logical.clamp(max=block_table.shape[1] - 1)]
            return PageList(logical, pages, c < count)

        masked = listing(start, num_masked, int(plan.host.num_masked.max()), skip=num_full)
        full = listing(full_start, num_full, int(plan.host.num_full.max())) if plan.full_blocks else None
        return RowPages(seq, masked, full)

    def fill_inverse(self, calls: list[RowPages], num_seqs: int, num_pages: int, full_too: bool) -> None:
        """inv[s, page] = logical page of `page` in sequence s for every page a call lists as a
        masked block (the only ones a compiled kernel's mask_mod sees; `full_too`: and as a full
        one, for eager flex, which applies the mask_mod everywhere), -1 elsewhere; unlisted columns
        write to a spare last column no page reads. Only the last step's entries are reset, so the
        cost follows the listings, not the cache size."""
        inv = self._buffer(
            "inv", (capacity(num_seqs, MIN_ROW_CAPACITY), capacity(num_pages + 1, MIN_PAGE_CAPACITY)), fill=-1
        )
        # Flat indices into the table: one index_fill_ and one index_copy_ (2-D advanced indexing
        # costs several times more on a CPU for the same entries).
        spare = inv.shape[1] - 1
        lists = [(c.seq, p) for c in calls for p in (c.masked, c.full if full_too else None) if p is not None]
        flat = torch.cat([(seq * inv.shape[1] + torch.where(p.listed, p.pages, spare)).view(-1) for seq, p in lists])
        logical = torch.cat([p.logical.reshape(-1) for _, p in lists]).to(torch.int32)
        table = inv.view(-1)
        if self._inv_written is not None and self._inv_written[0] is inv:  # a regrown table starts all -1
            table.index_fill_(0, self._inv_written[1], -1)
        table.index_copy_(0, flat, logical)
        self._inv_written = (inv, flat)

    def block_mask(
        self, plan: CallPlan, arrays: CallArrays[torch.Tensor], listing: RowPages, num_pages: int
    ) -> BlockMask:
        """The call's BlockMask (after fill_inverse): row r, a decode row or a prefill query block,
        lists its sequence's pages (`listing`), as full blocks where `plan.full_blocks` allows, else masked."""
        rows, kv_block = plan.rows, self.kv_block_size
        # kv_indices at least as wide as the cache's KV-block count (flex takes the count from the last dim).
        kv_blocks = -(-num_pages * self.block_size // kv_block)
        width = capacity(kv_blocks + 1, MIN_PAGE_CAPACITY)
        cap_rows = capacity(rows, MIN_ROW_CAPACITY)
        counts = self._buffer(f"{plan.kind}_counts", (2, cap_rows))  # [masked, full]
        tables = self._buffer(f"{plan.kind}_tables", (2, cap_rows, width))
        counts[0, :rows].copy_(arrays.num_masked)
        counts[1, :rows].copy_(arrays.num_full)
        if kv_block == self.block_size:  # a sequence's pages are distinct: they are the blocks
            for kind, pages in enumerate((listing.masked, listing.full)):
                if pages is not None:
                    tables[kind, :rows, : pages.listed.shape[1]] = torch.where(pages.listed, pages.pages, 0)
        else:
            self._list_shared_blocks(counts[0, :rows], tables[0, :rows], listing.masked.pages, listing.masked.listed)
        if plan.kind == "prefill" and self.exact_prefill_width:  # one page per KV block here: columns < kv_blocks
            tables = tables[..., :kv_blocks]
        full = [_as_mask_rows(t[1, :rows], plan.kind) for t in (counts, tables)] if plan.full_blocks else [None, None]
        decode = plan.kind == "decode"
        return BlockMask.from_kv_blocks(
            _as_mask_rows(counts[0, :rows], plan.kind),
            _as_mask_rows(tables[0, :rows], plan.kind),
            *full,
            BLOCK_SIZE=(self.decode_q_block if decode else self.q_block_size, kv_block),
            mask_mod=self._mask_mod(plan, arrays.mask_seq, arrays.mask_pos),
            seq_lengths=(plan.q_len * self.packed_heads if decode else plan.q_len, num_pages * self.block_size),
            compute_q_blocks=False,
        )

    def _list_shared_blocks(
        self, count: torch.Tensor, table: torch.Tensor, pages: torch.Tensor, listed_pages: torch.Tensor
    ) -> None:
        """Pages of one row may share a KV block: list each block of the row's listed `pages`
        [rows, columns] once in count [rows] and table [rows, width], without a device sync."""
        rows, width = table.shape
        blocks = torch.where(listed_pages, pages.long() // (self.kv_block_size // self.block_size), width)
        listed = torch.zeros(rows, width + 1, dtype=torch.bool, device=self.device)  # the last column: unlisted
        listed = listed.scatter_(1, blocks, True)[:, :width]
        count.copy_(listed.sum(-1, dtype=torch.int32))
        column = torch.where(listed, listed.cumsum(-1) - 1, width - 1)
        blocks = torch.arange(width, dtype=torch.int32, device=self.device).expand(rows, -1)
        table.zero_().scatter_(1, column, blocks)

    def _mask_mod(self, plan: CallPlan, mask_seq: torch.Tensor, mask_pos: torch.Tensor) -> Callable[..., torch.Tensor]:
        """`visible_slot` over persistent copies of the call's query sequences and positions."""
        inv, page, window = self._buffers["inv"], self._page, self._window
        if plan.kind == "decode":
            rows, g = plan.rows, self.packed_heads
            seq = self._buffer("decode_seq", (capacity(rows, MIN_ROW_CAPACITY),))
            seq[:rows].copy_(mask_seq)
            pos = self._buffer("decode_pos", (capacity(rows, MIN_ROW_CAPACITY), MAX_DECODE_QUERY * g))
            row_pos = mask_pos.view(rows, -1)  # [rows, q_len] -> packed query rows q * g + head
            pos[:rows, : plan.q_len * g].copy_(row_pos if g == 1 else row_pos.repeat_interleave(g, dim=1))

            def visible(b, h, q_idx, kv_idx):
                return visible_slot(inv, page, seq[b], kv_idx, pos[b, q_idx], window)
        else:
            seq = self._buffer("prefill_seq", (capacity(len(mask_seq), MIN_TOKEN_CAPACITY),))
            seq[: len(mask_seq)].copy_(mask_seq)
            pos = self._buffer("prefill_pos", (capacity(len(mask_pos), MIN_TOKEN_CAPACITY),))
            pos[: len(mask_pos)].copy_(mask_pos)

            def visible(b, h, q_idx, kv_idx):
                return visible_slot(inv, page, seq[q_idx], kv_idx, pos[q_idx], window)

        return visible

    def tile_counts(self, mask: BlockMask, kind: str, real_rows: np.ndarray) -> tuple[int, int]:
        """(kept, computed) score entries of one call, over its real query rows: each BlockMask row
        computes real rows x (full + masked blocks) x kv_block and keeps real rows x full blocks x
        kv_block plus the slots of its masked blocks that the mask_mod keeps, per query token and
        head (a packed decode row's G heads count once, like a prefill row). Syncs: diagnostics only."""
        g = self.packed_heads if kind == "decode" else 1
        kept, computed = self._tile_counts(mask, kind, real_rows)
        return kept // g, computed // g

    def _tile_counts(self, mask: BlockMask, kind: str, real_rows: np.ndarray) -> tuple[int, int]:
        kv_block, rows = self.kv_block_size, len(real_rows)
        masked = mask.kv_num_blocks.reshape(-1)[:rows].long().cpu()
        full = (
            mask.full_kv_num_blocks.reshape(-1)[:rows].long().cpu()
            if mask.full_kv_num_blocks is not None
            else torch.zeros(rows, dtype=torch.long)
        )
        real = torch.as_tensor(real_rows, dtype=torch.long)
        computed = int((real * (masked + full)).sum()) * kv_block
        kept = int((real * full).sum()) * kv_block
        if not int(masked.sum()):
            return kept, computed
        # Masked blocks: evaluate the mask_mod on every (real query, slot) pair of every listed block.
        row = torch.repeat_interleave(torch.arange(rows), masked)
        column = torch.from_numpy(index_in_group(masked.numpy()))
        block = mask.kv_indices.reshape(rows, -1).cpu()[row, column].long()
        slot = block[:, None, None] * kv_block + torch.arange(kv_block)  # [E, 1, kv_block]
        q_in_row = torch.arange(int(real.max()))[None, :, None]  # [1, Q, 1]
        if kind == "decode":  # real_rows count packed query rows
            b, q_idx = row[:, None, None], q_in_row
        else:
            b, q_idx = torch.zeros(1, dtype=torch.long), row[:, None, None] * self.q_block_size + q_in_row
        h = torch.zeros(1, dtype=torch.long)
        keep = mask.mask_mod(*(t.to(self.device) for t in (b, h, q_idx, slot))).cpu()
        return kept + int((keep & (q_in_row < real[row][:, None, None])).sum()), computed
