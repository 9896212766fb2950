"""flex's sparse attention (DeepSeek-V3.2): two ways to read each query's selected cache slots.

- **Gathered** (the default): each query token's picks are copied into a dense buffer of its own
  (`read_selected`, the gather sdpa and reference use), and flex runs over it as batch row t:
  queries [t, H_kv, G, D] (a KV head's G query heads as rows), keys [t, H_kv, K', D], K' the top-k
  rounded up to whole KV blocks. The BlockMask (`gathered_block_mask`) lists ceil(picks / block) KV
  blocks per row, full but the last, whose mask_mod cuts it at the token's pick count: the work
  follows the top-k, whatever pages the picks lie in.
- **Pages**: the step's queries are one flat row [1, H_kv, T * G, D] over the whole cache as one key
  sequence, the G query heads of each KV head packed as G consecutive rows per token (MLA: all of them
  over the one latent), so a block of rows reads each key once for all of them. Query block r (whole
  tokens) lists the KV blocks holding any slot one of its tokens selected, every one partial (masked);
  the mask_mod keeps, for a row of token t, exactly the slots t selected: a bitmap of T rows x one bit
  per cache slot (int32 words), filled by one scatter (`sparse_block_mask`). It reads whole blocks, so
  its cost follows the pages its picks touch: 2,048 random picks over 256 pages of 64 touch nearly all
  of them (tile efficiency 0.125). It runs only where every query of the step selects its whole past
  (no sequence longer than the top-k) and the step has 8 query tokens or more (`sparse_path`): there
  it lists exactly dense attention's pages and copies nothing.

The tile efficiency of either is the selected share of the listed blocks' slots. `SparseCalls` holds a
backend's layout of both (query rows, masks, kernel options) and runs a step's call through the backend's flex.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from pagedbench.backends.base import read_selected
from pagedbench.backends.flex_compile import triton_options
from torch.nn.attention.flex_attention import BlockMask

from pagedbench import envs

WORD_BITS = 32
PAGES_MIN_TOKENS = 8  # query tokens from which a step whose sequences fit the top-k takes the page BlockMask
SPARSE_Q_ROWS = 16  # least query rows per BlockMask block (a block lists its tokens' picks)
GATHER_Q_ROWS = 64  # most query rows per block of a gathered call (MLA-128's decode: two blocks, two cores)
GATHER_KV_BLOCK = 64  # gathered keys per KV block (the top-k rounded up to a multiple)
SPARSE_PROVIDER = {
    "auto": "top-k gathered (page BlockMask where every sequence fits the top-k, 8+ query tokens)",
    "gather": "top-k gathered (PAGEDBENCH_FLEX_SPARSE=gather)",
    "pages": "top-k page BlockMask (PAGEDBENCH_FLEX_SPARSE=pages)",
}
Attend = Callable[..., torch.Tensor]  # the backend's flex over (q, k, v, block_mask, kernel_options, sinks)
Share = Callable[[], float]  # a call's tile efficiency (it syncs: diagnostics only)


def forced_sparse_path() -> str:
    """PAGEDBENCH_FLEX_SPARSE: auto (default), or gather / pages, one way for every sparse step."""
    return envs.get("PAGEDBENCH_FLEX_SPARSE")


def sparse_path(seq_lens: list[int], topk: int, num_tokens: int) -> str:
    """Which way a sparse step reads its picks: "pages" where every sequence fits the top-k (each query
    selects its whole causal past: the page BlockMask lists dense attention's blocks and copies nothing)
    and the step has PAGES_MIN_TOKENS query tokens or more, else "gather". Fewer tokens give the page
    call too few query blocks for the cores (one 128-row block per MLA token; the gathered call splits
    it in two): on 2 CPU cores, MLA-128 top-2048, gather took 7.4 / 10.5 ms against 9.4 / 16.7 for one
    decode at 1k / 2k, pages 72 / 149 ms against 104 / 178 for 16 (reports/cpu/dsa-flex-gather/fits-*).
    PAGEDBENCH_FLEX_SPARSE=gather|pages forces one (measurements, tests)."""
    forced = forced_sparse_path()
    if forced != "auto":
        return forced
    fits = max(seq_lens, default=0) <= topk
    return "pages" if fits and num_tokens >= PAGES_MIN_TOKENS else "gather"


def gathered_width(topk: int, kv_block: int) -> int:
    """K': a token's gathered keys, the top-k rounded up to whole KV blocks."""
    return -(-topk // kv_block) * kv_block


MIN_TOKEN_CAPACITY = 64  # least tokens the gathered mask's count buffer holds (then powers of two)


class GatheredMasks:
    """BlockMasks of gathered calls, one flat row each: token t's `rows_per_token` query rows (its packed
    query heads, a power of two) over its `width` gathered keys at [t * width, (t + 1) * width), of which
    the first counts[t] are its picks. Query blocks of `q_block` rows hold one token's rows, or whole
    tokens (then a block lists its tokens' blocks). A block lists ceil(counts[t] / kv_block) KV blocks per
    token: with `full_blocks` (one token a block), those wholly picks as full (no mask_mod) and the last
    as partial, cut by the mask_mod at the token's count; else all partial.

    The mask_mod reads only compile-time constants and static buffers: the row and width counts as the
    lengths of marker tensors, the counts in a persistent buffer of power-of-two capacity (torch 2.13's
    CPU template renames the query-block symbol by text in the mask code, which mangles other dynamic
    sizes there: a captured width came out as `cur_qSplitSize0`)."""

    def __init__(self, rows_per_token: int, q_block: int, kv_block: int, device: torch.device, full_blocks: bool):
        self.rows_per_token, self.q_block, self.kv_block = rows_per_token, q_block, kv_block
        self.tokens_per_block = max(1, q_block // rows_per_token)
        self.blocks_per_token = max(1, rows_per_token // q_block)
        self.full_blocks = full_blocks and self.tokens_per_block == 1
        self.device = device
        self._rows = self._marker(rows_per_token)
        self._widths: dict[int, torch.Tensor] = {}
        self._counts = torch.zeros(0, dtype=torch.int32, device=device)

    def _marker(self, length: int) -> torch.Tensor:
        marker = torch.empty(length, dtype=torch.int8, device=self.device)
        torch._dynamo.mark_static(marker)
        return marker

    def _counts_buffer(self, tokens: int) -> torch.Tensor:
        if self._counts.shape[0] < tokens:
            self._counts = torch.zeros(max(MIN_TOKEN_CAPACITY, 1 << (tokens - 1).bit_length()), dtype=torch.int32,
                                       device=self.device)  # fmt: skip
            torch._dynamo.mark_static(self._counts)
        return self._counts

    def block_mask(self, counts: torch.Tensor, width: int) -> BlockMask:
        """The mask of a call over `counts` [T'] tokens (T' whole query blocks; padding tokens count 0)."""
        tokens, kv_block = counts.shape[0], self.kv_block
        per_token = width // kv_block
        buffer = self._counts_buffer(tokens)
        buffer[:tokens].copy_(counts)
        buffer[tokens:].zero_()
        if width not in self._widths:
            self._widths[width] = self._marker(width)
        rows_marker, width_marker = self._rows, self._widths[width]
        # each query block's candidate KV blocks: its tokens' (token * per_token + j), j < per_token
        token = torch.arange(tokens, device=counts.device).view(-1, self.tokens_per_block)
        j = torch.arange(per_token, device=counts.device)
        candidates = (token[..., None] * per_token + j).flatten(1)
        count = counts[token][..., None]
        listed = (j * kv_block < count).flatten(1)  # holds a pick
        whole = ((j + 1) * kv_block <= count).flatten(1) if self.full_blocks else torch.zeros_like(listed)
        columns = tokens * per_token  # flex sizes the key dimension by the index table's width

        def table(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            order = (~keep).to(torch.int8).argsort(dim=1, stable=True)  # kept blocks first, ascending
            num, idx = keep.sum(dim=1, dtype=torch.int32), candidates.gather(1, order)
            idx = F.pad(idx, (0, columns - idx.shape[1])).int()
            # per block of tokens -> per query block
            return (t.repeat_interleave(self.blocks_per_token, dim=0)[None, None].contiguous() for t in (num, idx))

        def within_picks(b, h, q_idx, kv_idx):
            t = q_idx // rows_marker.shape[0]  # static: constants in the compiled kernel
            start = t * width_marker.shape[0]
            return (kv_idx >= start) & (kv_idx < start + buffer[t])

        return BlockMask.from_kv_blocks(
            *table(listed & ~whole),
            *(table(whole) if self.full_blocks else (None, None)),
            BLOCK_SIZE=(self.q_block, kv_block),
            mask_mod=within_picks,
            seq_lengths=(tokens * self.rows_per_token, tokens * width),
            compute_q_blocks=False,  # the transposed listing serves only a backward pass
        )


def gathered_share(counts: torch.Tensor, kv_block: int) -> float:
    """Tile efficiency of a gathered call: picks over the listed blocks' slots."""
    listed = -(-counts.long() // kv_block) * kv_block
    return int(counts.sum()) / max(1, int(listed.sum()))


def sparse_block_mask(
    selected: torch.Tensor, num_slots: int, tokens_per_block: int, kv_block: int, rows_per_token: int = 1
) -> tuple[BlockMask, torch.Tensor, int]:
    """(BlockMask, bitmap words [T', num_slots / 32], T' = T padded to whole query blocks) for
    `selected` [T, topk] slots (-1: none). Each token is `rows_per_token` consecutive query rows (the
    query heads of a KV head, packed), a query block `tokens_per_block` tokens."""
    num_tokens, topk = selected.shape
    padded = -(-num_tokens // tokens_per_block) * tokens_per_block
    selected = F.pad(selected, (0, 0, 0, padded - num_tokens), value=-1)
    valid = selected >= 0
    # one bit per (token, slot); a token's slots are distinct, so adding the bits is OR-ing them
    words = torch.zeros(padded, -(-num_slots // WORD_BITS), dtype=torch.int32, device=selected.device)
    slots = selected.clamp(min=0)
    bits = torch.bitwise_left_shift(torch.ones_like(slots, dtype=torch.int32), (slots % WORD_BITS).int())
    words.scatter_add_(1, slots // WORD_BITS, torch.where(valid, bits, 0))
    # each query block's distinct KV blocks, ascending, then the padding (num_kv_blocks, sorted last)
    num_kv_blocks = -(-num_slots // kv_block)
    blocks = torch.where(valid, selected // kv_block, num_kv_blocks).view(padded // tokens_per_block, -1)
    blocks = blocks.sort(dim=1).values
    repeat = torch.zeros_like(blocks, dtype=torch.bool)
    repeat[:, 1:] = blocks[:, 1:] == blocks[:, :-1]
    blocks = blocks.masked_fill(repeat, num_kv_blocks).sort(dim=1).values
    counts = (blocks < num_kv_blocks).sum(dim=1)
    # flex sizes the key dimension by the index table's width: a column per KV block of the cache
    width = min(tokens_per_block * topk, num_kv_blocks)
    indices = F.pad(blocks[:, :width], (0, num_kv_blocks - width), value=num_kv_blocks)
    indices = indices.clamp(max=num_kv_blocks - 1).int()

    def keep_selected(b, h, q_idx, kv_idx):
        token = q_idx // rows_per_token
        return (torch.bitwise_right_shift(words[token, kv_idx // WORD_BITS], kv_idx % WORD_BITS) & 1) == 1

    mask = BlockMask.from_kv_blocks(
        counts.int()[None, None],
        indices[None, None],
        BLOCK_SIZE=(tokens_per_block * rows_per_token, kv_block),
        mask_mod=keep_selected,
        seq_lengths=(padded * rows_per_token, num_slots),
        compute_q_blocks=False,  # the transposed listing serves only a backward pass
    )
    return mask, words, padded


def selected_share(selected: torch.Tensor, mask: BlockMask, tokens_per_block: int) -> float:
    """Tile efficiency of a sparse call: selected slots over the listed blocks' slots, real tokens only."""
    num_tokens = selected.shape[0]
    kv_block = mask.BLOCK_SIZE[1]
    listed = mask.kv_num_blocks[0, 0].long()
    tokens = torch.full_like(listed, tokens_per_block)
    tokens[-1] = num_tokens - tokens_per_block * (len(listed) - 1)
    return int((selected >= 0).sum()) / max(1, int((listed * tokens).sum()) * kv_block)


class SparseCalls:
    """A backend's sparse calls, either way: their query rows, BlockMasks and kernel options (CPU: the
    template's own; CUDA: tiles that fit). Each way returns the step's output and its tile efficiency."""

    def __init__(self, num_heads, num_kv_heads, head_dim, kv_block_size, device, dtype, full_blocks: bool):
        group = num_heads // num_kv_heads
        self.group, self.num_kv_heads, self.kv_block_size = group, num_kv_heads, kv_block_size
        # Pages: a KV head's query heads packed as rows (a power-of-two group; else a row per head), query
        # blocks of whole tokens and at least 16 rows (a block's tokens share its listed KV blocks).
        self.page_rows = group if group & (group - 1) == 0 else 1
        self.page_tokens = max(1, SPARSE_Q_ROWS // self.page_rows)
        self.page_options = triton_options(device, self.page_rows * self.page_tokens, kv_block_size, head_dim, dtype)
        # Gathered: a token's G query rows (padded to a power of two) in blocks of up to 64 (two blocks of
        # MLA-128's 128 rows keep two CPU cores busy on one decode), its gathered keys in blocks of 64.
        self.gather_rows = 1 << (group - 1).bit_length()
        q_block = min(GATHER_Q_ROWS, max(SPARSE_Q_ROWS, self.gather_rows))
        self.gathered_masks = GatheredMasks(self.gather_rows, q_block, GATHER_KV_BLOCK, device, full_blocks)
        self.gather_options = triton_options(device, q_block, GATHER_KV_BLOCK, head_dim, dtype)

    def pages(self, q, k, v, selected, sinks, attend: Attend) -> tuple[torch.Tensor, Share]:
        """Every query token one row of a flat call over the whole cache k, v [1, H_kv, N, D] whose BlockMask
        lists the blocks of its query block's selected slots and whose mask_mod keeps each row's own."""
        g, per_block = self.page_rows, self.page_tokens
        mask, _, padded = sparse_block_mask(selected, k.shape[2], per_block, self.kv_block_size, g)
        x = rearrange(F.pad(q, (0, 0, 0, 0, 0, padded - q.shape[0])), "t (hk g) d -> 1 hk (t g) d", g=g)
        if sinks is not None:  # [H] -> like flex's log-sum-exp [1, H_kv, T * G]
            sinks = repeat(sinks.view(-1, g), "hk g -> 1 hk (t g)", t=padded)
        y = attend(x, k, v, mask, self.page_options, sinks)
        out = rearrange(y[0], "hk (t g) d -> t (hk g) d", g=g)[: q.shape[0]]
        return out, lambda: selected_share(selected, mask, per_block)

    def gathered(self, q, k_cache, v_cache, selected, sinks, attend: Attend) -> tuple[torch.Tensor, Share]:
        """Each token's picks gathered, one flat call per chunk of tokens: token t's query heads of a KV head
        as rows (padded to a power of two) over its K' gathered keys (the top-k in whole KV blocks, picks
        first); the BlockMask lists only the blocks holding picks. Chunks of whole query blocks bound the buffer."""
        group, rows, kv_block = self.group, self.gather_rows, GATHER_KV_BLOCK
        width = gathered_width(selected.shape[1], kv_block)
        per_block = self.gathered_masks.tokens_per_block
        padded = -(-q.shape[0] // per_block) * per_block
        # picks first, -1 (none) last: the indexer's order already; sorting keeps any other exact
        picks = selected.sort(dim=1, descending=True).values
        picks = F.pad(picks, (0, width - picks.shape[1], 0, padded - picks.shape[0]), value=-1)
        counts = (picks >= 0).sum(dim=1, dtype=torch.int32)
        x = rearrange(q, "t (hk g) d -> t hk g d", g=group)
        x = F.pad(x, (0, 0, 0, rows - group, 0, 0, 0, padded - q.shape[0]))  # rows to a power of two, whole blocks
        if sinks is not None:  # [H] -> like flex's log-sum-exp [1, H_kv, t * rows]
            sinks = F.pad(sinks.view(self.num_kv_heads, group), (0, rows - group))
        out = q.new_empty(*q.shape[:2], v_cache.shape[-1])
        for t0, t1, k, v, _ in read_selected(k_cache, v_cache, picks, None, q.dtype, tokens_multiple=per_block):
            mask = self.gathered_masks.block_mask(counts[t0:t1], width)
            k, v = (rearrange(t, "t hk w d -> 1 hk (t w) d") for t in (k, v))  # views where H_kv is 1
            chunk_sinks = None if sinks is None else repeat(sinks, "hk g -> 1 hk (t g)", t=t1 - t0)
            y = attend(rearrange(x[t0:t1], "t hk g d -> 1 hk (t g) d"), k, v, mask, self.gather_options, chunk_sinks)
            real = min(t1, q.shape[0]) - t0
            if real > 0:
                y = rearrange(y[0], "hk (t g) d -> t hk g d", g=rows)[:real, :, :group]
                out[t0 : t0 + real] = rearrange(y, "t hk g d -> t (hk g) d")
        return out, lambda: gathered_share(counts[: q.shape[0]], kv_block)
