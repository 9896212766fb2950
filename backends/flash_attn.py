"""FlashAttention reading the shared paged cache `[num_blocks, block_size, H_kv, D]` in place
through its block table. Providers, in order of preference:

- `flash_attn_interface` (FlashAttention-3): `flash_attn_with_kvcache(page_table=, cu_seqlens_q=)`
  for every step; any page size.
- `flash_attn` (FlashAttention-2): `flash_attn_varlen_func(block_table=)` for steps with
  prefills, `flash_attn_with_kvcache(block_table=)` for decode-only steps; pages of 256*k tokens.
- PyTorch's bundled FlashAttention-2: `torch.nn.attention.varlen.varlen_attn(seqused_k=,
  block_table=)` where this torch has them; pages of 256*k tokens.
"""
import functools
import inspect
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable

import torch
import torch.nn.functional as F

from pagedbench.backends.base import AttentionBackend, AttentionMetadata

FA2_PAGE_MULTIPLE = 256  # both flash_attn 2.x and torch's copy: "Paged KV cache block size must be divisible by 256"
MAX_HEAD_DIM = 256


@dataclass(frozen=True, slots=True)
class Provider:
    kind: str  # "fa3" | "fa2" | "torch": which call path forward() takes
    label: str  # what provider() reports
    api: Any  # the flash_attn_interface / flash_attn module, or the bound varlen_attn
    page_multiple: int  # block_size must be a multiple of this


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "(version unknown)"


def _missing_params(fn: Callable, *names: str) -> list[str]:
    params = inspect.signature(fn).parameters
    return [n for n in names if n not in params]


def _probe_fa3() -> Provider | str:
    try:
        import flash_attn_interface as fa3
    except ImportError as e:
        return f"flash_attn_interface (FA3): {e}"
    missing = _missing_params(fa3.flash_attn_with_kvcache, "page_table", "cu_seqlens_q", "max_seqlen_q")
    if missing:
        return f"flash_attn_interface (FA3): flash_attn_with_kvcache has no {', '.join(missing)}"
    return Provider("fa3", f"flash_attn_interface (FA3) {_version('flash_attn_3')}", fa3, 1)


def _probe_fa2() -> Provider | str:
    try:
        import flash_attn
    except ImportError as e:
        return f"flash_attn: {e}"
    if _missing_params(flash_attn.flash_attn_varlen_func, "block_table"):  # before 2.5.7
        return f"flash_attn {flash_attn.__version__}: flash_attn_varlen_func has no block_table"
    return Provider("fa2", f"flash_attn {flash_attn.__version__}", flash_attn, FA2_PAGE_MULTIPLE)


def _probe_torch() -> Provider | str:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    missing = _missing_params(varlen_attn, "seqused_k", "block_table", "scale", "window_size", "enable_gqa")
    if missing:
        return f"torch {torch.__version__}'s varlen_attn has no {', '.join(missing)} (no paged KV in this torch)"
    if not _missing_params(varlen_attn, "num_splits"):
        # Split-KV on the paged varlen path writes wrong rows (pytorch/pytorch#194167).
        varlen_attn = functools.partial(varlen_attn, num_splits=1)
    return Provider("torch", f"torch {torch.__version__} varlen_attn", varlen_attn, FA2_PAGE_MULTIPLE)


def find_provider() -> tuple[Provider | None, list[str]]:
    """The first provider that imports and has a paged API, and why each one before it did not."""
    why_not = []
    for probe in (_probe_fa3, _probe_fa2, _probe_torch):
        found = probe()
        if isinstance(found, Provider):
            return found, why_not
        why_not.append(found)
    return None, why_not


@dataclass(slots=True)
class FlashAttnState:
    """Kernel arguments for one step of B sequences, shared by every layer."""

    cu_seqlens_q: torch.Tensor  # [B+1] int32: query_start_loc
    cu_seqlens_k: torch.Tensor  # [B+1] int32: prefix sums of seq_lens (FA2 varlen takes key lengths from it)
    seq_lens: torch.Tensor  # [B] int32: keys per sequence (seqused_k / cache_seqlens)
    block_table: torch.Tensor  # [B, max_blocks] int32, contiguous
    max_query_len: int
    max_seq_len: int
    decode_only: bool  # every sequence has one query token


