"""The ground truth: one sequence at a time, its pages gathered, softmax in fp32; every variant
(sliding window, soft-cap, sinks) in plain torch."""

from dataclasses import dataclass

import torch
from einops import rearrange, repeat
from pagedbench.backends.base import (
    QUANTIZED_KV,
    AttentionBackend,
    AttentionMetadata,
    cap_scores,
    gather_kv_slots,
    read_kv,
    read_selected,
    softmax_with_sinks,
    visible,
)
from pagedbench.backends.cascade import CascadeAttention, CascadeState


@dataclass(slots=True)
class _Seq:
    q_start: int
    q_end: int
    context_len: int
    kv_slots: torch.Tensor  # [seq_len] cache slots of this sequence's tokens


class ReferenceBackend(CascadeAttention, AttentionBackend):
    name = "reference"
    quantized_kv = QUANTIZED_KV  # dequantized as gathered
    latent_values = True  # the gathered V rows are the latent's first value_dim dims
    sparse_selection = True  # it gathers each query's selected slots
    cuda_graph_reason = "it attends one sequence at a time, looping over host-side lengths"
    batch_invariant_reason = None  # each sequence alone, over exactly its own keys
    cascade_attention = True  # suffixes as below, each group's prefix in fp32 explicit scores (cascade.py)

    @classmethod
    def unavailable_reason(cls, device, dtype, head_dim, block_size, **kwargs) -> str | None:
        return None  # every variant

    def plan(self, meta: AttentionMetadata) -> list[_Seq] | CascadeState:
        if meta.cascade is not None:
            return self.plan_cascade_step(meta, self._plan_flat)
        return self._plan_flat(meta)

    def _plan_flat(self, meta: AttentionMetadata) -> list[_Seq]:
        qsl = meta.query_start_loc_cpu
        return [
            _Seq(qsl[i], qsl[i + 1], meta.context_lens_cpu[i], gather_kv_slots(meta, i, i + 1, seq_len)[0])
            for i, seq_len in enumerate(meta.seq_lens_cpu)
        ]

    def forward(self, q, k_cache, v_cache, state, sinks=None, kv_scales=None, selected=None):
        if isinstance(state, CascadeState) and selected is None:
            flat = lambda q, flat_state: self.forward(q, k_cache, v_cache, flat_state, sinks, kv_scales)
            return self.cascade_forward(q, k_cache, v_cache, state, flat, sinks, kv_scales)
        out = q.new_empty(*q.shape[:2], v_cache.shape[-1])  # [T, H, D_v]
        group = self.num_heads // self.num_kv_heads
        if selected is not None:  # sparse: each query its own selected tokens, fp32
            for t0, t1, k, v, seen in read_selected(k_cache, v_cache, selected, kv_scales, torch.float32):
                qi = rearrange(q[t0:t1].float(), "t (hk g) d -> t hk g d", g=group)
                scores = cap_scores((qi @ k.transpose(-1, -2)) * self.scale, self.variant.softcap)  # [t, hk, g, K]
                row_sinks = None if sinks is None else rearrange(sinks, "(hk g) -> hk g", g=group)
                probs = softmax_with_sinks(scores.masked_fill(~seen, float("-inf")), row_sinks)
                out[t0:t1] = rearrange(probs @ v, "t hk g d -> t (hk g) d").to(q.dtype)
            return out
        k_scale, v_scale = kv_scales or (None, None)
        for s in state:
            qi = rearrange(q[s.q_start : s.q_end].float(), "q h d -> h q d")
            k = repeat(read_kv(k_cache, s.kv_slots, k_scale, torch.float32), "s hkv d -> (hkv g) s d", g=group)
            v = repeat(read_kv(v_cache, s.kv_slots, v_scale, torch.float32), "s hkv d -> (hkv g) s d", g=group)
            scores = cap_scores((qi @ k.transpose(1, 2)) * self.scale, self.variant.softcap)  # [H, q, S]
            q_pos = s.context_len + torch.arange(qi.shape[1], device=q.device)
            kv_pos = torch.arange(k.shape[1], device=q.device)
            scores.masked_fill_(~visible(q_pos[:, None], kv_pos[None, :], self.variant.sliding_window), float("-inf"))
            probs = softmax_with_sinks(scores, sinks)
            out[s.q_start : s.q_end] = rearrange(probs @ v, "h q d -> q h d").to(q.dtype)
        return out
