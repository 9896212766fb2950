"""Random paged-attention problems, shared by `kernels`, `check` and the tests.

A problem is first logical: per sequence its keys and values `[seq_len, H_kv, D]` and its new
tokens' queries. A layout then places it in a paged cache: each sequence's pages drawn at random
from a pool whose block 0 is never used and whose spare blocks hold loud garbage, optionally
sharing pages between sequences (a common prefix, or a fork sharing everything). The oracle
attends from the logical tensors alone, so it is independent of every backend and every layout.
"""

import functools
from dataclasses import dataclass, field

import torch

from pagedbench.backends.base import PLAIN, AttentionMetadata, AttentionVariant, write_kv
from pagedbench.engine.block_manager import blocks_needed
from pagedbench.engine.sequence import Sequence
from pagedbench.sample.sampling_params import SamplingParams
from pagedbench.worker.step_batch import build_step_inputs

PLACEMENTS = ("random", "contiguous")


@dataclass(slots=True)
class AttentionBatch:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor
    metadata: AttentionMetadata
    selected: torch.Tensor | None = None  # sparse attention: [T, topk] cache slots per query (-1: none)


@dataclass(slots=True)
class AttentionProblem:
    """Logical content: sequence i has seqs[i] = (context_len, query_len) and keys/values
    k[i], v[i] `[context_len + query_len, H_kv, D]`; its queries are its rows of q `[T, H, D]`."""

    seqs: list[tuple[int, int]]
    q: torch.Tensor
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    shared: dict[int, tuple[int, int]] = field(default_factory=dict)  # b -> (a, tokens): b's first tokens are a's
    value_dim: int | None = None  # latent attention: each v[i] is k[i]'s first value_dim dims (a view)
    # Sparse attention: sequence i's query rows [query_len, topk] list the positions each reads (-1: none)
    selected: list[torch.Tensor] | None = None

    @property
    def num_kv_heads(self) -> int:
        return self.k[0].shape[1]


