"""FlashInfer (`pip install 'pagedbench[flashinfer]'`): SGLang's default attention backend and
vLLM's on Blackwell, over the same paged cache (NHD: K and V pages [num_blocks, block_size,
H_kv, D], separate).

Its contract is plan/run: `plan()` turns the step's block table into FlashInfer's CSR page
metadata (kv_indptr, kv_indices, kv_last_page_len; qo_indptr) and calls the wrapper's `plan()`,
its host-side scheduling, once per step; `forward()` calls `run()` per layer. `kernels` times
the two apart ("plan ms"). Wrappers: a step of one-token decodes only goes
through BatchDecodeWithPagedKVCacheWrapper (tensor cores for GQA groups of 4 or more, as vLLM
does), any other step through BatchPrefillWithPagedKVCacheWrapper (causal, queries aligned to
the end of their keys); a layer with sinks through BatchAttentionWithAttentionSinkWrapper;
latent attention through BatchMLAPagedAttentionWrapper (the latent and rope parts as two views
of our one-plane cache).

Variants through FlashInfer's own parameters: a window (window_left = window - 1), soft-cap
(logits_soft_cap), sinks (the sink wrapper's extra input), and fp8 pages (kv_data_type; the
layer's K scale folded into q and its V scale into the output, as tensors, so no scale is read
back to the host). Its kernels are JIT-compiled with nvcc the first time each configuration
runs: that time is counted in `compile_seconds`, outside the timed calls. CPU: none (its kernels
are CUDA). Checked against FlashInfer 0.7.2's source; not yet run on a GPU.
"""

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from pagedbench.backends.base import PLAIN, AttentionBackend, AttentionMetadata, import_or_reason

INSTALL_HINT = "pip install 'pagedbench[flashinfer]'"
HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (vLLM allots the same)
TENSOR_CORE_GROUP = 4  # decode with tensor cores from this many query heads per KV head


def _flashinfer() -> Any:
    """The flashinfer module, or a one-line reason it cannot be imported."""
    return import_or_reason("flashinfer", INSTALL_HINT)


@dataclass(slots=True)
class PagedKV:
    """FlashInfer's CSR view of a step's pages (host arrays, and the gather that makes kv_indices)."""

    kv_indptr: np.ndarray  # [B+1] int32: sequence b's pages are kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    rows: np.ndarray  # [pages] int64: the block-table row ...
    cols: np.ndarray  # [pages] int64: ... and column of each page, in order
    last_page_len: np.ndarray  # [B] int32: tokens in each sequence's last page (1..page_size)


