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

The tile efficiency of either is the selected share of the listed blocks' slots.
"""

import os

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

WORD_BITS = 32
SPARSE_PATHS = ("auto", "gather", "pages")
PAGES_MIN_TOKENS = 8  # query tokens from which a step whose sequences fit the top-k takes the page BlockMask


def forced_sparse_path() -> str:
    """PAGEDBENCH_FLEX_SPARSE: auto (default), or gather / pages, one way for every sparse step."""
    forced = os.environ.get("PAGEDBENCH_FLEX_SPARSE", "auto").strip().lower() or "auto"
    if forced not in SPARSE_PATHS:
        raise ValueError(f"PAGEDBENCH_FLEX_SPARSE={forced!r} is not one of {', '.join(SPARSE_PATHS)}")
    return forced


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
