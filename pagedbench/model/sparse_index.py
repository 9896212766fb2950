"""DeepSeek-V3.2's sparse attention (DSA): the lightning indexer and the top-k selection it makes.

Each layer's indexer projects a few small query heads (from the query LoRA's residual) and one index
key per token (LayerNorm'd, its first rope_dim dims rotated half-split, unlike MLA's interleaved
rotary dims). A query scores every token of its causal past as sum_h w_h * relu(q_h . k * D^-1/2),
w = weights_proj(x) * H^-1/2, and attention reads only the `topk` best: transformers' arithmetic,
in fp32, as DeepseekV32Indexer computes it. The index keys are paged beside the latents (same block
ids, so one block table, prefix caching, copies and swaps serve both); the selection is the cache
slots each query reads, -1 where its past is shorter than topk.

The selection runs in plain torch, one batched call for the step's decodes and one per prefill
chunk, bounded in memory: the swappable step the report times as `indexer`.
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from pagedbench.backends.base import AttentionMetadata
from pagedbench.model.config import ModelConfig
from pagedbench.model.fused import EAGER, LayerOps

_observers: list[list] = []  # observe_selections(): lists each selection is appended to (on the host)


@contextlib.contextmanager
def observe_selections():
    """Every selection made inside, as [T, topk] slot tensors on the host in order (quality checks)."""
    picks: list = []
    _observers.append(picks)
    try:
        yield picks
    finally:
        _observers.remove(picks)


INDEX_NORM_EPS = 1e-6  # transformers' k_norm LayerNorm
SCORE_ELEMENTS = 1 << 24  # fp32 scores held at once (query rows x heads x keys): 64 MiB


class Indexer(nn.Module):
    """One layer's lightning indexer; module names are transformers' (self_attn.indexer.*)."""

    ops: LayerOps = EAGER

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        ix = self.spec = cfg.indexer
        self.layer_idx = layer_idx
        self.wq_b = nn.Linear(cfg.mla.q_lora_rank, ix.n_heads * ix.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, ix.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(ix.head_dim, eps=INDEX_NORM_EPS)
        self.weights_proj = nn.Linear(cfg.hidden_size, ix.n_heads, bias=False)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, rope, ctx) -> torch.Tensor:
        """x [T, hidden], q_resid [T, q_lora_rank] -> the cache slots [T, topk] each query attends to."""
        ix = self.spec
        q = rearrange(self.wq_b(q_resid), "t (h d) -> t h d", d=ix.head_dim)
        k = self.k_norm(self.wk(x))[:, None]  # [T, 1, D]: one index key per token
        rest = ix.head_dim - ix.rope_dim
        (q_rot, q_pass), (k_rot, k_pass) = q.split([ix.rope_dim, rest], -1), k.split([ix.rope_dim, rest], -1)
        q_rot, k_rot = self.ops.latent_rope(q_rot, k_rot, *rope, False)  # half-split, not MLA's interleave
        q, k = torch.cat((q_rot, q_pass), -1), torch.cat((k_rot, k_pass), -1)[:, 0]
        # transformers keeps weights_proj in fp32
        weights = F.linear(x.float(), self.weights_proj.weight.float()) * ix.n_heads**-0.5
        return ctx.sparse.select(self.layer_idx, q, k, weights)


def sequence_slots(meta) -> torch.Tensor:
    """[B, max_seq_len] int64: each sequence's cache slot at each position, -1 past its end."""
    bs, length = meta.block_size, max(meta.seq_lens_cpu)
    pos = torch.arange(length, device=meta.block_table.device)
    blocks = meta.block_table[:, : (length + bs - 1) // bs].long()
    return (blocks[:, pos // bs] * bs + pos % bs).masked_fill(pos >= meta.seq_lens[:, None], -1)


@dataclass(slots=True)
class SparseStep:
    """One step's view of the index-key pages: every sequence's cache slots by position, built once
    per step and read by every layer's selection."""

    # per layer (keys [num_blocks, block_size, D], fp8 keys' scales [num_blocks, block_size] or None);
    # None: another stage's layer
    index_caches: list
    slot_mapping: torch.Tensor  # [T] where this step's index keys go
    seq_slots: torch.Tensor  # [B, max_seq_len] int64: sequence b's slot at each position, -1 past its end
    positions: torch.Tensor  # [T] int64
    query_start_loc: list[int]
    num_decodes: int  # sequences with one query token: they come first
    topk: int
    scale: float  # the index head's D^-1/2
    timer: object = None  # a DeviceTimer: each layer's selection becomes an "indexer" span

    @classmethod
    def build(cls, meta: AttentionMetadata, index_caches: list, cfg: ModelConfig, timer=None) -> "SparseStep":
        ix = cfg.indexer
        return cls(index_caches, meta.slot_mapping, sequence_slots(meta), meta.positions, meta.query_start_loc_cpu,
                   meta.num_decodes, ix.topk, ix.head_dim**-0.5, timer)  # fmt: skip

    def select(self, layer: int, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Write this step's index keys k [T, D], then score: q [T, H, D], weights [T, H] fp32 ->
        the slots [T, topk] each query reads (-1: its past is shorter than topk)."""
        start = self.timer.mark() if self.timer is not None else None
        keys, scales = self.index_caches[layer]
        cache = keys.view(-1, k.shape[-1])
        if scales is None:
            cache.index_copy_(0, self.slot_mapping, k.to(cache.dtype))
        else:  # fp8: a scale per token, its largest magnitude at e4m3's largest
            scale = (k.abs().amax(-1).float() / torch.finfo(cache.dtype).max).clamp(min=1e-12)
            fp8 = (k.float() / scale[:, None]).to(cache.dtype)  # as bytes: CPU torch has no fp8 index_copy_
            cache.view(torch.uint8).index_copy_(0, self.slot_mapping, fp8.view(torch.uint8))
            scales.view(-1).index_copy_(0, self.slot_mapping, scale)
            scales = scales.view(-1)
        selected = torch.full((q.shape[0], self.topk), -1, dtype=torch.long, device=q.device)
        qsl, rows = self.query_start_loc, max(1, SCORE_ELEMENTS // (q.shape[1] * self.seq_slots.shape[1]))
        # The decodes batched (query t is sequence t's), each prefill's queries against its own keys
        # (gathered once), in chunks of query rows that bound the fp32 scores.
        for t0 in range(0, self.num_decodes, rows):
            t1 = min(t0 + rows, self.num_decodes)
            slots = self.seq_slots[t0:t1]
            keys = self._keys(cache, scales, slots)
            selected[t0:t1] = self._top(keys, q[t0:t1], weights[t0:t1], self.positions[t0:t1], slots)
        for i in range(self.num_decodes, len(qsl) - 1):
            slots = self.seq_slots[i : i + 1]
            keys = self._keys(cache, scales, slots)
            for t0 in range(qsl[i], qsl[i + 1], rows):
                t1 = min(t0 + rows, qsl[i + 1])
                selected[t0:t1] = self._top(keys, q[t0:t1], weights[t0:t1], self.positions[t0:t1], slots)
        if start is not None:
            self.timer.span("indexer", start)
        for picks in _observers:
            picks.append(selected.cpu())
        return selected

    @staticmethod
    def _keys(cache, scales, slots) -> torch.Tensor:
        """The index keys at `slots` [n, L] in fp32 -> [n, L, D] (`scales` [slots]: fp8 keys' per-token
        scales, else None)."""
        at = slots.clamp(min=0)
        if scales is None:
            return cache[at].float()
        # fp8 gathered as bytes (CPU torch cannot index fp8), then scaled per token
        return cache.view(torch.uint8)[at].view(cache.dtype).float() * scales[at][..., None]

    def _top(self, keys, q, weights, positions, slots) -> torch.Tensor:
        """The topk of `slots` (one row per query [T, L], or one row all T queries share [1, L]), whose
        keys are `keys` [T or 1, L, D], for queries q [T, H, D] at `positions` [T]: transformers' fp32
        scores, then top-k of the seen."""
        if slots.shape[0] == 1:
            scores = torch.einsum("thd,ld->thl", q.float(), keys[0])
        else:
            scores = torch.einsum("thd,tld->thl", q.float(), keys)
        index = torch.einsum("th,thl->tl", weights, F.relu(scores * self.scale))  # [T, L]
        seen = torch.arange(slots.shape[1], device=q.device)[None, :] <= positions[:, None]
        index = index.masked_fill(~seen | (slots < 0), float("-inf"))
        best, where = index.topk(min(self.topk, slots.shape[1]), dim=-1)
        chosen = slots.expand(q.shape[0], -1).gather(1, where).masked_fill(best == float("-inf"), -1)
        return F.pad(chosen, (0, self.topk - chosen.shape[1]), value=-1)
