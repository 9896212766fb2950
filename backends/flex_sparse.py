"""flex's sparse attention (DeepSeek-V3.2): a BlockMask built from each query's selected cache slots.

The step's queries are one flat row [1, H, T, D] over the whole cache as one key sequence. Query
block r (q_block rows) lists the KV blocks that hold any slot one of its rows selected, every one
of them partial (masked); the mask_mod keeps, for query row t, exactly the slots t selected: a
bitmap of T rows x one bit per cache slot (int32 words), filled by one scatter. Exact, and flex
reads only the listed blocks, so a decode's cost follows its top-k, not its context; the tile
efficiency is the selected share of the listed blocks' slots.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

WORD_BITS = 32


def sparse_block_mask(
    selected: torch.Tensor, num_slots: int, q_block: int, kv_block: int
) -> tuple[BlockMask, torch.Tensor, int]:
    """(BlockMask, bitmap words [T', num_slots / 32], T' = T padded to whole query blocks) for
    `selected` [T, topk] slots (-1: none)."""
    num_tokens, topk = selected.shape
    padded = -(-num_tokens // q_block) * q_block
    selected = F.pad(selected, (0, 0, 0, padded - num_tokens), value=-1)
    valid = selected >= 0
    # one bit per (query row, slot); a row's slots are distinct, so adding the bits is OR-ing them
    words = torch.zeros(padded, -(-num_slots // WORD_BITS), dtype=torch.int32, device=selected.device)
    slots = selected.clamp(min=0)
    bits = torch.bitwise_left_shift(torch.ones_like(slots, dtype=torch.int32), (slots % WORD_BITS).int())
    words.scatter_add_(1, slots // WORD_BITS, torch.where(valid, bits, 0))
    # each query block's distinct KV blocks, ascending, then the padding (num_kv_blocks, sorted last)
    num_kv_blocks = -(-num_slots // kv_block)
    blocks = torch.where(valid, selected // kv_block, num_kv_blocks).view(padded // q_block, q_block * topk)
    blocks = blocks.sort(dim=1).values
    repeat = torch.zeros_like(blocks, dtype=torch.bool)
    repeat[:, 1:] = blocks[:, 1:] == blocks[:, :-1]
    blocks = blocks.masked_fill(repeat, num_kv_blocks).sort(dim=1).values
    counts = (blocks < num_kv_blocks).sum(dim=1)
    # flex sizes the key dimension by the index table's width: a column per KV block of the cache
    width = min(q_block * topk, num_kv_blocks)
    indices = F.pad(blocks[:, :width], (0, num_kv_blocks - width), value=num_kv_blocks)
    indices = indices.clamp(max=num_kv_blocks - 1).int()

    def keep_selected(b, h, q_idx, kv_idx):
        return (torch.bitwise_right_shift(words[q_idx, kv_idx // WORD_BITS], kv_idx % WORD_BITS) & 1) == 1

    mask = BlockMask.from_kv_blocks(
        counts.int()[None, None],
        indices[None, None],
        BLOCK_SIZE=(q_block, kv_block),
        mask_mod=keep_selected,
        seq_lengths=(padded, num_slots),
    )
    return mask, words, padded


def selected_share(selected: torch.Tensor, mask: BlockMask, num_tokens: int) -> float:
    """Tile efficiency of a sparse call: selected slots over the listed blocks' slots, real rows only."""
    kept = int((selected[:num_tokens] >= 0).sum())
    q_block, kv_block = mask.BLOCK_SIZE
    listed = mask.kv_num_blocks[0, 0].long()
    rows = torch.full_like(listed, q_block)
    rows[-1] = num_tokens - q_block * (len(listed) - 1)
    return kept / max(1, int((listed * rows).sum()) * kv_block)
