"""The flash-attn backend's providers: which FlashAttention build imports, what its signature
and the GPU allow, and which one runs given settings. Tried in this order (the first one that
imports and runs these settings wins; `PAGEDBENCH_FLASH_PROVIDER=fa3|fa4|fa2|torch` forces one):

- `fa3`: `flash_attn_interface` (FlashAttention-3, hopper/ build):
  `flash_attn_with_kvcache(page_table=, cu_seqlens_q=)` for every step; any page size. The only
  provider with latent attention (MLA, absorbed, as vLLM's FLASH_ATTN_MLA): `qv=` takes the
  queries' latent dims, so scores are q_rope.k_rope + q_latent.latent over the one cached plane
  (k_cache its rope dims, v_cache its latent dims); Hopper, 16-bit, rope <= 64 and latent 256..512.
- `fa4`: `flash_attn.cute` (FlashAttention-4, `flash-attn-4`, CuTe DSL, JIT-compiled):
  `flash_attn_varlen_func(page_table=, seqused_k=, cu_seqlens_q=)` for every step; any page
  size; paged KV on SM 9.x (Hopper) and 10.x/11.x (Blackwell) only; split-KV only on Blackwell.
- `fa2`: `flash_attn` (FlashAttention-2): `flash_attn_varlen_func(block_table=)` for steps with
  prefills, `flash_attn_with_kvcache(block_table=)` for decode-only steps; pages of 256*k tokens.
- `torch`: PyTorch's bundled FlashAttention-2, `torch.nn.attention.varlen.varlen_attn(seqused_k=,
  block_table=)` where this torch has them (2.12+); pages of 256*k tokens.

FA4 installs `flash_attn/cute/` without `flash_attn/__init__.py`, so `import flash_attn` can
succeed as an empty namespace package: probes look for attributes, and catch everything.
"""

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import torch
from pagedbench.backends.base import import_or_reason, one_line

from pagedbench import envs

PROVIDER_ENV = "PAGEDBENCH_FLASH_PROVIDER"
PROVIDER_ORDER = ("fa3", "fa4", "fa2", "torch")
FA2_PAGE_MULTIPLE = 256  # both flash_attn 2.x and torch's copy: "Paged KV cache block size must be divisible by 256"
MAX_HEAD_DIM = 256
INSTALL_HINT = {"fa4": " (pip install 'pagedbench[fa4]')", "fa2": " (pip install 'pagedbench[flash-attn]')"}


@dataclass(frozen=True, slots=True)
class Provider:
    kind: str  # one of PROVIDER_ORDER: which call path forward() takes
    label: str  # what provider() reports
    api: Any  # the flash_attn_interface / flash_attn.cute / flash_attn module, or the bound varlen_attn


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except Exception:
        return "(version unknown)"


def _missing_params(fn: Callable, *names: str) -> list[str]:
    params = inspect.signature(fn).parameters
    return [n for n in names if n not in params]


def _paged_api(module: Any, where: str, fn_name: str, *params: str) -> str | None:
    """Why `module.fn_name` cannot serve paged attention (absent, or lacks `params`), or None."""
    fn = getattr(module, fn_name, None)
    if fn is None:
        return f"{where} has no {fn_name}"
    missing = _missing_params(fn, *params)
    return f"{where}: {fn_name} has no {', '.join(missing)}" if missing else None


def _probe_fa3() -> Provider | str:
    fa3 = import_or_reason("flash_attn_interface")
    if isinstance(fa3, str):
        return fa3
    reason = _paged_api(
        fa3, "flash_attn_interface", "flash_attn_with_kvcache", "page_table", "cu_seqlens_q", "max_seqlen_q"
    )
    return reason or Provider("fa3", f"flash_attn_interface (FA3) {_version('flash_attn_3')}", fa3)


def _probe_fa4() -> Provider | str:
    fa4 = import_or_reason("flash_attn.cute")
    if isinstance(fa4, str):
        return fa4.replace("flash_attn not installed", "flash_attn.cute not installed") + INSTALL_HINT[
            "fa4"
        ] * fa4.endswith("not installed")
    paged = ("page_table", "seqused_k", "cu_seqlens_q", "max_seqlen_q", "num_splits")
    reason = _paged_api(fa4, "flash_attn.cute", "flash_attn_varlen_func", *paged)
    return reason or Provider("fa4", f"flash_attn.cute (FA4) {_version('flash-attn-4')}", fa4)