class FlashAttnBackend(AttentionBackend):
    name = "flash-attn"

    @classmethod
    def unavailable_reason(cls, device, dtype, head_dim, block_size, **kwargs) -> str | None:
        device = torch.device(device)
        if device.type != "cuda":
            return f"no CUDA device (device is {device})"
        if not torch.cuda.is_available():
            return "no CUDA device (torch.cuda.is_available() is False)"
        provider, why_not = find_provider()
        if provider is None:
            return "no FlashAttention provider importable; tried " + "; ".join(why_not)
        if dtype not in (torch.float16, torch.bfloat16):
            return f"dtype {str(dtype).removeprefix('torch.')} unsupported: FlashAttention takes float16 or bfloat16"
        if head_dim > MAX_HEAD_DIM or head_dim % 8:
            return f"head_dim {head_dim} unsupported: FlashAttention needs a multiple of 8 up to {MAX_HEAD_DIM}"
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            return f"compute capability {major}.{minor} unsupported: FlashAttention needs 8.0 (Ampere) or newer"
        if provider.kind == "torch" and not torch.backends.cuda.is_flash_attention_available():
            return f"torch {torch.__version__} was built without its FlashAttention kernels"
        if block_size % provider.page_multiple:
            return (f"block_size {block_size} is not a multiple of {provider.page_multiple}, as the paged "
                    f"FlashAttention-2 kernels of {provider.label} require (FA3 takes any block size)")
        num_heads, num_kv_heads = kwargs.get("num_heads"), kwargs.get("num_kv_heads")
        if num_heads and num_kv_heads and num_heads % num_kv_heads:
            return f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        return None

    @classmethod
    def provider(cls) -> str:
        provider, _ = find_provider()
        return provider.label if provider else "none"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        provider, why_not = find_provider()
        if provider is None:
            raise RuntimeError("no FlashAttention provider importable; tried " + "; ".join(why_not))
        self.impl = provider
        self._attend = {"fa3": self._attend_fa3, "fa2": self._attend_fa2, "torch": self._attend_torch}[provider.kind]

    def prepare(self, meta: AttentionMetadata) -> FlashAttnState:
        seq_lens = meta.seq_lens.to(torch.int32)
        return FlashAttnState(
            cu_seqlens_q=meta.query_start_loc.to(torch.int32),
            cu_seqlens_k=F.pad(seq_lens.cumsum(0, dtype=torch.int32), (1, 0)),
            seq_lens=seq_lens,
            block_table=meta.block_table.to(torch.int32).contiguous(),
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            decode_only=meta.num_prefills == 0,
        )

    def forward(self, q, k_cache, v_cache, state: FlashAttnState) -> torch.Tensor:
        return self._attend(q, k_cache, v_cache, state)

    def _attend_fa3(self, q, k_cache, v_cache, s: FlashAttnState) -> torch.Tensor:
        return self.impl.api.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=s.seq_lens, page_table=s.block_table,
            cu_seqlens_q=s.cu_seqlens_q, max_seqlen_q=s.max_query_len, softmax_scale=self.scale, causal=True)

    def _attend_fa2(self, q, k_cache, v_cache, s: FlashAttnState) -> torch.Tensor:
        if s.decode_only:  # [B, 1, H, D]: the split-KV decode kernel
            return self.impl.api.flash_attn_with_kvcache(
                q.unsqueeze(1), k_cache, v_cache, cache_seqlens=s.seq_lens, block_table=s.block_table,
                softmax_scale=self.scale, causal=True).squeeze(1)
        return self.impl.api.flash_attn_varlen_func(
            q, k_cache, v_cache, s.cu_seqlens_q, s.cu_seqlens_k, s.max_query_len, s.max_seq_len,
            softmax_scale=self.scale, causal=True, block_table=s.block_table)

    def _attend_torch(self, q, k_cache, v_cache, s: FlashAttnState) -> torch.Tensor:
        return self.impl.api(
            q, k_cache, v_cache, s.cu_seqlens_q, s.cu_seqlens_k, s.max_query_len, s.max_seq_len,
            scale=self.scale, window_size=(-1, 0), enable_gqa=self.num_heads != self.num_kv_heads,
            seqused_k=s.seq_lens, block_table=s.block_table)
