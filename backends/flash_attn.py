"""FlashAttention reading the shared paged cache `[num_blocks, block_size, H_kv, D]` in place
through its block table, through the first provider (flash_attn_providers.py: FA3, FA4, FA2 or
torch's varlen) that imports and runs the settings. The step's index tensors live in static
buffers refilled in place, so decode steps replay as CUDA graphs."""

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from pagedbench.backends.base import AttentionBackend, AttentionMetadata
from pagedbench.backends.cascade import CascadeAttention, CascadeState
from pagedbench.backends.flash_attn_providers import (
    accepts,
    latent_reason,
    select_provider,
    sink_param,
    variant_kwargs,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class FlashAttnState:
    """Kernel arguments for one step of B sequences, shared by every layer. The tensors are
    views of the backend's static buffers, refilled in place each step (so a captured CUDA
    graph can replay them)."""

    cu_seqlens_q: torch.Tensor  # [B+1] int32: query_start_loc
    cu_seqlens_k: torch.Tensor  # [B+1] int32: prefix sums of seq_lens (FA2 varlen takes key lengths from it)
    seq_lens: torch.Tensor  # [B] int32: keys per sequence (seqused_k / cache_seqlens)
    block_table: torch.Tensor  # [B, max_blocks] int32, contiguous; entries past a sequence's pages are valid ids
    max_query_len: int
    max_seq_len: int
    decode_only: bool  # every sequence has one query token


class StepBuffers:
    """Static int32 index buffers, grown (never shrunk) to the largest step seen."""

    def __init__(self, device: torch.device):
        self.device = device
        self.rows = self.cols = 0
        self._alloc(1, 1)

    def _alloc(self, rows: int, cols: int) -> None:
        self.rows, self.cols = max(rows, self.rows), max(cols, self.cols)
        self.cu_seqlens_q = torch.zeros(self.rows + 1, dtype=torch.int32, device=self.device)
        self.cu_seqlens_k = torch.zeros(self.rows + 1, dtype=torch.int32, device=self.device)
        self.seq_lens = torch.zeros(self.rows, dtype=torch.int32, device=self.device)
        self.block_table = torch.zeros(self.rows, self.cols, dtype=torch.int32, device=self.device)

    def fill(self, meta: AttentionMetadata) -> FlashAttnState:
        b, cols = meta.num_seqs, meta.block_table.shape[1]
        if b > self.rows or cols > self.cols:
            self._alloc(1 << (b - 1).bit_length(), 1 << (cols - 1).bit_length())
        self.cu_seqlens_q[: b + 1].copy_(meta.query_start_loc)
        self.seq_lens[:b].copy_(meta.seq_lens)
        torch.cumsum(self.seq_lens[:b], 0, out=self.cu_seqlens_k[1 : b + 1])
        table = self.block_table[:b]
        table[:, :cols].copy_(meta.block_table)
        table[:, cols:].zero_()
        return FlashAttnState(
            cu_seqlens_q=self.cu_seqlens_q[: b + 1],
            cu_seqlens_k=self.cu_seqlens_k[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_table=table,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            decode_only=meta.num_prefills == 0,
        )


def fa4_num_splits(capability: tuple[int, int]) -> int:
    """FA4 splits KV only on Blackwell (on Hopper a split asserts); 0 asks for its heuristic,
    which splits when a step has fewer query tiles than the GPU has SMs (small decode batches)."""
    return 0 if capability[0] in (10, 11) else 1


def _fa4_compiled_kernels(api: Any) -> int | None:
    """How many forward kernels FA4 has JIT-compiled so far (its in-memory compile cache), or None
    where this FA4 does not expose it."""
    cache = getattr(getattr(getattr(api, "interface", None), "_flash_attn_fwd", None), "compile_cache", None)
    entries = getattr(cache, "cache", None)
    return len(entries) if isinstance(entries, dict) else None


class FlashAttnBackend(CascadeAttention, AttentionBackend):
    name = "flash-attn"
    # Cascade: the suffixes through the provider's paged call; a group's prefix one more call, its stacked rows as
    # one non-causal sequence over the prefix pages, returning the log-sum-exp (FA2/FA3 return_softmax_lse, FA4's
    # (out, lse)); windows, latent values and torch's varlen: the shared torch path. Not yet run on a GPU.
    cascade_attention = True
    quantized_kv_reason = (
        "no provider here reads quantized pages; FA2 and torch's varlen have no fp8/int8 K/V, FA4's fp8 "
        "runs only on Blackwell, and FA3's fp8 path (fp8 Q/K/V with per-(batch, KV head) descales) is "
        "not wired in yet"
    )
    cuda_graph_reason = None  # plan() refills StepBuffers in place
    batch_invariant_reason = "the provider's num_splits heuristic splits the keys by batch size and length (FA3, FA2)"
    latent_values = True  # FA3's qv path; select_provider gives the other providers' reasons
    sparse_selection_reason = (
        "FA2/FA3/FA4 read pages through a block table, with no per-query token indices "
        "(FlashMLA's sparse kernels would, and have no wheel: docs/sparse-attention.md)"
    )

    @classmethod
    def unavailable_reason(cls, device, dtype, head_dim, block_size, **kwargs) -> str | None:
        return select_provider(device, dtype, head_dim, block_size, **kwargs)[1]

    @classmethod
    def compiles_on_first_use(cls, device) -> bool:
        return True  # FA4 (CuTe DSL) compiles each new shape on first use

    @classmethod
    def provider(cls, **settings) -> str:
        found = select_provider(**settings)[0] if settings else None
        found = found or select_provider()[0]  # none runs these settings: name the first that imports
        if found is None:
            return "none"
        latent = settings.get("value_dim") not in (None, settings.get("head_dim"))
        return f"{found.label}, latent absorbed through qv" if latent and found.kind == "fa3" else found.label

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        found, reason = select_provider(
            self.device,
            self.dtype,
            self.head_dim,
            self.block_size,
            self.num_heads,
            self.num_kv_heads,
            **self.variant.settings(),
        )
        if found is None and self.device.type != "cuda":  # CPU: fakes in tests; the kernels need CUDA
            found = select_provider()[0]
            latent = self.variant.value_dim not in (None, self.head_dim)
            if found is not None and latent:
                reason = latent_reason(found, (9, 0), self.head_dim, **self.variant.settings())
                found = None if reason else found
        if found is None:
            raise ValueError(f"flash-attn cannot run here: {reason}")
        self.impl = found
        self.buffers = StepBuffers(self.device)
        self._attend = {
            "fa3": self._attend_fa3,
            "fa4": self._attend_fa4,
            "fa2": self._attend_fa2,
            "torch": self._attend_torch,
        }[found.kind]
        capability = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else (9, 0)
        self.fa4_num_splits = fa4_num_splits(capability)
        self._fa4_announced = False
        # max_seqlen_k only where the installed FA4 names it (it sizes the split-KV scheduling).
        self._fa4_max_seqlen_k = found.kind == "fa4" and accepts(self.impl.api.flash_attn_varlen_func, "max_seqlen_k")
        self._variant = variant_kwargs(found, self.variant.sliding_window, self.variant.softcap)
        self._sink_param = sink_param(found)

    def plan(self, meta: AttentionMetadata) -> FlashAttnState | CascadeState:
        if meta.cascade is not None:
            return self.plan_cascade_step(meta, self.buffers.fill)
        return self.buffers.fill(meta)

    def forward(self, q, k_cache, v_cache, state, sinks=None) -> torch.Tensor:
        if isinstance(state, CascadeState):
            flat = lambda q, flat_state: self.forward(q, k_cache, v_cache, flat_state, sinks)
            return self.cascade_forward(q, k_cache, v_cache, state, flat, sinks)
        if sinks is None:
            return self._attend(q, k_cache, v_cache, state, **self._variant)
        if self._sink_param is None:
            raise ValueError(f"flash_attn: {self.impl.label} takes no attention sinks")
        # FA4 asserts learnable_sink is bf16, whatever q's dtype.
        sinks = sinks.to(torch.bfloat16) if self._sink_param == "learnable_sink" else sinks
        return self._attend(q, k_cache, v_cache, state, **self._variant, **{self._sink_param: sinks})

    def prefix_pass(self, q, k_cache, v_cache, g, kv_scales) -> tuple[torch.Tensor, torch.Tensor]:
        """Cascade's prefix pass: the group's rows as one sequence of R queries, not causal (every prefix key
        precedes them), over a one-row page table of the prefix; (out [R, H, D], lse [R, H])."""
        kind = self.impl.kind
        if self.variant.sliding_window is not None or self.variant.value_dim is not None or kind == "torch":
            return super().prefix_pass(q, k_cache, v_cache, g, kv_scales)
        rows = q.index_select(0, g.rows)
        num_rows = rows.shape[0]
        used = torch.full((1,), g.prefix_len, dtype=torch.int32, device=q.device)
        table = g.prefix_pages[None]
        variant = {name: value for name, value in self._variant.items() if name != "window_size"}
        if kind == "fa4":
            cu_q = torch.tensor([0, num_rows], dtype=torch.int32, device=q.device)
            out, lse = self.impl.api.flash_attn_varlen_func(
                rows, k_cache, v_cache, cu_seqlens_q=cu_q, max_seqlen_q=num_rows, seqused_k=used, page_table=table,
                softmax_scale=self.scale, causal=False, **variant,
            )[:2]  # fmt: skip
        else:  # FA3 and FA2: the kv-cache entry point, batch 1
            pages = {"page_table" if kind == "fa3" else "block_table": table}
            out, lse = self.impl.api.flash_attn_with_kvcache(
                rows[None], k_cache, v_cache, cache_seqlens=used, softmax_scale=self.scale, causal=False,
                return_softmax_lse=True, **pages, **variant,
            )[:2]  # fmt: skip
        return out.reshape(num_rows, self.num_heads, -1), _lse_by_row(lse, num_rows, self.num_heads)

    def _attend_fa3(self, q, k_cache, v_cache, s: FlashAttnState, **variant) -> torch.Tensor:
        latent = self.variant.value_dim
        if latent is not None and latent != self.head_dim:  # one plane [.., latent | rope]: two views of it
            variant["qv"], q = q[..., :latent], q[..., latent:]
            k_cache, v_cache = k_cache[..., latent:], k_cache[..., :latent]
        return self.impl.api.flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            cache_seqlens=s.seq_lens,
            page_table=s.block_table,
            cu_seqlens_q=s.cu_seqlens_q,
            max_seqlen_q=s.max_query_len,
            softmax_scale=self.scale,
            causal=True,
            **variant,
        )

    def _attend_fa4(self, q, k_cache, v_cache, s: FlashAttnState, **variant) -> torch.Tensor:
        # page_table excludes cu_seqlens_k; key lengths come from seqused_k. Whole pages are loaded,
        # so rows past seqused_k must be finite: the model runner's cache starts zeroed.
        before = _fa4_compiled_kernels(self.impl.api)
        if not self._fa4_announced and before is not None:
            logger.info(
                "flash-attn (FA4): each new kernel shape JIT-compiles on first use (seconds each); "
                "warmup runs absorb it"
            )
            self._fa4_announced = True
        start = time.perf_counter()
        result = self.impl.api.flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=s.cu_seqlens_q,
            max_seqlen_q=s.max_query_len,
            seqused_k=s.seq_lens,
            page_table=s.block_table,
            softmax_scale=self.scale,
            causal=True,
            num_splits=self.fa4_num_splits,
            **({"max_seqlen_k": s.max_seq_len} if self._fa4_max_seqlen_k else {}),
            **variant,
        )
        if before is not None and _fa4_compiled_kernels(self.impl.api) != before:
            seconds = time.perf_counter() - start
            self.compile_seconds += seconds
            logger.info("flash-attn (FA4): JIT-compiled a kernel in %.1f s", seconds)
        return result[0] if isinstance(result, tuple) else result  # (out, lse)

    def _attend_fa2(self, q, k_cache, v_cache, s: FlashAttnState, **variant) -> torch.Tensor:
        if s.decode_only:  # [B, 1, H, D]: the split-KV decode kernel
            return self.impl.api.flash_attn_with_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=s.seq_lens,
                block_table=s.block_table,
                softmax_scale=self.scale,
                causal=True,
                **variant,
            ).squeeze(1)
        return self.impl.api.flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            s.cu_seqlens_q,
            s.cu_seqlens_k,
            s.max_query_len,
            s.max_seq_len,
            softmax_scale=self.scale,
            causal=True,
            block_table=s.block_table,
            **variant,
        )

    def _attend_torch(self, q, k_cache, v_cache, s: FlashAttnState, **variant) -> torch.Tensor:
        return self.impl.api(
            q,
            k_cache,
            v_cache,
            s.cu_seqlens_q,
            s.cu_seqlens_k,
            s.max_query_len,
            s.max_seq_len,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
            seqused_k=s.seq_lens,
            block_table=s.block_table,
            **variant,
        )


def _lse_by_row(lse: torch.Tensor, num_rows: int, num_heads: int) -> torch.Tensor:
    """A provider's log-sum-exp, heads before rows ([1, H, R]: FA2/FA3's batch 1; [H, R]: FA4's varlen), as [R, H]."""
    return lse.reshape(num_heads, num_rows).t().float()