def _probe_fa2() -> Provider | str:
    fa2 = import_or_reason("flash_attn")
    if isinstance(fa2, str):
        return fa2 + INSTALL_HINT["fa2"] * fa2.endswith("not installed")
    if getattr(fa2, "__file__", None) is None and not hasattr(fa2, "flash_attn_varlen_func"):
        return "flash_attn is an empty namespace package (FA4's flash_attn/cute/ without FlashAttention-2)"
    version = getattr(fa2, "__version__", _version("flash_attn"))
    where = f"flash_attn {version}"
    reason = _paged_api(fa2, where, "flash_attn_varlen_func", "block_table") or _paged_api(  # block_table: 2.5.7+
        fa2, where, "flash_attn_with_kvcache", "block_table"
    )
    return reason or Provider("fa2", where, fa2)


def _probe_torch() -> Provider | str:
    varlen = import_or_reason("torch.nn.attention.varlen")
    if isinstance(varlen, str):
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    varlen_attn = getattr(varlen, "varlen_attn", None)
    if varlen_attn is None:
        return f"torch {torch.__version__} has no varlen_attn"
    missing = _missing_params(varlen_attn, "seqused_k", "block_table", "scale", "window_size", "enable_gqa")
    if missing:
        return f"torch {torch.__version__}'s varlen_attn has no {', '.join(missing)} (no paged KV in this torch)"
    if not _missing_params(varlen_attn, "num_splits"):
        # Split-KV on the paged varlen path writes wrong rows (pytorch/pytorch#194167).
        varlen_attn = functools.partial(varlen_attn, num_splits=1)
    return Provider("torch", f"torch {torch.__version__} varlen_attn", varlen_attn)


PROBES = {"fa3": _probe_fa3, "fa4": _probe_fa4, "fa2": _probe_fa2, "torch": _probe_torch}


def probe(kind: str) -> Provider | str:
    """The provider if it imports with a paged API, else a one-line reason; never raises."""
    try:
        return PROBES[kind]()
    except Exception as e:
        return f"probing failed: {one_line(e)}"


def candidate_kinds() -> tuple[str, ...]:
    """PROVIDER_ORDER, or the one provider PAGEDBENCH_FLASH_PROVIDER forces."""
    forced = envs.get(PROVIDER_ENV)
    return (forced,) if forced else PROVIDER_ORDER


def _head_dim_reason(head_dim: int, low: int, high: int, also: tuple[int, ...] = ()) -> str | None:
    if (low <= head_dim <= high or head_dim in also) and head_dim % 8 == 0:
        return None
    extra = "".join(f" or {d}" for d in also)
    return f"head_dim {head_dim} unsupported: needs a multiple of 8 in {low}..{high}{extra}"


def provider_reason(kind: str, capability: tuple[int, int], block_size: int, head_dim: int) -> str | None:
    """Why provider `kind` cannot run these settings on a GPU of this compute capability."""
    major, minor = capability
    if kind == "fa4":
        if major not in (9, 10, 11):
            return (
                f"compute capability {major}.{minor}: FA4 has paged KV only on 9.x (Hopper) and 10.x/11.x (Blackwell)"
            )
        # FA4's _validate_head_dims: SM90 8..256; SM100/110 8..128, or 256.
        return _head_dim_reason(head_dim, 8, 256) if major == 9 else _head_dim_reason(head_dim, 8, 128, also=(256,))
    if major < 8:
        return f"compute capability {major}.{minor} unsupported: FlashAttention needs 8.0 (Ampere) or newer"
    if kind == "torch" and not torch.backends.cuda.is_flash_attention_available():
        return f"torch {torch.__version__} was built without its FlashAttention kernels"
    if kind in ("fa2", "torch") and block_size % FA2_PAGE_MULTIPLE:
        return f"block_size {block_size} is not a multiple of {FA2_PAGE_MULTIPLE} (FlashAttention-2's paged kernels)"
    return _head_dim_reason(head_dim, 8, MAX_HEAD_DIM)


def _machine_reason(
    device: torch.device, dtype: torch.dtype, num_heads: int | None, num_kv_heads: int | None
) -> str | None:
    """What rules out every provider."""
    if device.type != "cuda":
        return f"no CUDA device (device is {device})"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {str(dtype).removeprefix('torch.')} unsupported: FlashAttention takes float16 or bfloat16"
    if num_heads and num_kv_heads and num_heads % num_kv_heads:
        return f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    return None


# The function each provider's paged calls go through, and the names its variant keywords take.
ENTRY_POINT = {"fa3": "flash_attn_with_kvcache", "fa4": "flash_attn_varlen_func", "fa2": "flash_attn_varlen_func"}
SINK_PARAMS = ("learnable_sink", "s_aux")  # FA4's; vLLM's FA3 fork's


