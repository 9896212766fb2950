"""Gather-then-SDPA: copy each sequence's pages into a padded batch, then one
`scaled_dot_product_attention` call with a causal + length mask.

Decodes and prefills are separate padded groups, so one long prefill does not pad every
decode to its query length. A sliding window is part of the boolean mask; soft-capping and sinks
have no hook in SDPA, so a layer with either takes an explicit score path (matmul, cap, softmax
with the sink column, matmul) over the same padded gather, and the provider says so.

GQA heads are packed into query rows: the G query heads that share a KV head become G rows of
that KV head's query (row = token * G + head in group), with the mask repeated per row. K/V are
gathered once per KV head and never repeated, and each kernel block meets G times more rows for
the same keys. (Repeating K/V for the memory-efficient kernel, which has no GQA, made decode read
G + 2 times the cache: 2.5-3 % of the copy bandwidth on an H200.)

On CUDA the kernel is chosen, not left to the dispatcher: the memory-efficient kernel (it takes
the boolean mask), never cuDNN, which builds a plan for every new shape (~1.7 ms of host time
per call on an H100, 28 calls a step).
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
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
from torch.nn.attention import SDPBackend, sdpa_kernel


@dataclass(slots=True)
class _Group:
    token_start: int
    token_end: int
    q_dest: torch.Tensor  # [tokens] row of each query token in the padded [n * max_q] batch
    kv_slots: torch.Tensor  # [n, max_kv] cache slots to gather
    mask: torch.Tensor  # [n, 1, max_q * G, max_kv] True = attend; row = query token * G + head in group
    num_seqs: int
    max_q: int


CUDA_KERNELS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # masks rule out flash; cuDNN plans per shape


class SDPABackend(CascadeAttention, AttentionBackend):
    name = "sdpa"
    quantized_kv = QUANTIZED_KV  # dequantized as gathered
    latent_values = True  # the gathered V rows are the latent's first value_dim dims
    sparse_selection = True  # each query's selected slots gathered into a batch of their own
    cuda_graph_reason = "plan() sizes its padded K/V gather by each step's longest sequence"
    batch_invariant_reason = "its K/V gather is padded to the batch's longest sequence, and P·V sums over that length"
    # Cascade: suffixes as below; a group's prefix one SDPA call over its stacked rows that returns the
    # log-sum-exp (the CPU flash kernel, CUDA's memory-efficient one; explicit scores with a window or soft-cap).
    cascade_attention = True
    batch_invariant_form = True  # each sequence a call of its own, over exactly its own keys (_groups)

    @classmethod
    def unavailable_reason(cls, device, dtype, head_dim, block_size, **kwargs) -> str | None:
        if kwargs.get("topk") and (kwargs.get("softcap") is not None or kwargs.get("sinks")):
            return "top-k sparse attention with a soft-cap or sinks: its sparse path is SDPA's, with no hook for either"
        return None  # every variant (soft-cap and sinks on the explicit score path)

    def plan(self, meta: AttentionMetadata) -> list[_Group] | CascadeState:
        if meta.cascade is not None:
            return self.plan_cascade_step(meta, self._plan_flat)
        return self._plan_flat(meta)

    def _plan_flat(self, meta: AttentionMetadata) -> list[_Group]:
        groups = []
        qsl = meta.query_start_loc_cpu
        for start, end in self._groups(meta):
            if start == end:
                continue
            max_q = max(qsl[i + 1] - qsl[i] for i in range(start, end))
            max_kv = max(meta.seq_lens_cpu[start:end])
            t0, t1 = qsl[start], qsl[end]
            seq = meta.token_seq_idx[t0:t1].long()
            q_local = torch.arange(t0, t1, device=seq.device) - meta.query_start_loc[seq]
            q_dest = (seq - start) * max_q + q_local
            q_pos = meta.context_lens[start:end, None] + torch.arange(max_q, device=seq.device)  # [n, max_q]
            kv_pos = torch.arange(max_kv, device=seq.device)
            in_seq = kv_pos < meta.seq_lens[start:end, None, None]
            mask = visible(q_pos[..., None], kv_pos, self.variant.sliding_window) & in_seq
            mask = repeat(mask, "n q s -> n 1 (q g) s", g=self.num_heads // self.num_kv_heads)
            groups.append(_Group(t0, t1, q_dest, gather_kv_slots(meta, start, end, max_kv), mask, end - start, max_q))
        return groups

    def _groups(self, meta: AttentionMetadata) -> list[tuple[int, int]]:
        """The sequence ranges padded together: decodes and the rest, or, batch-invariant, each alone."""
        if self.batch_invariant:
            return [(i, i + 1) for i in range(meta.num_seqs)]
        return [(0, meta.num_decodes), (meta.num_decodes, meta.num_seqs)]

    @classmethod
    def provider(cls, **settings) -> str:
        if settings.get("softcap") is not None or settings.get("sinks"):
            return f"torch {torch.__version__} explicit scores (SDPA has no soft-cap or sink hook)"
        device = settings.get("device")
        on_cuda = device is not None and torch.device(device).type == "cuda"
        return f"torch {torch.__version__}" + (" SDPA memory-efficient kernel (cuDNN excluded)" if on_cuda else "")

    def forward(self, q, k_cache, v_cache, state, sinks=None, kv_scales=None, selected=None):
        if isinstance(state, CascadeState) and selected is None:
            flat = lambda q, flat_state: self.forward(q, k_cache, v_cache, flat_state, sinks, kv_scales)
            return self.cascade_forward(q, k_cache, v_cache, state, flat, sinks, kv_scales)
        if selected is not None:  # unavailable_reason refuses it with a soft-cap or sinks
            with sdpa_kernel(CUDA_KERNELS) if self.device.type == "cuda" else contextlib.nullcontext():
                return self._sparse(q, k_cache, v_cache, selected, kv_scales)
        if self.device.type != "cuda" or self.variant.softcap is not None or sinks is not None:
            return self._forward(q, k_cache, v_cache, state, sinks, kv_scales)
        with sdpa_kernel(CUDA_KERNELS):
            return self._forward(q, k_cache, v_cache, state, None, kv_scales)

    def prefix_attention(self, q_rows, k, v, q_pos) -> tuple[torch.Tensor, torch.Tensor]:
        """One SDPA call: the group's rows packed per KV head [1, H_kv, R * G, D] over the prefix, with
        its log-sum-exp (aten's LSE-returning kernels; a window, soft-cap or latent values: explicit)."""
        if self.variant.sliding_window is not None or self.variant.softcap is not None or v.shape[-1] != k.shape[-1]:
            return super().prefix_attention(q_rows, k, v, q_pos)
        group = self.num_heads // self.num_kv_heads
        qg = rearrange(q_rows, "r (hk g) d -> 1 hk (r g) d", g=group)
        k, v = (rearrange(x, "p hk d -> 1 hk p d") for x in (k, v))
        if self.device.type == "cuda":
            o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qg, k, v, None, True, scale=self.scale)[:2]
        else:
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg, k, v, 0.0, False, scale=self.scale)
        lse = lse[..., : qg.shape[2]]
        return rearrange(o, "1 hk (r g) d -> r (hk g) d", g=group), rearrange(lse, "1 hk (r g) -> r (hk g)", g=group)

    def _sparse(self, q, k_cache, v_cache, selected, kv_scales) -> torch.Tensor:
        """Each query token a batch row of its own: its G heads per KV head as query rows, over the
        K slots it selected (gathered), the unselected masked."""
        out = q.new_empty(*q.shape[:2], v_cache.shape[-1])
        group = self.num_heads // self.num_kv_heads
        for t0, t1, k, v, seen in read_selected(k_cache, v_cache, selected, kv_scales, q.dtype):
            qi = rearrange(q[t0:t1], "t (hk g) d -> t hk g d", g=group)
            o = F.scaled_dot_product_attention(qi, k, v, seen, scale=self.scale)
            out[t0:t1] = rearrange(o, "t hk g d -> t (hk g) d")
        return out

    def _forward(self, q, k_cache, v_cache, state: list[_Group], sinks=None, kv_scales=None) -> torch.Tensor:
        out = q.new_empty(*q.shape[:2], v_cache.shape[-1])  # [T, H, D_v]
        group = self.num_heads // self.num_kv_heads
        k_scale, v_scale = kv_scales or (None, None)
        for g in state:
            q_pad = q.new_zeros(g.num_seqs * g.max_q, self.num_heads, self.head_dim)
            q_pad[g.q_dest] = q[g.token_start : g.token_end]
            q_pad = rearrange(q_pad, "(n q) (hk g) d -> n hk (q g) d", n=g.num_seqs, g=group)
            # gathered slots [n, max_kv] -> padded K, V [n, H_kv, max_kv, D] (dequantized)
            k = rearrange(read_kv(k_cache, g.kv_slots, k_scale, q.dtype), "n s h d -> n h s d")
            v = rearrange(read_kv(v_cache, g.kv_slots, v_scale, q.dtype), "n s h d -> n h s d")
            if self.variant.softcap is None and sinks is None:
                o = F.scaled_dot_product_attention(q_pad, k, v, g.mask, scale=self.scale)
            else:
                scores = cap_scores((q_pad.float() @ k.float().transpose(-1, -2)) * self.scale, self.variant.softcap)
                row_sinks = None if sinks is None else repeat(sinks, "(hk g) -> hk (q g)", g=group, q=g.max_q)
                probs = softmax_with_sinks(scores.masked_fill(~g.mask, float("-inf")), row_sinks)
                o = (probs @ v.float()).to(q.dtype)
            out[g.token_start : g.token_end] = rearrange(o, "n hk (q g) d -> (n q) (hk g) d", g=group)[g.q_dest]
        return out
