"""The backend contract: per-step metadata shared by all layers, what a layer's attention
computes (its variant), and the backend interface.

KV cache layout (one for every backend): per layer K and V `[num_blocks, block_size, H_kv, D]`.
Slot `s` is token `s % block_size` of block `s // block_size`.
"""

import logging
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from importlib import import_module
from typing import Any, ClassVar

import torch

from pagedbench.config import KV_CACHE_DTYPE_NAMES

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AttentionVariant:
    """What a layer's attention computes beyond causal softmax(scale * q k^T) v. Layers with the
    same variant share one backend instance and its per-step state.

    sliding_window: a query at position p sees keys p - sliding_window + 1 .. p (Hugging Face's and
      Mistral's convention; flash-attn's window_size is (sliding_window - 1, 0)); None: all keys.
    softcap: scores become softcap * tanh(scores / softcap) after scaling (Gemma 2); None: no cap.
    sinks: the layer has a learned logit per query head in the softmax denominator (gpt-oss);
      its values [H] fp32 come with each forward() call.
    value_dim: latent attention (DeepSeek's MLA, absorbed): the values are the first value_dim dims
      of each key (v_cache is a view of k_cache's pages) and the output is [T, H, value_dim];
      None: V has pages of its own, of the keys' head_dim.
    topk: sparse attention (DeepSeek-V3.2's DSA): each query reads only the cache slots an indexer
      selected for it, at most topk of its causal past (forward's `selected`); None: every token.
    """

    sliding_window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    value_dim: int | None = None
    topk: int | None = None

    def __post_init__(self):
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be an integer >= 1 or None, got {self.sliding_window!r}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be > 0 or None, got {self.softcap!r}")
        if self.value_dim is not None and (isinstance(self.value_dim, bool) or self.value_dim < 1):
            raise ValueError(f"value_dim must be an integer >= 1 or None, got {self.value_dim!r}")
        if self.topk is not None and (isinstance(self.topk, bool) or self.topk < 1):
            raise ValueError(f"topk must be an integer >= 1 or None, got {self.topk!r}")
        if self.topk is not None and self.sliding_window is not None:
            raise ValueError("top-k sparse attention with a sliding window is not supported")

    def settings(self) -> dict:
        """As keyword arguments of `unavailable_reason` and `provider`."""
        return asdict(self)

    def __str__(self) -> str:
        parts = []
        if self.sliding_window is not None:
            parts.append(f"window {self.sliding_window}")
        if self.softcap is not None:
            parts.append(f"soft-cap {self.softcap:g}")
        if self.sinks:
            parts.append("sinks")
        if self.value_dim is not None:
            parts.append(f"latent values {self.value_dim}")
        if self.topk is not None:
            parts.append(f"top-{self.topk} sparse")
        return ", ".join(parts) or "plain"


PLAIN = AttentionVariant()