def _entry(found: Provider) -> Callable:
    return found.api if found.kind == "torch" else getattr(found.api, ENTRY_POINT[found.kind])


def sink_param(found: Provider) -> str | None:
    """The keyword this provider takes sinks [H] by, or None when it has none."""
    return next((name for name in SINK_PARAMS if _accepts_named(_entry(found), name)), None)


def variant_reason(found: Provider, sliding_window=None, softcap=None, sinks=False) -> str | None:
    """Why this provider cannot compute the variant (its API lacks the keyword), or None."""
    fn = _entry(found)
    if sliding_window is not None and not _accepts_named(fn, "window_size"):
        return f"{found.label} takes no window_size"
    if softcap is not None and not _accepts_named(fn, "softcap"):
        return f"{found.label} takes no softcap"
    if sinks and sink_param(found) is None:
        return f"{found.label} takes no attention sinks ({' / '.join(SINK_PARAMS)})"
    return None


def variant_kwargs(found: Provider, sliding_window=None, softcap=None) -> dict:
    """The window and soft-cap keywords of every call (none for plain attention). The torch
    provider always passes window_size: causal is (-1, 0) there."""
    kwargs = {}
    if sliding_window is not None or found.kind == "torch":
        kwargs["window_size"] = (-1 if sliding_window is None else sliding_window - 1, 0)
    if softcap is not None:
        kwargs["softcap"] = softcap
    return kwargs


FA3_QV_ROPE_MAX, FA3_QV_LATENT = 64, (256, 512)  # hopper/flash_api.cpp's checks on q_v


def latent_reason(
    found: Provider, capability: tuple[int, int], head_dim: int, value_dim: int, sliding_window, softcap, sinks, **_
) -> str | None:
    """Why this provider cannot run absorbed latent attention over `head_dim` = latent
    `value_dim` + rope dims, or None (FA3's qv path only)."""
    if found.kind != "fa3" or not _accepts_named(_entry(found), "qv"):
        return f"latent attention: {found.label} takes no qv (FA3's MLA path, Hopper)"
    if capability[0] != 9:
        return f"latent attention on compute capability {capability[0]}.{capability[1]}: FA3's qv runs on Hopper only"
    rope, (low, high) = head_dim - value_dim, FA3_QV_LATENT
    if not (0 < rope <= FA3_QV_ROPE_MAX and low <= value_dim <= high and value_dim % 8 == 0 and rope % 8 == 0):
        return f"latent attention {value_dim} + {rope}: FA3's qv takes rope dims <= 64 and latent dims {low}..{high}"
    if sliding_window is not None or softcap is not None or sinks:
        return "latent attention with a window, soft-cap or sinks: not wired for FA3's qv path"
    return None


def select_provider(
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    block_size: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: bool = False,
    value_dim: int | None = None,
    **_,
) -> tuple[Provider | None, str | None]:
    """(the first candidate provider that imports and runs these settings, None), or (None, why
    not, naming each provider tried). Without settings: the first one that imports."""
    try:
        kinds = candidate_kinds()
    except ValueError as e:
        return None, str(e)
    machine = None
    if device is not None:
        device = torch.device(device)
        machine = _machine_reason(device, dtype, num_heads, num_kv_heads)
    why_not = []
    for kind in kinds:
        found = probe(kind)
        if isinstance(found, str):
            why_not.append(f"{kind}: {found}")
        elif machine is not None:
            why_not.append(f"{kind}: {found.label} importable")
        elif device is None:
            return found, None
        else:
            capability = torch.cuda.get_device_capability(device)
            if value_dim is not None and value_dim != head_dim:
                reason = latent_reason(found, capability, head_dim, value_dim, sliding_window, softcap, sinks)
            else:
                reason = provider_reason(kind, capability, block_size, head_dim)
                reason = reason or variant_reason(found, sliding_window, softcap, sinks)
            if reason is None:
                return found, None
            why_not.append(f"{kind}: {found.label}: {reason}")
    tried = "; ".join(why_not)
    if len(kinds) == 1:
        tried = f"{PROVIDER_ENV} forces {tried}"
    return None, f"{machine or 'no FlashAttention provider runs these settings'}; {tried}"


def _accepts_named(fn: Callable, name: str) -> bool:
    """Whether `fn` names keyword `name` (a **kwargs catch-all does not count: it may drop it)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def accepts(fn: Callable, name: str) -> bool:
    """Whether `fn` takes keyword `name` (by name or through **kwargs); True when it cannot be told."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
