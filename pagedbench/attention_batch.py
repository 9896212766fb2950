"""Random paged-attention problems for kernel-level tests and microbenchmarks: ragged
sequences on a shuffled (fragmented) block table, cache filled, queries ready."""
from dataclasses import dataclass

import torch

from pagedbench.backends.base import AttentionMetadata, write_kv
from pagedbench.block_manager import blocks_needed
from pagedbench.model_runner import prepare_step
from pagedbench.sampling_params import SamplingParams
from pagedbench.sequence import Sequence


@dataclass(slots=True)
class AttentionBatch:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor
    metadata: AttentionMetadata


def paged_metadata(seqs: list[tuple[int, int]], block_size: int, device: torch.device | str = "cpu", seed: int = 0,
                   spare_blocks: int = 3) -> AttentionMetadata:
    """The step's AttentionMetadata for `seqs` (context_len, query_len per sequence), each sequence's
    pages drawn from a random permutation of the cache's blocks (fragmented block tables, with
    `spare_blocks` unused ones). No cache is allocated: enough to build a backend's per-step state."""
    gen = torch.Generator().manual_seed(seed)
    needed = [blocks_needed(c + q, block_size) for c, q in seqs]
    num_blocks = sum(needed) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    sequences = []
    for i, ((ctx, qlen), n) in enumerate(zip(seqs, needed)):
        s = Sequence(str(i), None, [0] * (ctx + qlen), SamplingParams())
        s.num_computed_tokens = ctx
        s.block_table, perm = perm[:n], perm[n:]
        sequences.append(s)
    return prepare_step(sequences, [q for _, q in seqs], block_size, num_blocks, torch.device(device)).metadata


def random_attention_batch(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
) -> AttentionBatch:
    """`seqs` lists (context_len, query_len) per sequence, decodes (query_len 1) first, on
    fragmented block tables (`paged_metadata`); unused cache slots hold garbage that must never
    be read. The context's K/V are in the cache, the new tokens' written as the model would."""
    device = torch.device(device)
    meta = paged_metadata(seqs, block_size, device, seed, spare_blocks)
    gen = torch.Generator().manual_seed(seed + 1)
    cache_shape = (meta.num_cache_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).mul_(100).to(device, dtype)  # garbage: loud if read
    v_cache = torch.randn(cache_shape, generator=gen).mul_(100).to(device, dtype)
    # Context tokens' K/V go where earlier steps would have written them.
    table = meta.block_table.tolist()
    ctx_slots = [table[i][p // block_size] * block_size + p % block_size
                 for i, (ctx, _) in enumerate(seqs) for p in range(ctx)]
    if ctx_slots:
        k_ctx, v_ctx = _randn(gen, 2, len(ctx_slots), num_kv_heads, head_dim, dtype=dtype, device=device)
        write_kv(k_ctx, v_ctx, k_cache, v_cache, torch.tensor(ctx_slots, device=device))
    t = meta.num_tokens
    k_new, v_new = _randn(gen, 2, t, num_kv_heads, head_dim, dtype=dtype, device=device)
    write_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping)
    (q,) = _randn(gen, 1, t, num_heads, head_dim, dtype=dtype, device=device)
    return AttentionBatch(q, k_cache, v_cache, meta)


def _randn(gen, count, *shape, dtype, device):
    return [torch.randn(shape, generator=gen).to(device, dtype) for _ in range(count)]
