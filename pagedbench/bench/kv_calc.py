"""KV-cache memory arithmetic (`pagedbench kv-calc`): what one token and one block cost for a
model, how many blocks a memory budget holds, how many sequences of a length fit at once, and
what the block size trades: a bigger block means fewer block-table entries and bigger kernel
tiles, but more slots allocated and never used in each sequence's last block."""

import itertools

import pandas as pd
import torch

from pagedbench.engine.block_manager import blocks_needed
from pagedbench.engine.kv_budget import default_mamba_block_size
from pagedbench.model.config import ModelConfig
from pagedbench.worker.linear_state import state_bytes_per_sequence
from pagedbench.worker.model_runner import kv_bytes_per_block

GIB = 1 << 30


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """K and V, every layer, every KV head: 2 x layers x kv_heads x head_dim x bytes as stored
    (int8 adds its per-token scales)."""
    return kv_bytes_per_block(cfg, 1, dtype, kv_cache_dtype=kv_cache_dtype)


def kv_table(
    cfg: ModelConfig,
    dtype: torch.dtype,
    memory_bytes: int,
    block_sizes: list[int],
    seq_lens: list[int],
    kv_cache_dtypes: list[str] = ("auto",),
) -> pd.DataFrame:
    """One row per (KV storage, block size, sequence length): blocks in `memory_bytes`, sequences
    of that length held at once (a hybrid model's each with its DeltaNet state too), and the slots
    of their last blocks left empty (internal fragmentation)."""
    rows = []
    state = state_bytes_per_sequence(cfg, dtype)  # hybrid models: each sequence's DeltaNet state besides its pages
    for kv, bs, length in itertools.product(kv_cache_dtypes, block_sizes, seq_lens):
        per_token = kv_bytes_per_token(cfg, dtype, kv)
        num_blocks = memory_bytes // (per_token * bs)
        per_seq = blocks_needed(length, bs)
        rows.append(
            {
                "kv_cache_dtype": kv,
                "block size": bs,
                "KiB per token": per_token / 1024,
                "MiB per block": per_token * bs / 2**20,
                "blocks": num_blocks,
                "tokens": num_blocks * bs,
                "seq len": length,
                "blocks per seq": per_seq,
                **({"state MiB per seq": state / 2**20} if state else {}),
                # prefix caching resumes a hybrid's state only where it was snapshotted: every this many tokens
                **({"snapshot every": default_mamba_block_size(cfg, bs, dtype, kv)} if state else {}),
                "concurrent seqs": memory_bytes // (per_seq * per_token * bs + state),
                "wasted slots per seq": per_seq * bs - length,
                "wasted %": round(100 * (per_seq * bs - length) / (per_seq * bs), 2),
            }
        )
    return pd.DataFrame(rows)
