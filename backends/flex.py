"""FlexAttention over the paged cache, each query block reading only its own sequence's pages.

Per layer the cache `[num_pages, block_size, H_kv, D]` is viewed (no copy) as keys
`[1, H_kv, num_pages * block_size, D]`. A step runs up to two flex calls, sharing one plan():

- decode call: sequences with at most MAX_DECODE_QUERY new tokens (decodes, and short multi-token
  decodes), queries `[B, H, Q, D]` (Q = 1, 2, 4 or 8; short rows repeat their last token) against
  the cache as batch 1, which flex broadcasts. Row b of the BlockMask lists exactly sequence b's
  pages: those every query of the row sees whole as full blocks (no mask_mod), the rest masked.
- prefill call: longer chunks as one flat row `[1, H, T', D]`, each chunk padded to whole query
  blocks so a block never mixes sequences; block r lists its sequence's pages up to its last query.

Three rooms. This one, the backend: its capabilities, plan() once per step, forward() per layer.
The layout: plan() lays the calls out on the host (`flex_plan`), copies their index arrays to the
device at once and builds their BlockMasks in persistent buffers (`flex_masks`: the mask_mod, an
inverse page table); DeepSeek-V3.2's sparse steps read their picks through `flex_sparse`. The kernels:
forward() runs every call through one compiled function (`flex_compile`: compilation, kernel options,
PAGEDBENCH_FLEX_COMPILE, PAGEDBENCH_FLEX_KERNEL=flash), a decode's options searched on CUDA
per batch and context class on a representative problem (`flex_tune`).
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from einops import rearrange
from pagedbench.backends.base import PLAIN, AttentionBackend, AttentionMetadata, AttentionVariant
from pagedbench.backends.cascade import CascadeAttention, CascadeState
from pagedbench.backends.flex_cascade import prefix_attention as flex_prefix
from pagedbench.backends.flex_compile import (
    MIN_KV_BLOCK,
    attend,
    attend_compiled,
    attend_compiling,
    compile_enabled,
    compile_stats,
    kernel_options,
    kernels_unavailable_reason,
    softcap_score_mod,
)
from pagedbench.backends.flex_masks import MIN_TOKEN_CAPACITY, PagedBlockMasks, RowPages, check_int32_offsets
from pagedbench.backends.flex_plan import MAX_DECODE_QUERY, CallArrays, CallPlan, device_arrays, plan_calls
from pagedbench.backends.flex_sparse import SPARSE_PROVIDER, SparseCalls, forced_sparse_path, sparse_path
from pagedbench.backends.flex_tune import (
    DecodeProblem,
    DecodeTuner,
    decode_context_class,
    kernels_provider,
    tune_enabled,
)
from torch.nn.attention.flex_attention import BlockMask

__all__ = ["FlexBackend", "FlexCall", "FlexState", "MAX_DECODE_QUERY", "MIN_TOKEN_CAPACITY", "compile_stats"]

RECOMPILE_LIMIT = 256  # graphs of the compiled function; one more raises instead of running flex unfused


@dataclass(slots=True)
class FlexCall:
    """One flex call of a step: which flat query tokens it takes, in what shape, and its BlockMask."""

    kind: str  # "decode" | "prefill"
    batch: int  # flex batch: decode rows, or 1
    q_len: int  # query rows per batch entry
    gather: torch.Tensor | None  # [batch * q_len] flat token of each query row; None: tokens 0..batch*q_len-1
    real: torch.Tensor | None  # [K] query rows that are real tokens (the rest repeat one), None: all
    dest: torch.Tensor | None  # [K] the flat token each real row answers
    real_rows: np.ndarray  # [mask rows] real query rows in each BlockMask row (tile efficiency)
    block_mask: BlockMask | None = None
    packed_heads: int = 1  # G query heads sharing a KV head packed into each query row (CPU decodes)
    context_pages: int = 0  # a decode's context class, the problem its options are searched on (flex_tune)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """The call's rows of the step's q [T, H, D] as flex's queries: packed [batch, H_kv, q_len * G, D],
        or with G = 1 [batch, H, q_len, D]."""
        rows = q[: self.batch * self.q_len] if self.gather is None else q.index_select(0, self.gather)
        return rearrange(rows, "(b q) (h g) d -> b h (q g) d", b=self.batch, g=self.packed_heads)

    def answers(self, y: torch.Tensor) -> torch.Tensor:
        """flex's output -> a row per query row [batch * q_len, H, D]."""
        return rearrange(y, "b h (q g) d -> (b q) (h g) d", g=self.packed_heads)

    def sink_logits(self, sinks: torch.Tensor | None) -> torch.Tensor | None:
        """Sink logits [H] shaped like flex's log-sum-exp [B, H, Q] (or packed [B, H_kv, Q * G])."""
        if sinks is None:
            return None
        if self.packed_heads == 1:
            return sinks.view(1, -1, 1)
        return sinks.view(1, -1, 1, self.packed_heads).expand(-1, -1, self.q_len, -1).flatten(2)