def paged_kv_csr(seq_lens: list[int] | np.ndarray, page_size: int) -> PagedKV:
    """The CSR layout of sequences holding `seq_lens` tokens in pages of `page_size` (host only)."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    pages = -(-lens // page_size)
    indptr = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    rows = np.repeat(np.arange(len(lens)), pages)
    cols = np.arange(int(indptr[-1])) - np.repeat(indptr[:-1].astype(np.int64), pages)
    last = (lens - (pages - 1) * page_size).astype(np.int32)
    return PagedKV(indptr, rows, cols, last)


@dataclass(slots=True)
class FlashInferState:
    meta: AttentionMetadata
    kv_indices: torch.Tensor  # [pages] int32 on the device
    csr: PagedKV
    kv_dtype: torch.dtype  # the pages' dtype it was planned for
    kind: str  # "decode", "prefill", "sinks" or "latent"
    wrapper: Any  # the planned wrapper this step's layers run


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    cuda_graph_reason = "plan() runs on the host every step; FlashInfer's CUDA-graph wrappers are not wired yet"
    batch_invariant_reason = "plan() chooses split-KV chunks from the whole batch (its load balancer)"
    cascade_attention_reason = (
        "not wired yet: FlashInfer's own MultiLevelCascadeAttentionWrapper plans every level per step (shared "
        "and unique page tables in its CSR form) and could take the plan; untested without a GPU here"
    )
    quantized_kv = ("fp8", "fp8_e4m3", "fp8_e5m2")  # kv_data_type fp8 with per-layer k_scale / v_scale
    quantized_kv_reason = "FlashInfer reads fp8 pages with a scale per layer; int8 pages have none"
    latent_values = True  # BatchMLAPagedAttentionWrapper: the latent (values) and rope parts of one page
    sparse_selection_reason = (
        "not implemented: FlashInfer's MLA wrapper could read the picks as one-token pages, a request per "
        "query, but that needs a CUDA machine to build and check"
    )

    def __init__(self, num_heads, num_kv_heads, head_dim, scale, block_size, device, dtype, variant=PLAIN):
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size, device, dtype, variant)
        settings = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, **variant.settings())
        reason = self.unavailable_reason(device, dtype, head_dim, block_size, **settings)
        if reason:
            raise ValueError(f"flashinfer backend: {reason}")
        self.fi = _flashinfer()
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)  # decode wants zeros
        self.value_dim = variant.value_dim or head_dim
        self._wrappers: dict[str, Any] = {}  # built once per kind, planned every step
        self._compiled: set[tuple] = set()
        self.kv_dtype = dtype  # the pages' dtype, known at the first forward (fp8 pages re-plan)

    @classmethod
    def unavailable_reason(cls, device, dtype, head_dim, block_size, **kwargs) -> str | None:
        device = torch.device(device)
        if device.type != "cuda":
            return f"no CUDA device (device is {device.type}); FlashInfer's kernels are CUDA, JIT-compiled with nvcc"
        fi = _flashinfer()
        if isinstance(fi, str):
            return fi
        if dtype not in (torch.float16, torch.bfloat16):
            return f"{dtype}: FlashInfer runs fp16 and bf16"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "FlashInfer needs compute capability 8.0+"
        value_dim = kwargs.get("value_dim")
        if kwargs.get("sinks") and kwargs.get("softcap"):
            return "sinks with a soft-cap: FlashInfer's sink kernel has no soft-cap"
        if value_dim not in (None, head_dim):
            if (value_dim, head_dim - value_dim) != (512, 64):
                dims = f"{value_dim} + {head_dim - value_dim}"
                return f"latent attention: FlashInfer's MLA kernels take 512 + 64 dims, not {dims}"
            if kwargs.get("sliding_window") or kwargs.get("softcap") or kwargs.get("sinks"):
                return "latent attention with a window, soft-cap or sinks: FlashInfer's MLA wrapper has none"
            return None
        if head_dim not in HEAD_DIMS:
            return f"head_dim {head_dim}: FlashInfer's paged kernels are compiled for {', '.join(map(str, HEAD_DIMS))}"
        return None

    @classmethod
    def kv_cache_reason(cls, kv_cache_dtype: str = "auto", value_dim=None, **settings) -> str | None:
        if kv_cache_dtype != "auto" and value_dim is not None:
            return (
                f"kv_cache_dtype {kv_cache_dtype} with latent attention: FlashInfer's fp8 MLA path (SM90, e4m3, "
                "its own ckv/kpe scales) is not wired"
            )
        return super().kv_cache_reason(kv_cache_dtype, **settings)

    @classmethod
    def compiles_on_first_use(cls, device) -> bool:
        return True  # JIT-compiled with nvcc on first use

    @classmethod
    def provider(cls, **settings) -> str:
        fi = _flashinfer()
        if isinstance(fi, str):
            return f"none ({fi})"
        return f"flashinfer {fi.__version__} (backend auto: fa3 on sm_90, fa2 elsewhere; JIT)"

    # ---- per step -------------------------------------------------------------------------

    def plan(self, meta: AttentionMetadata) -> FlashInferState:
        """The step's CSR page metadata, and plan() for the pages' dtype (the model's until a
        forward has seen fp8 pages: that first step plans again)."""
        csr = paged_kv_csr(meta.seq_lens_cpu, self.block_size)
        index = torch.from_numpy(np.stack([csr.rows, csr.cols])).to(self.device, non_blocking=True)
        kv_indices = meta.block_table[index[0], index[1]].int()
        state = FlashInferState(meta, kv_indices, csr, self.kv_dtype, "", None)
        self._plan(state)
        return state

    def _plan(self, state: FlashInferState) -> None:
        meta, csr = state.meta, state.csr
        qo_indptr = torch.tensor(meta.query_start_loc_cpu, dtype=torch.int32)
        kv_indptr, last = torch.from_numpy(csr.kv_indptr), torch.from_numpy(csr.last_page_len)
        if self.value_dim != self.head_dim:
            kind = "latent"
        elif self.variant.sinks:
            kind = "sinks"
        else:
            kind = "decode" if meta.max_query_len == 1 else "prefill"
        wrapper = self._wrapper(kind, state.kv_dtype)
        window = (self.variant.sliding_window or 0) - 1  # FlashInfer: keys p - window_left .. p
        dtypes = dict(q_data_type=self.dtype, kv_data_type=state.kv_dtype)
        if kind == "latent":  # host metadata (FlashInfer schedules on the host), device page ids
            kv_lens = torch.tensor(meta.seq_lens_cpu, dtype=torch.int32)
            wrapper.plan(
                metadata=self.fi.mla.MLAPlanMetadata.csr(qo_indptr, kv_indptr, state.kv_indices, kv_lens),
                num_heads=self.num_heads, head_dim_ckv=self.value_dim, head_dim_kpe=self.head_dim - self.value_dim,
                page_size=self.block_size, causal=True, sm_scale=self.scale, **dtypes,
            )  # fmt: skip
        elif kind == "decode":
            wrapper.plan(
                kv_indptr, state.kv_indices, last, self.num_heads, self.num_kv_heads, self.head_dim, self.block_size,
                window_left=window, logits_soft_cap=self.variant.softcap, sm_scale=self.scale, **dtypes,
            )  # fmt: skip
        else:
            wrapper.plan(
                qo_indptr, kv_indptr, state.kv_indices, last, self.num_heads, self.num_kv_heads, self.head_dim,
                self.block_size, causal=True, sm_scale=self.scale, window_left=window,
                logits_soft_cap=self.variant.softcap, **dtypes,
            )  # fmt: skip
        state.kind, state.wrapper = kind, wrapper

    def _wrapper(self, kind: str, kv_dtype: torch.dtype):
        """The wrapper of `kind` for pages of `kv_dtype`, built once: a wrapper fixes its kernel
        family at its first plan (fa3 takes no fp8 pages beside a 16-bit query, fa2 does)."""
        kind_key = (kind, kv_dtype)
        if kind_key not in self._wrappers:
            fi = self.fi
            if kind == "latent":
                self._wrappers[kind_key] = fi.BatchMLAPagedAttentionWrapper(self.workspace)
            elif kind == "decode":
                group = self.num_heads // self.num_kv_heads
                tensor_cores = group >= TENSOR_CORE_GROUP
                self._wrappers[kind_key] = fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_tensor_cores=tensor_cores
                )
            elif kind == "sinks":
                self._wrappers[kind_key] = fi.BatchAttentionWithAttentionSinkWrapper(
                    self.workspace, "NHD", q_data_type=self.dtype, kv_data_type=kv_dtype,
                    head_dim_qk=self.head_dim, head_dim_vo=self.head_dim,
                    window_left=(self.variant.sliding_window or 0) - 1,
                )  # fmt: skip
            else:
                self._wrappers[kind_key] = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        return self._wrappers[kind_key]

    def forward(self, q, k_cache, v_cache, state: FlashInferState, sinks=None, kv_scales=None) -> torch.Tensor:
        if k_cache.dtype != state.kv_dtype:  # fp8 pages: plan again for them, and from now on
            state.kv_dtype = self.kv_dtype = k_cache.dtype
            self._plan(state)
        start = time.perf_counter()
        if state.kind == "latent":  # packed: the latent then the rope dims, in q and in the pages
            out = state.wrapper.run(query=q, kv_cache=k_cache[:, :, 0])
        else:
            if kv_scales is not None:  # q.(s_k k) = (s_k q).k; the output's values scale by s_v after
                q = q * kv_scales[0].to(q.dtype)
            extra = (sinks.float().contiguous(),) if state.kind == "sinks" else ()  # its JIT kernel's extra input
            out = state.wrapper.run(q, (k_cache, v_cache), *extra)
            if kv_scales is not None:
                out = out * kv_scales[1].to(out.dtype)
        key = (state.kind, k_cache.dtype)
        if key not in self._compiled:  # the first run of a configuration JIT-compiles it
            torch.cuda.synchronize(self.device)
            self._compiled.add(key)
            self.compile_seconds += time.perf_counter() - start
        return out