def random_problem(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    shared: dict[int, tuple[int, int]] | None = None,
    value_dim: int | None = None,
    topk: int | None = None,
) -> AttentionProblem:
    """Normal random queries, keys and values in `dtype` (on the CPU). `shared` makes sequence b's
    first `tokens` keys and values equal to sequence a's (a < b), so a layout may share their pages.
    `value_dim`: latent attention, whose values are the keys' first value_dim dims. `topk`: sparse
    attention, each query reading a random selection of its past (random_selection)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen).to(dtype)

    k = [randn(c + q, num_kv_heads, head_dim) for c, q in seqs]
    v = [randn(c + q, num_kv_heads, head_dim) for c, q in seqs]
    shared = dict(shared or {})
    for b, (a, tokens) in shared.items():
        if not (a < b and tokens <= min(sum(seqs[a]), sum(seqs[b]))):
            raise ValueError(f"sequence {b} cannot share {tokens} tokens with sequence {a}")
        k[b][:tokens], v[b][:tokens] = k[a][:tokens], v[a][:tokens]
    q = randn(sum(q for _, q in seqs), num_heads, head_dim)
    if value_dim is not None:
        v = [keys[..., :value_dim] for keys in k]
    selected = None if topk is None else [random_selection(c, n, topk, gen) for c, n in seqs]
    return AttentionProblem(list(seqs), q, k, v, shared, value_dim, selected)


def random_selection(context: int, query_len: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """[query_len, topk] positions: query i (at context + i) reads min(topk, context + i + 1) distinct
    positions of its causal past drawn at random (spread over its pages, its own always among
    them as an indexer's scores would have it), -1 past them."""
    rows = torch.full((query_len, topk), -1, dtype=torch.long)
    for i in range(query_len):
        pos = context + i
        past = torch.randperm(pos, generator=gen)[: min(topk, pos + 1) - 1]
        picked = torch.cat([past, torch.tensor([pos])])
        rows[i, : len(picked)] = picked
    return rows


def shared_pages(problem: AttentionProblem, b: int, block_size: int) -> tuple[int, int]:
    """(a, pages): how many of sequence b's first pages are physically sequence a's. Whole pages of
    a shared prefix, and every page, the partial last one too, of a fork (same tokens, same length)."""
    if b not in problem.shared:
        return b, 0
    a, tokens = problem.shared[b]
    fork = tokens == sum(problem.seqs[a]) == sum(problem.seqs[b]) and problem.seqs[a] == problem.seqs[b]
    return a, blocks_needed(tokens, block_size) if fork else tokens // block_size


def place(
    problem: AttentionProblem,
    block_size: int,
    device: torch.device | str = "cpu",
    layout_seed: int = 0,
    spare_blocks: int = 3,
    null_block: bool = True,
    cache_blocks: int | None = None,
    placement: str = "random",
) -> AttentionBatch:
    """The problem in a paged cache on `device`: pages at random (block 0 never used when
    `null_block`, `spare_blocks` unused ones of garbage), the shared ones shared, and the step's
    AttentionMetadata (whose table rows are padded with 0). `cache_blocks`: the cache's pages instead
    (an engine's whole cache, the rest garbage); `placement` "contiguous": each sequence's pages in
    order, one after another from the first free page (as a block manager allocates a fresh cache)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    device = torch.device(device)
    gen = torch.Generator().manual_seed(layout_seed)
    needed = [blocks_needed(c + q, block_size) for c, q in problem.seqs]
    reused = [shared_pages(problem, b, block_size) for b in range(len(needed))]
    num_blocks = int(null_block) + sum(n - pages for n, (_, pages) in zip(needed, reused)) + spare_blocks
    if cache_blocks is not None:
        if cache_blocks < num_blocks - spare_blocks:
            raise ValueError(f"cache_blocks {cache_blocks} < the {num_blocks - spare_blocks} pages the problem needs")
        num_blocks = cache_blocks
    order = torch.arange if placement == "contiguous" else functools.partial(torch.randperm, generator=gen)
    free = (order(num_blocks - null_block) + null_block).tolist()
    tables: list[list[int]] = []
    for n, (a, pages) in zip(needed, reused):
        own = n - pages
        tables.append(tables[a][:pages] + free[:own] if pages else free[:own])
        free = free[own:]
    num_kv_heads, head_dim, dtype = problem.num_kv_heads, problem.k[0].shape[2], problem.k[0].dtype
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).mul_(100).to(device, dtype)  # garbage: loud if read
    v_cache = torch.randn(cache_shape, generator=gen).mul_(100).to(device, dtype)
    latent = problem.value_dim is not None
    if latent:  # one plane: the values are a view of the key pages
        v_cache = k_cache[..., : problem.value_dim]
    slots = torch.cat(
        [
            torch.tensor(table, dtype=torch.long).repeat_interleave(block_size)[: len(k)] * block_size
            + torch.arange(len(k)) % block_size
            for table, k in zip(tables, problem.k)
        ]
    )
    v = None if latent else torch.cat(problem.v).to(device)
    write_kv(torch.cat(problem.k).to(device), v, k_cache, v_cache, slots.to(device))
    sequences = []
    for i, ((ctx, qlen), table) in enumerate(zip(problem.seqs, tables)):
        s = Sequence(str(i), None, [0] * (ctx + qlen), SamplingParams())
        s.num_computed_tokens, s.block_table = ctx, table
        sequences.append(s)
    step = build_step_inputs(sequences, [q for _, q in problem.seqs], block_size, num_blocks, device)
    selected = None
    if problem.selected is not None:  # the selected positions as this layout's cache slots
        by_pos = [torch.tensor(t, dtype=torch.long).repeat_interleave(block_size) * block_size
                  + torch.arange(len(t) * block_size) % block_size for t in tables]  # fmt: skip
        selected = torch.cat([torch.where(rows >= 0, slots_of[rows.clamp(min=0)], -1)
                              for rows, slots_of in zip(problem.selected, by_pos)]).to(device)  # fmt: skip
    return AttentionBatch(problem.q.to(device), k_cache, v_cache, step.metadata, selected)


def error_columns(out: torch.Tensor, expected: torch.Tensor) -> dict:
    """max_abs_error: the largest |out - expected|; max_rel_error: that over the largest |expected|
    (relative to the output's scale, not per element: attention outputs near zero would dominate)."""
    error = float((out.to(expected.dtype) - expected).abs().max()) if out.numel() else 0.0
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    return {"max_abs_error": error, "max_rel_error": error / scale if scale else float(error > 0) * float("inf")}


def causal_mask(cached: int, new: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[new, cached + new] bool: query i (position cached + i) sees keys 0..cached + i."""
    return torch.arange(cached + new, device=device)[None, :] <= cached + torch.arange(new, device=device)[:, None]


def attend_dense(
    problem: AttentionProblem,
    scale: float,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    variant: AttentionVariant = PLAIN,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per sequence, causal attention (aligned to the end of its keys) on the logical tensors,
    every operation in `dtype` on `device`: [T, H, D] in `dtype`. In fp64 it is the oracle; in the
    problem's dtype, the naive computation whose error sets that dtype's tolerance. The variant is
    written out here again, on purpose: the oracle shares no code with the backends it judges."""
    out, start = [], 0
    for (ctx, qlen), k, v in zip(problem.seqs, problem.k, problem.v):
        q = problem.q[start : start + qlen].to(device, dtype).transpose(0, 1)  # [H, q, D]
        group = q.shape[0] // k.shape[1]
        k = k.to(device, dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        v = v.to(device, dtype).repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (q @ k.transpose(1, 2)) * scale
        if variant.softcap is not None:
            scores = torch.tanh(scores / variant.softcap) * variant.softcap
        seen = causal_mask(ctx, qlen, device)
        if problem.selected is not None:  # sparse: only the positions each query selected
            chosen = problem.selected[len(out)].to(device)
            row, col = (chosen >= 0).nonzero(as_tuple=True)
            picked = torch.zeros_like(seen)
            picked[row, chosen[row, col]] = True
            seen &= picked
        if variant.sliding_window is not None:  # key j is too old for query i once ctx + i - j >= window
            age = ctx + torch.arange(qlen, device=device)[:, None] - torch.arange(ctx + qlen, device=device)
            seen &= age < variant.sliding_window
        scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is not None:  # one more logit per head in the denominator, no value
            scores = torch.cat([scores, sinks.to(device, dtype)[:, None, None].expand(-1, qlen, 1)], dim=-1)
        out.append((scores.softmax(-1)[..., : ctx + qlen] @ v).transpose(0, 1))
        start += qlen
    return torch.cat(out)


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
    null_block: bool = True,
    value_dim: int | None = None,
    topk: int | None = None,
    cache_blocks: int | None = None,
    placement: str = "random",
) -> AttentionBatch:
    """`seqs` lists (context_len, query_len) per sequence, decodes (query_len 1) first: a random
    problem placed on fragmented block tables, its new tokens' K/V written as the model would
    (`value_dim`: latent attention's one plane, values a view of the keys' first dims; `topk`: each
    query's random selection of its past, as cache slots in `selected`; `cache_blocks`, `placement`: place's)."""
    problem = random_problem(seqs, num_heads, num_kv_heads, head_dim, dtype, seed, value_dim=value_dim, topk=topk)
    return place(problem, block_size, device, seed, spare_blocks, null_block, cache_blocks, placement)
