"""flex's sparse attention (DeepSeek-V3.2): a BlockMask built from each query's selected cache slots.

The step's queries are one flat row [1, H_kv, T * G, D] over the whole cache as one key sequence,
the G query heads of each KV head packed as G consecutive rows per token (MLA: all of them over the
one latent), so a block of rows reads each key once for all of them. Query block r (whole tokens)
lists the KV blocks holding any slot one of its tokens selected, every one partial (masked); the
mask_mod keeps, for a row of token t, exactly the slots t selected: a bitmap of T rows x one bit
per cache slot (int32 words), filled by one scatter. Exact, and flex
reads only the listed blocks, so a decode's cost follows its top-k, not its context; the tile
efficiency is the selected share of the listed blocks' slots.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

WORD_BITS = 32


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