@dataclass(slots=True)
class FlexState:
    calls: list[FlexCall]
    num_tokens: int
    shapes_seen: bool = False  # after the step's first layer every layer hits the same compiled graphs
    sparse_path: str | None = None  # sparse attention: "gather" or "pages" (flex_sparse.sparse_path)
    sparse_share: Callable[[], float] | None = None  # sparse attention: the last layer's tile efficiency


class FlexBackend(CascadeAttention, AttentionBackend):
    name = "flex"
    latent_values = True  # flex takes a value head dim other than the keys' (a strided view of their pages)
    # Cascade: the suffixes through its own paged calls; a group's prefix one flex call over its stacked rows
    # returning the log-sum-exp (compiled on CUDA; compiled CPU flex has none in torch 2.13: there one GEMM +
    # logsumexp gives it, compiled too; eager flex where flex runs eager).
    cascade_attention = True
    cascade_not_by_default = (
        "measured 2.5x slower end to end with cascade on (CPU, tiny-llama, shared-prefix: its prefix pass "
        "recompiles per K layout and costs more per layer than the reads it saves; docs/cascade.md)"
    )
    sparse_selection = True  # each query's picks gathered, or a BlockMask of their pages (flex_sparse.py)
    quantized_kv_reason = (
        "FlexAttention reads K/V in the query's dtype; over a paged cache it would have to dequantize "
        "every page each layer and step, more work than the attention (vLLM's flex backend refuses "
        "quantized KV too)"
    )
    # A decode step padded to a power of two is one identity call whose BlockMask, inverse page
    # table and positions are views of persistent buffers that plan() refills in place.
    cuda_graph_reason = None
    cuda_graph_powers_of_two = True
    batch_invariant_reason = "on CUDA its decode kernel's SPLIT_KV is tuned per batch and context class (flex_tune.py)"

    @classmethod
    def batch_invariance(cls, device, sinks=False, **settings) -> str | None:
        """Compiled on CPU each row's blocks are summed alone, in page order; not so on CUDA or with sinks."""
        if torch.device(device).type == "cuda":
            return cls.batch_invariant_reason
        if sinks:
            return "sinks run flex eager on CPU, rescaled through its log-sum-exp, which varies with batch and pages"
        return None if compile_enabled() else "eager flex (PAGEDBENCH_FLEX_COMPILE=0) is not held to it"

    def __init__(
        self,
        num_heads,
        num_kv_heads,
        head_dim,
        scale,
        block_size,
        device,
        dtype,
        variant: AttentionVariant = PLAIN,
        compile: bool = True,
        q_block_size: int | None = None,
        batch_invariant: bool = False,  # nothing to change where batch_invariance accepts it: CPU compiled
    ):
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size, device, dtype, variant, batch_invariant)
        cuda = self.device.type == "cuda"
        # Sinks need flex's log-sum-exp output, which compiled flex on CPU does not produce (torch 2.13).
        self.compiled = compile and compile_enabled() and not (variant.sinks and not cuda)
        # Triton wants query tiles of 64+ rows; the CPU kernel is compute bound and takes short ones.
        self.q_block_size = q_block_size or (128 if cuda else 16)
        # KV blocks under 16 slots miscompute on CPU (torch 2.13's micro-GEMM N tail) and are below
        # Triton's minimum tile, so small pages share a KV block; the mask_mod maps each slot to its page.
        self.kv_block_size = max(block_size, MIN_KV_BLOCK)
        self.kernel_options = kernel_options(self.device, self.q_block_size, self.kv_block_size, head_dim, dtype)
        # Decode options searched per static batch and context class (flex_tune.py), on CUDA where flex is compiled.
        self.tuned_decode = cuda and self.compiled and tune_enabled()
        # flex's decoding kernel splits a row's KV blocks across thread blocks only when the mask has no
        # full blocks (with full blocks it splits the whole cache length), so on CUDA decodes are all masked.
        self.decode_full_blocks = not cuda
        self.static_decode_batch = cuda  # flex's decoding kernel needs a static batch
        # On CPU a decode row's query heads that share a KV head are packed into its query rows
        # ([B, H_kv, Q * G, D], q-major): each KV block meets G * Q rows in one micro-GEMM instead of
        # G GEMMs of Q rows (1.25-1.47x faster at G = 4), and a one-token decode has no size-1 dimension, so
        # it shares the compiled graph of multi-token decodes. CUDA's decoding kernel packs GQA itself.
        self.packed_heads = 1 if cuda else num_heads // num_kv_heads
        window = variant.sliding_window
        flash_prefill = (self.kernel_options["prefill"] or {}).get("BACKEND") == "FLASH"
        new_masks = partial(PagedBlockMasks, block_size, self.kv_block_size, self.q_block_size, self.device, window,
                            self.packed_heads, flash_prefill)  # fmt: skip
        self._masks = new_masks()
        self.decode_tuner = DecodeTuner(self.device, num_heads, num_kv_heads, head_dim, block_size, dtype,
                                        self.kv_block_size, new_masks, self.decode_full_blocks)  # fmt: skip
        self.score_mod = softcap_score_mod(variant.softcap, self.device) if variant.softcap is not None else None
        self._sparse = SparseCalls(num_heads, num_kv_heads, head_dim, self.kv_block_size, self.device, dtype,
                                   self.decode_full_blocks)  # fmt: skip

    @classmethod
    def unavailable_reason(cls, device, dtype, head_dim, block_size, **kwargs):
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            return f"flex backend runs on cpu and cuda, not {device.type}"
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"flex attention supports float32/bfloat16/float16, not {dtype}"
        if block_size & (block_size - 1):
            return f"block_size {block_size} must be a power of two (a BlockMask KV block holds whole pages)"
        return kernels_unavailable_reason(device, block_size)

    @classmethod
    def compiles_on_first_use(cls, device) -> bool:
        return compile_enabled()

    def prefix_attention(self, q_rows, k, v, q_pos) -> tuple[torch.Tensor, torch.Tensor]:
        """Cascade's prefix pass as one flex call: the group's rows packed per KV head [1, H_kv, R * G, D]
        over the prefix, dense (every prefix key precedes every row), with its log-sum-exp; a window: explicit."""
        if self.variant.sliding_window is not None:
            return super().prefix_attention(q_rows, k, v, q_pos)
        group = self.num_heads // self.num_kv_heads
        qg = rearrange(q_rows, "r (hk g) d -> 1 hk (r g) d", g=group)
        o, lse = flex_prefix(qg, k, v, self.scale, self.variant.softcap, self.score_mod, self.compiled)
        return rearrange(o, "1 hk (r g) d -> r (hk g) d", g=group), rearrange(lse, "1 hk (r g) -> r (hk g)", g=group)

    @classmethod
    def provider(cls, **settings) -> str:
        text = kernels_provider(settings.get("device"), bool(settings.get("sinks")))
        if settings.get("topk"):
            text += ", " + SPARSE_PROVIDER[forced_sparse_path()]
        return text

    @property
    def decode_options_used(self) -> str:
        """The decode kernel options each static batch ran with so far ("batch 64: stages 3, ...")."""
        if self.device.type != "cuda" and not self.decode_tuner.chosen:
            return ""
        return self.decode_tuner.used(self.kernel_options["decode"])

    # --- plan: once per step -- ----------------------------------------------------------------

    @torch.inference_mode()  # the mask's tensors must be alike whether built here or in forward (guards)
    def plan(self, meta: AttentionMetadata) -> FlexState | CascadeState:
        if meta.cascade is not None:
            return self.plan_cascade_step(meta, self._plan_flat)
        return self._plan_flat(meta)

    def _plan_flat(self, meta: AttentionMetadata) -> FlexState:
        num_pages = meta.num_cache_blocks
        check_int32_offsets(num_pages, self.block_size, self.num_kv_heads * self.head_dim, self.device)
        qsl = np.asarray(meta.query_start_loc_cpu, dtype=np.int64)
        seq_lens = np.asarray(meta.seq_lens_cpu, dtype=np.int64)
        ctx = np.asarray(meta.context_lens_cpu, dtype=np.int64)
        plans = plan_calls(
            qsl,
            ctx,
            block_size=self.block_size,
            kv_block_size=self.kv_block_size,
            q_block_size=self.q_block_size,
            decode_full_blocks=self.decode_full_blocks,
            static_decode_batch=self.static_decode_batch,
            sliding_window=self.variant.sliding_window,
        )
        # One host-to-device copy carries every index array of the step (O(rows and tokens), no page lists);
        # the device expands each row's page span over the block table.
        arrays = device_arrays(plans, self.device)
        listings = [self._masks.row_pages(plan, call, meta.block_table) for plan, call in zip(plans, arrays)]
        self._masks.fill_inverse(listings, len(seq_lens), num_pages, full_too=not self.compiled)
        calls = [self._call(*call, num_pages) for call in zip(plans, arrays, listings)]
        for plan, call in zip(plans, calls):
            call.context_pages = decode_context_class(plan, len(plans), meta.max_seq_len, self.block_size)
        path = None if self.variant.topk is None else sparse_path(meta.seq_lens_cpu, self.variant.topk, meta.num_tokens)
        return FlexState(calls, meta.num_tokens, sparse_path=path)

    def _call(self, plan: CallPlan, arrays: CallArrays[torch.Tensor], listing: RowPages, num_pages: int) -> FlexCall:
        routed = not plan.identity  # query rows gathered from, and answers scattered to, the flat tokens
        packed = self.packed_heads if plan.kind == "decode" else 1
        return FlexCall(
            plan.kind,
            plan.batch,
            plan.q_len,
            arrays.token if routed else None,
            arrays.real if routed else None,
            arrays.dest if routed else None,
            plan.real_rows * packed,  # packed query rows
            self._masks.block_mask(plan, arrays, listing, num_pages),
            packed,
        )

    # --- forward: once per layer ---------------------------------------------------------------

    def forward(self, q, k_cache, v_cache, state, sinks=None, selected=None) -> torch.Tensor:
        if isinstance(state, CascadeState) and selected is None:
            flat = lambda q, flat_state: self.forward(q, k_cache, v_cache, flat_state, sinks)
            return self.cascade_forward(q, k_cache, v_cache, state, flat, sinks)
        # [num_pages, bs, H_kv, D] -> [1, H_kv, num_pages * bs, D]: a view; flex takes any strides
        # with a unit last dim, and the CPU kernel reads this [B, L, H, D] layout natively.
        k = rearrange(k_cache, "n p h d -> 1 h (n p) d")
        v = rearrange(v_cache, "n p h d -> 1 h (n p) d")
        if selected is not None:  # each query's picks (flex_sparse.py)
            attend_sparse = partial(self._flex, "sparse")
            if state.sparse_path == "pages":
                out, state.sparse_share = self._sparse.pages(q, k, v, selected, sinks, attend_sparse)
            else:
                out, state.sparse_share = self._sparse.gathered(q, k_cache, v_cache, selected, sinks, attend_sparse)
            return out
        out = None
        for call in state.calls:
            x, call_sinks = call.queries(q), call.sink_logits(sinks)
            if call.kind == "decode" and self.static_decode_batch:
                torch._dynamo.mark_static(x, 0)
            options = self._options(call, k, v, call_sinks)
            y = call.answers(self._flex(call.kind, x, k, v, call.block_mask, options, call_sinks, state.shapes_seen))
            if call.gather is None and len(state.calls) == 1:
                state.shapes_seen = True
                return y
            if out is None:
                out = q.new_empty(state.num_tokens, self.num_heads, v.shape[-1])  # latent values: D_v < D
            if call.gather is None:
                out[: y.shape[0]] = y
            else:
                out.index_copy_(0, call.dest, y.index_select(0, call.real))
        state.shapes_seen = True
        return out

    def _flex(self, kind: str, q, k, v, block_mask, options, sinks, shapes_seen=False) -> torch.Tensor:
        """One flex call, eager or compiled. Only a step's first layer (shapes not yet seen) can miss the
        compile cache; the seconds spent compiling there count."""
        args = (q, k, v, block_mask, self.scale, options, self.score_mod, sinks)
        if not self.compiled:
            return attend(*args)
        if shapes_seen:
            return attend_compiled(*args)
        y, seconds = attend_compiling(kind, args, RECOMPILE_LIMIT)
        self.compile_seconds += seconds
        return y

    def _options(self, call: FlexCall, k, v, sinks) -> dict | None:
        """The call's kernel_options: on CUDA a decode's are searched once per static batch and context
        class on a representative problem over this cache (flex_tune.py; cached on disk,
        PAGEDBENCH_FLEX_TUNE=0 turns it off)."""
        base = self.kernel_options[call.kind]
        if call.kind != "decode" or not self.tuned_decode:
            return base
        problem = DecodeProblem(call.batch, call.q_len, call.context_pages, k.shape[2] // self.block_size)
        operands = (k, v, self.scale, self.score_mod, sinks)
        found, spent = self.decode_tuner.options(problem, base, operands, RECOMPILE_LIMIT)
        self.compile_seconds += spent  # the search is compile time, never a step's
        return found

    # --- diagnostics ---------------------------------------------------------------------------

    @torch.inference_mode()
    def tile_efficiency(self, state: FlexState) -> float:
        """Share of the computed score entries the mask keeps, over real query rows: for each BlockMask
        row, its real query rows x (full blocks x kv_block + kept slots of its masked blocks), over
        its real query rows x (full + masked blocks) x kv_block; from the BlockMasks as built. A sparse
        step's: its last layer's selected slots over the slots of the blocks listed for them."""
        if isinstance(state, CascadeState):  # its suffix pass's calls (the prefix pass is one dense call)
            return self.tile_efficiency(state.flat)
        if state.sparse_share is not None:
            return state.sparse_share()
        kept = computed = 0
        for call in state.calls:
            call_kept, call_computed = self._masks.tile_counts(call.block_mask, call.kind, call.real_rows)
            kept, computed = kept + call_kept, computed + call_computed
        return kept / computed if computed else 1.0
