"""KV-cache memory arithmetic (`pagedbench kv-calc`): what one token and one block cost for a
model, how many blocks a memory budget holds, how many sequences of a length fit at once, and
what the block size trades: a bigger block means fewer block-table entries and bigger kernel
tiles, but more slots allocated and never used in each sequence's last block."""

import pandas as pd
import torch

from pagedbench.engine.block_manager import blocks_needed
from pagedbench.model.config import ModelConfig

GIB = 1 << 30


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """K and V, every layer, every KV head: 2 x layers x kv_heads x head_dim x bytes."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def kv_table(
    cfg: ModelConfig, dtype: torch.dtype, memory_bytes: int, block_sizes: list[int], seq_lens: list[int]
) -> pd.DataFrame:
    """One row per (block size, sequence length): blocks in `memory_bytes`, sequences of that
    length held at once, and the slots of their last blocks left empty (internal fragmentation)."""
    per_token = kv_bytes_per_token(cfg, dtype)
    rows = []
    for bs in block_sizes:
        num_blocks = memory_bytes // (per_token * bs)
        for length in seq_lens:
            per_seq = blocks_needed(length, bs)
            rows.append(
                {
                    "block size": bs,
                    "KiB per token": per_token / 1024,
                    "MiB per block": per_token * bs / 2**20,
                    "blocks": num_blocks,
                    "tokens": num_blocks * bs,
                    "seq len": length,
                    "blocks per seq": per_seq,
                    "concurrent seqs": num_blocks // per_seq,
                    "wasted slots per seq": per_seq * bs - length,
                    "wasted %": round(100 * (per_seq * bs - length) / (per_seq * bs), 2),
                }
            )
    return pd.DataFrame(rows)