def visible(q_pos: torch.Tensor, kv_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """True where a query at q_pos sees the key at kv_pos (broadcast): causal, within the window."""
    seen = kv_pos <= q_pos
    return seen if sliding_window is None else seen & (q_pos - kv_pos < sliding_window)


def cap_scores(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of scores [..., H, q, S]; with sinks [H] (or [H, q]: one per
    query row), each row's sink logit joins the denominator (a column that is then dropped)."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.to(scores.dtype)
    sink = (sink[:, None] if sink.dim() == 1 else sink)[..., None].expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the model runner; every layer's backend call shares it.

    B sequences, T query tokens in one flat batch; sequence i's queries are
    `query_start_loc[i]:query_start_loc[i+1]`, decodes (one query token) first.
    """

    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32: tokens in the cache after this step's write
    context_lens: torch.Tensor  # [B] int32: tokens in the cache before this step
    block_table: torch.Tensor  # [B, max_blocks] int32, entries past a sequence's blocks are 0
    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V goes to
    positions: torch.Tensor  # [T] int64: position of each query token in its sequence
    token_seq_idx: torch.Tensor  # [T] int32: which sequence each query token belongs to
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # sequences with one query token; they come first
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    block_size: int
    num_cache_blocks: int  # blocks in each layer's KV cache: its length as one sequence is this * block_size
    # Host copies, so backends can size things without a device sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    context_lens_cpu: list[int]
    # Cascade attention (backends/cascade.py): the step's groups sharing leading pages, or None: flat.
    cascade: "CascadePlan | None" = None  # noqa: F821 (cascade.py imports this module)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]


def one_line(error: BaseException) -> str:
    """`Type: first line of the message`, for reasons shown in tables and CLI errors; where the message
    is a wrapped traceback (inductor's "An exception occurred in a subprocess:"), its last line too,
    which names the cause."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    cause = f" ... {lines[-1]}" if len(lines) > 1 and lines[0].endswith(":") else ""
    return f"{type(error).__name__}: {lines[0]}{cause}"


def import_or_reason(name: str, install_hint: str | None = None) -> Any:
    """The module, or a one-line reason: absent (and how to install it), or broken."""
    try:
        return import_module(name)
    except ModuleNotFoundError as e:
        if e.name not in (name, name.split(".")[0]):  # the module is there; something it imports is not
            return f"import {name}: {one_line(e)}"
        return f"{e.name} not installed" + (f" ({install_hint})" if install_hint else "")
    except Exception as e:  # a broken install raises anything at import time
        return f"import {name}: {one_line(e)}"


# kv_cache_dtype (vLLM's names) -> how K/V pages are stored: None keeps the model's dtype. fp8 pages
# carry one scale per layer for K and one for V (1.0 unless calibrated, as in vLLM); int8 pages one
# per (token, KV head), its absolute maximum / 127 in fp16, since int8 has no exponent to absorb outliers.
_STORAGE = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
KV_CACHE_DTYPES = {name: _STORAGE.get(name) for name in KV_CACHE_DTYPE_NAMES}  # "auto": None
QUANTIZED_KV = tuple(name for name, storage in KV_CACHE_DTYPES.items() if storage is not None)


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def per_token_scales(storage: torch.dtype) -> bool:
    """Whether pages of this storage dtype keep a scale per (token, KV head) (int8) rather than per layer."""
    return storage == torch.int8


def kv_scale_layout(storage: torch.dtype, pages: tuple[int, ...]) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of one layer's K (or V) scales for pages [num_pages, page_size, H_kv, D]
    stored as `storage`: one fp16 per slot and head (int8), or one fp32 for the layer (fp8)."""
    return (tuple(pages[:3]), torch.float16) if per_token_scales(storage) else ((1, 1, 1), torch.float32)


def scale_bytes_per_slot(storage: torch.dtype) -> int:
    """Bytes of scale each stored slot and KV head carries: int8's fp16, none for a per-layer scale."""
    return kv_scale_layout(storage, ())[1].itemsize if per_token_scales(storage) else 0


def _quantize(x: torch.Tensor, storage: torch.dtype, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] -> (stored values, the scale per (token, head) [T, H] for int8, else `scale`)."""
    if per_token_scales(storage):
        token_scale = (x.abs().amax(dim=-1).float().clamp(min=1e-4) / 127).half().float()  # stored as fp16
        return (x.float() / token_scale[..., None]).round().clamp(-127, 127).to(storage), token_scale
    limit = torch.finfo(storage).max
    return (x.float() / scale).clamp(-limit, limit).to(storage), scale


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Store k, v [T, H_kv, D] at `slot_mapping` [T] in the paged caches (shared by all backends),
    quantized when the cache is (kv_scales: per-layer [1] for fp8, per-slot [pages, page, H_kv] for int8).
    v None: latent attention, whose values are a view of the key pages (written with them)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    planes = [(k, k_cache)] if v is None else [(k, k_cache), (v, v_cache)]
    if kv_scales is None:
        for x, cache in planes:
            cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, x)
        return
    for (x, cache), scale in zip(planes, kv_scales):
        stored, token_scale = _quantize(x, cache.dtype, scale)
        # Byte views: index_copy_ has no fp8 kernel on CPU.
        cache.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, stored.view(torch.uint8))
        if per_token_scales(cache.dtype):
            scale.view(-1, num_kv_heads).index_copy_(0, slot_mapping, token_scale.to(scale.dtype))


def read_kv(cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The K or V rows at cache `slots` (any shape) -> [*slots.shape, H_kv, D] in `dtype`,
    dequantized when `scale` is given (a gather-based backend's read)."""
    num_kv_heads, head_dim = cache.shape[-2], cache.shape[-1]
    rows = cache.view(-1, num_kv_heads, head_dim)[slots]
    if scale is None:
        return rows.to(dtype)
    if per_token_scales(cache.dtype):
        scale = scale.view(-1, num_kv_heads)[slots][..., None]
    return (rows.float() * scale.float()).to(dtype)


SELECTED_ELEMENTS = 1 << 26  # gathered K numbers per sparse chunk (256 MiB in fp32)


def read_selected(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    selected: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
    dtype: torch.dtype,
    tokens_multiple: int = 1,
):
    """Sparse attention's gather, in chunks of query tokens: yields (t0, t1, k [t, H_kv, K, D],
    v [t, H_kv, K, D_v], seen [t, 1, 1, K]) for the slots `selected` [T, K] lists (-1: none) — each
    query's own keys, in `dtype`, dequantized where the pages are. Chunks hold a multiple of
    `tokens_multiple` tokens (the last one too, where T is one)."""
    num_tokens, topk = selected.shape
    k_scale, v_scale = kv_scales or (None, None)
    rows = max(1, SELECTED_ELEMENTS // (topk * k_cache.shape[-2] * k_cache.shape[-1]))
    rows = max(tokens_multiple, rows // tokens_multiple * tokens_multiple)
    latent = v_cache.data_ptr() == k_cache.data_ptr()  # values a view of the keys' first dims: gathered once
    for t0 in range(0, num_tokens, rows):
        chunk = selected[t0 : t0 + rows]
        slots = chunk.clamp(min=0)
        k = read_kv(k_cache, slots, k_scale, dtype).transpose(1, 2)  # [t, K, H_kv, D] -> [t, H_kv, K, D]
        v = k[..., : v_cache.shape[-1]] if latent else read_kv(v_cache, slots, v_scale, dtype).transpose(1, 2)
        yield t0, t0 + chunk.shape[0], k, v, (chunk >= 0)[:, None, None, :]


def gather_kv_slots(meta: AttentionMetadata, seq_start: int, seq_end: int, max_len: int) -> torch.Tensor:
    """Cache slots [n, max_len] of the first `max_len` tokens of sequences seq_start..seq_end-1;
    positions past a sequence's length point at a valid slot and must be masked."""
    pos = torch.arange(max_len, device=meta.block_table.device)
    table = meta.block_table[seq_start:seq_end, : -(-max_len // meta.block_size)].long()
    return table[:, pos // meta.block_size] * meta.block_size + pos % meta.block_size


class AttentionBackend(ABC):
    """A paged-attention implementation. Subclasses set `name`, say what they cannot run
    in `unavailable_reason`, plan each step (its per-step state) in `plan` and attend in `forward`."""

    name: ClassVar[str]
    # Why a decode step cannot be captured in a CUDA graph, or None when plan() refills static
    # buffers in place and forward() has no host work, so a graph can replay it.
    cuda_graph_reason: ClassVar[str | None] = "plan() builds new tensors sized by each step"
    # Why a sequence's output may change, bitwise, with the batch around it or where its pages lie (a
    # split or a padded length chosen from the batch), or None when it never does: batch-invariant
    # (`check --determinism` fails a backend that claims it and is not).
    batch_invariant_reason: ClassVar[str | None] = "not stated by the backend"
    # Whether the backend has a batch-invariant form, built with batch_invariant=True (EngineConfig's).
    batch_invariant_form: ClassVar[bool] = False
    # Decode graphs only at power-of-two batch sizes of at least 2 (what the kernel compiles for).
    cuda_graph_powers_of_two: ClassVar[bool] = False
    # kv_cache_dtype values beyond "auto" that forward() reads (given kv_scales), and why not the others.
    quantized_kv: ClassVar[tuple[str, ...]] = ()
    quantized_kv_reason: ClassVar[str] = "reads K/V pages in the model's dtype only"
    # Whether forward() takes latent attention's values as a view of the key pages (AttentionVariant.value_dim).
    latent_values: ClassVar[bool] = False
    latent_values_reason: ClassVar[str] = "not implemented: values are read from V pages of the keys' head_dim"
    # Whether forward() reads only the cache slots a sparse indexer selected per query (AttentionVariant.topk).
    sparse_selection: ClassVar[bool] = False
    sparse_selection_reason: ClassVar[str] = "not implemented: it reads every page of a sequence"
    # Whether plan()/forward() take a cascade plan (AttentionMetadata.cascade: shared prefixes read once
    # per group), and why not; a backend without it is refused under cascade_attention=True.
    cascade_attention: ClassVar[bool] = False
    cascade_attention_reason: ClassVar[str] = "not implemented: each sequence reads its shared prefix itself"
    # Why the default heuristic (cascade_attention=None) leaves a backend that has the path flat: where it was
    # measured slower end to end (None: the heuristic applies).
    cascade_not_by_default: ClassVar[str | None] = None

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        variant: AttentionVariant = PLAIN,
        batch_invariant: bool = False,
    ):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.variant = variant
        self.batch_invariant = batch_invariant  # EngineConfig.batch_invariant (accepted where batch_invariance says)
        self.compile_seconds = 0.0  # JIT compilation inside forward() so far (a backend that knows adds it)

    @classmethod
    def unavailable_reason(
        cls, device: torch.device | str, dtype: torch.dtype, head_dim: int, block_size: int, **kwargs
    ) -> str | None:
        """Why this backend cannot run with these settings, or None when it can. `kwargs` may hold
        num_heads, num_kv_heads and an AttentionVariant's settings (sliding_window, softcap, sinks);
        a backend that implements no variant inherits `plain_only`'s answer."""
        return cls.plain_only(**kwargs)

    @classmethod
    def batch_invariance(cls, device: torch.device | str, batch_invariant: bool = False, **settings) -> str | None:
        """Why a sequence's output may change, bitwise, with its batch or its pages under these settings
        (`unavailable_reason`'s), or None: batch-invariant. With `batch_invariant` (the engine setting,
        passed to the constructor too) a backend that has a batch-invariant form answers for it; the engine
        refuses a backend that still gives a reason. By default the class's `batch_invariant_reason`, or
        None under `batch_invariant` where it has a `batch_invariant_form`."""
        return None if batch_invariant and cls.batch_invariant_form else cls.batch_invariant_reason

    @classmethod
    def kv_cache_reason(cls, kv_cache_dtype: str = "auto", **_) -> str | None:
        """Why this backend cannot read pages stored as `kv_cache_dtype`, or None."""
        if kv_cache_dtype == "auto" or kv_cache_dtype in cls.quantized_kv:
            return None
        return f"kv_cache_dtype {kv_cache_dtype}: {cls.quantized_kv_reason}"

    @classmethod
    def latent_reason(cls, value_dim: int | None = None, **_) -> str | None:
        """Why this backend cannot run latent attention (values inside the key pages), or None."""
        if value_dim is None or cls.latent_values:
            return None
        return f"latent attention (MLA, values the keys' first {value_dim} dims): {cls.latent_values_reason}"

    @classmethod
    def sparse_reason(cls, topk: int | None = None, **_) -> str | None:
        """Why this backend cannot run top-k sparse attention (DeepSeek-V3.2's selected slots), or None."""
        if topk is None or cls.sparse_selection:
            return None
        return f"top-{topk} sparse attention (slots selected per query): {cls.sparse_selection_reason}"

    @classmethod
    def cascade_reason(cls, cascade_attention: bool | None = None, **_) -> str | None:
        """Why this backend cannot run cascade attention when it is asked for (True), or None."""
        if cascade_attention is not True or cls.cascade_attention:
            return None
        return f"cascade attention (shared prefixes read once per group): {cls.cascade_attention_reason}"

    @staticmethod
    def plain_only(sliding_window=None, softcap=None, sinks=False, **_) -> str | None:
        """The reason for a backend that computes plain causal attention only."""
        asked = AttentionVariant(sliding_window, softcap, sinks)
        return None if asked == PLAIN else f"only plain causal attention is implemented (asked: {asked})"

    @classmethod
    def provider(cls, **settings) -> str:
        """What does the work, with its version (reported next to every number). `settings` are
        `unavailable_reason`'s (device, dtype, head_dim, block_size, num_heads, ...), for a backend
        whose provider depends on them; without them, the one it would try first."""
        return f"torch {torch.__version__}"

    @classmethod
    def timing_caveat(cls, device: torch.device | str) -> str | None:
        """Why this backend's timings on `device` are not a kernel's speed (it is interpreted), or
        None. Benchmarks time such a backend only when it is named, once, with this as the reason."""
        return None

    @classmethod
    def compiles_on_first_use(cls, device: torch.device | str) -> bool:
        """Whether this backend JIT-compiles kernels at its first calls on `device` (what a server's
        warm-up is for: the first requests must not wait for it)."""
        return False

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> Any:
        """The step's plan: per-step state derived from `meta`; called once per step, shared by all layers."""

    def prepare(self, meta: AttentionMetadata) -> Any:
        """plan()'s name before 2026-11, still callable: runs the backend's own plan (a subclass that
        overrides prepare() plans with it; see __init_subclass__)."""
        for klass in type(self).__mro__:
            plan = vars(klass).get("plan")
            if plan is not None and not getattr(plan, "from_prepare", False):
                return plan(self, meta)
        raise NotImplementedError(f"{type(self).__name__} has no plan()")

    def __init_subclass__(cls, **kwargs):
        """A backend written to the old contract (prepare, not plan) plans through its prepare, with a note."""
        super().__init_subclass__(**kwargs)
        if "prepare" in vars(cls) and "plan" not in vars(cls):
            logger.warning("%s.prepare() is now plan(), the backend contract's name: planning with it", cls.__name__)
            old = vars(cls)["prepare"]

            def plan(self, meta: AttentionMetadata) -> Any:
                return old(self, meta)

            plan.from_prepare = True
            cls.plan = plan  # before ABCMeta counts the abstract methods: plan is not one of them

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        state: Any,
        sinks: torch.Tensor | None = None,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """q [T, H, D] attends causally to its sequence's cached K/V, as `self.variant` says (sinks:
        [H] fp32, the layer's, when the variant has them; kv_scales: the pages' (K, V) scales when
        they are quantized, see write_kv, for a backend whose `quantized_kv` names the dtype);
        returns [T, H, D]."""
