"""FlexAttention over the paged cache, each query block reading only its own sequence's pages.

Per layer the cache `[num_pages, block_size, H_kv, D]` is viewed (no copy) as keys
`[1, H_kv, num_pages * block_size, D]`. A step runs up to two flex calls, sharing one prepare():

- decode call: sequences with at most MAX_DECODE_QUERY new tokens (decodes, and short multi-token
  decodes), queries `[B, H, Q, D]` (Q = 1, 2, 4 or 8; short rows repeat their last token) against
  the cache as batch 1, which flex broadcasts. Row b of the BlockMask lists exactly sequence b's
  pages: those every query of the row sees whole as full blocks (no mask_mod), the rest masked.
- prefill call: longer chunks as one flat row `[1, H, T', D]`, each chunk padded to whole query
  blocks so a block never mixes sequences; block r lists its sequence's pages up to its last query.

prepare() lays the calls out on the host (`flex_plan`), copies their index arrays to the device
at once and builds their BlockMasks in persistent buffers (`flex_masks`: the mask_mod, an inverse
page table); forward() runs them through one compiled function (`flex_compile`: compilation,
PAGEDBENCH_FLEX_COMPILE, PAGEDBENCH_FLEX_KERNEL=flash).
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from pagedbench.backends.base import PLAIN, AttentionBackend, AttentionMetadata, AttentionVariant, read_selected
from pagedbench.backends.flex_compile import (
    attend,
    attend_compiled,
    attend_compiling,
    compile_enabled,
    compile_stats,
    flash_kernel_reason,
    kernel_choice,
    kernel_options,
    prefill_tiles,
    shared_memory_bytes,
    softcap_score_mod,
)
from pagedbench.backends.flex_masks import MIN_KV_BLOCK, MIN_TOKEN_CAPACITY, PagedBlockMasks, RowPages
from pagedbench.backends.flex_plan import MAX_DECODE_QUERY, CallArrays, CallPlan, plan_calls
from pagedbench.backends.flex_sparse import (
    GatheredMasks,
    forced_sparse_path,
    gathered_share,
    gathered_width,
    selected_share,
    sparse_block_mask,
    sparse_path,
)
from pagedbench.backends.flex_tune import (
    DecodeOptionsCache,
    DecodeShape,
    cuda_seconds,
    current_gpu,
    describe,
    tune_enabled,
    tuned_decode_options,
)
from torch.nn.attention.flex_attention import BlockMask

from pagedbench.device.transfer import to_device

SPARSE_PROVIDER = {
    "auto": "top-k gathered (page BlockMask where every sequence fits the top-k, 8+ query tokens)",
    "gather": "top-k gathered (PAGEDBENCH_FLEX_SPARSE=gather)",
    "pages": "top-k page BlockMask (PAGEDBENCH_FLEX_SPARSE=pages)",
}

__all__ = ["FlexBackend", "FlexCall", "FlexState", "MAX_DECODE_QUERY", "MIN_TOKEN_CAPACITY", "compile_stats"]

logger = logging.getLogger(__name__)
_INT32_MAX = 2**31 - 1
SPARSE_Q_ROWS = 16  # least query rows per BlockMask block in sparse calls (a block lists its tokens' picks)
GATHER_Q_ROWS = 64  # most query rows per block of a gathered sparse call (MLA-128's decode: two blocks, two cores)
GATHER_KV_BLOCK = 64  # gathered keys per KV block (the top-k rounded up to a multiple)
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


@dataclass(slots=True)
class FlexState:
    calls: list[FlexCall]
    num_tokens: int
    shapes_seen: bool = False  # after the step's first layer every layer hits the same compiled graphs
    sparse_path: str | None = None  # sparse attention: "gather" or "pages" (flex_sparse.sparse_path)
    sparse_share: Callable[[], float] | None = None  # sparse attention: the last layer's tile efficiency


class FlexBackend(AttentionBackend):
    name = "flex"
    latent_values = True  # flex takes a value head dim other than the keys' (a strided view of their pages)
    sparse_selection = True  # each query's picks gathered, or a BlockMask of their pages (flex_sparse.py)
    quantized_kv_reason = (
        "FlexAttention reads K/V in the query's dtype; over a paged cache it would have to dequantize "
        "every page each layer and step, more work than the attention (vLLM's flex backend refuses "
        "quantized KV too)"
    )
    # A decode step padded to a power of two is one identity call whose BlockMask, inverse page
    # table and positions are views of persistent buffers that prepare() refills in place.
    cuda_graph_reason = None
    cuda_graph_powers_of_two = True

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
    ):
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size, device, dtype, variant)
        cuda = self.device.type == "cuda"
        # Sinks need flex's log-sum-exp output, which compiled flex on CPU does not produce (torch 2.13).
        self.compiled = compile and compile_enabled() and not (variant.sinks and not cuda)
        # Triton wants query tiles of 64+ rows; the CPU kernel is compute bound and takes short ones.
        self.q_block_size = q_block_size or (128 if cuda else 16)
        # KV blocks under 16 slots miscompute on CPU (torch 2.13's micro-GEMM N tail) and are below
        # Triton's minimum tile, so small pages share a KV block; the mask_mod maps each slot to its page.
        self.kv_block_size = max(block_size, MIN_KV_BLOCK)
        self.kernel_options = kernel_options(self.device, self.q_block_size, self.kv_block_size, head_dim, dtype)
        # Decode options searched per static batch (flex_tune.py), on CUDA where flex is compiled.
        self.tuned_decode = cuda and self.compiled and tune_enabled()
        self.decode_options: dict[int, dict] = {}
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
        self._masks = PagedBlockMasks(
            block_size, self.kv_block_size, self.q_block_size, self.device, window, self.packed_heads, flash_prefill
        )
        self.score_mod = softcap_score_mod(variant.softcap, self.device) if variant.softcap is not None else None
        # Sparse attention: a KV head's query heads packed as rows (a power-of-two group; else a row per
        # head), query blocks of whole tokens and at least 16 rows (a block's tokens share its listed KV blocks)
        group = num_heads // num_kv_heads
        self.sparse_rows = group if group & (group - 1) == 0 else 1
        self.sparse_tokens = max(1, SPARSE_Q_ROWS // self.sparse_rows)
        # Gathered sparse calls: a token's G query rows in blocks of up to 64 (two blocks of MLA-128's 128 rows
        # keep two CPU cores busy on one decode), its gathered keys in blocks of 64.
        self.gather_rows = 1 << (group - 1).bit_length()  # a token's query rows, padded to a power of two
        self.gather_q_block = min(GATHER_Q_ROWS, max(SPARSE_Q_ROWS, self.gather_rows))
        self._gathered_masks = GatheredMasks(self.gather_rows, self.gather_q_block, GATHER_KV_BLOCK, self.device,
                                             full_blocks=self.decode_full_blocks)  # fmt: skip
        self.sparse_options = self.gather_options = None  # CPU: the template's own; CUDA: tiles that fit
        if cuda:
            rows, smem = self.sparse_rows * self.sparse_tokens, shared_memory_bytes(self.device)
            self.sparse_options = {"BACKEND": "TRITON"} | prefill_tiles(rows, self.kv_block_size, head_dim,
                                                                         dtype.itemsize, smem)  # fmt: skip
            self.gather_options = {"BACKEND": "TRITON"} | prefill_tiles(self.gather_q_block, GATHER_KV_BLOCK,
                                                                         head_dim, dtype.itemsize, smem)  # fmt: skip

    @classmethod
    def unavailable_reason(cls, device, dtype, head_dim, block_size, **kwargs):
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            return f"flex backend runs on cpu and cuda, not {device.type}"
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"flex attention supports float32/bfloat16/float16, not {dtype}"
        if block_size & (block_size - 1):
            return f"block_size {block_size} must be a power of two (a BlockMask KV block holds whole pages)"
        try:
            kernel = kernel_choice()
        except ValueError as e:
            return str(e)
        if kernel == "flash":
            reason = flash_kernel_reason(device)
            if reason:
                return f"PAGEDBENCH_FLEX_KERNEL=flash: {reason}"
            if block_size < MIN_KV_BLOCK:
                return (
                    f"PAGEDBENCH_FLEX_KERNEL=flash: pages of {block_size} share KV blocks, "
                    "leaving no full blocks, which FLASH needs"
                )
        if device.type == "cpu" and compile_enabled():
            from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported

            if not check_cpu_supported():
                return "compiled flex on CPU needs x86 with AVX2 (PAGEDBENCH_FLEX_COMPILE=0 runs it eager)"
        return None

    @classmethod
    def compiles_on_first_use(cls, device) -> bool:
        return compile_enabled()

    @classmethod
    def provider(cls, **settings) -> str:
        device = settings.get("device")
        cpu = device is not None and torch.device(device).type == "cpu"
        mode = "compiled" if compile_enabled() else "eager"
        if mode == "compiled" and settings.get("sinks") and cpu:
            mode = "eager (sinks need the log-sum-exp compiled CPU flex lacks)"
        try:
            flash = kernel_choice() == "flash" and (device is None or torch.device(device).type == "cuda")
        except ValueError:
            flash = False
        text = f"torch {torch.__version__} flex {mode}" + (", FA4 prefill kernels (BACKEND=FLASH)" if flash else "")
        if mode == "compiled" and device is not None and torch.device(device).type == "cuda":
            text += ", decode options tuned per batch" if tune_enabled() else ", decode options untuned"
        if settings.get("topk"):
            text += ", " + SPARSE_PROVIDER[forced_sparse_path()]
        return text

    @property
    def decode_options_used(self) -> str:
        """The decode kernel options each static batch ran with so far ("batch 64: stages 3, ...")."""
        if not self.decode_options:
            return describe(self.kernel_options["decode"]) if self.device.type == "cuda" else ""
        return "; ".join(f"batch {b}: {describe(o)}" for b, o in sorted(self.decode_options.items()))

    # --- prepare: once per step ----------------------------------------------------------------

    @torch.inference_mode()  # the mask's tensors must be alike whether built here or in forward (guards)
    def prepare(self, meta: AttentionMetadata) -> FlexState:
        num_pages = meta.num_cache_blocks
        self._check_int32_offsets(num_pages)
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
        arrays = [a for plan in plans for a in plan.host]
        dev = to_device(np.concatenate(arrays), self.device).split([len(a) for a in arrays])
        calls, offset = [], 0
        for plan in plans:
            calls.append(CallArrays(*dev[offset : offset + len(plan.host)]))
            offset += len(plan.host)
        listings = [self._masks.row_pages(plan, arrays, meta.block_table) for plan, arrays in zip(plans, calls)]
        self._masks.fill_inverse(listings, len(seq_lens), num_pages, full_too=not self.compiled)
        calls = [self._call(*call, num_pages) for call in zip(plans, calls, listings)]
        path = None if self.variant.topk is None else sparse_path(meta.seq_lens_cpu, self.variant.topk, meta.num_tokens)
        return FlexState(calls, meta.num_tokens, sparse_path=path)

    def _check_int32_offsets(self, num_pages: int) -> None:
        slots = num_pages * self.block_size
        if slots > _INT32_MAX:
            raise ValueError(f"cache of {num_pages} x {self.block_size} slots exceeds int32, the type of flex's kv_idx")
        if self.device.type == "cuda" and slots * self.num_kv_heads * self.head_dim > _INT32_MAX:
            raise ValueError(f"a layer's cache of {num_pages} pages overflows Triton flex's int32 element offsets")

    def _call(self, plan: CallPlan, arrays: CallArrays[torch.Tensor], listing: RowPages, num_pages: int) -> FlexCall:
        routed = not plan.identity  # query rows gathered from, and answers scattered to, the flat tokens
        return FlexCall(
            plan.kind,
            plan.batch,
            plan.q_len,
            arrays.token if routed else None,
            arrays.real if routed else None,
            arrays.dest if routed else None,
            plan.real_rows * (self.packed_heads if plan.kind == "decode" else 1),  # packed query rows
            self._masks.block_mask(plan, arrays, listing, num_pages),
        )

    # --- forward: once per layer ---------------------------------------------------------------

    def forward(self, q, k_cache, v_cache, state: FlexState, sinks=None, selected=None) -> torch.Tensor:
        # [num_pages, bs, H_kv, D] -> [1, H_kv, num_pages * bs, D]: a view; flex takes any strides
        # with a unit last dim, and the CPU kernel reads this [B, L, H, D] layout natively.
        k = rearrange(k_cache, "n p h d -> 1 h (n p) d")
        v = rearrange(v_cache, "n p h d -> 1 h (n p) d")
        if selected is not None:
            if state.sparse_path == "pages":
                return self._sparse(q, k, v, selected, state, sinks)
            return self._gathered(q, k_cache, v_cache, selected, state, sinks)
        out = None
        for call in state.calls:
            rows = q[: call.batch * call.q_len] if call.gather is None else q.index_select(0, call.gather)
            x = self._query_rows(rows, call)
            if call.kind == "decode" and self.static_decode_batch:
                torch._dynamo.mark_static(x, 0)
            y = self._token_rows(self._attend(x, k, v, call, state, sinks), call)
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

    def _sparse(self, q, k, v, selected, state: FlexState, sinks) -> torch.Tensor:
        """Sparse attention: every query token one row of a flat call whose BlockMask lists the blocks
        of its query block's selected slots and whose mask_mod keeps each row's own (flex_sparse.py)."""
        g, per_block = self.sparse_rows, self.sparse_tokens
        mask, _, padded = sparse_block_mask(selected, k.shape[2], per_block, self.kv_block_size, g)
        x = rearrange(F.pad(q, (0, 0, 0, 0, 0, padded - q.shape[0])), "t (hk g) d -> 1 hk (t g) d", g=g)
        if sinks is not None:  # [H] -> like flex's log-sum-exp [1, H_kv, T * G]
            sinks = repeat(sinks.view(-1, g), "hk g -> 1 hk (t g)", t=padded)
        args = (x, k, v, mask, self.scale, self.sparse_options, self.score_mod, sinks)
        if not self.compiled:
            y = attend(*args)
        else:
            y, seconds = attend_compiling("sparse", args, RECOMPILE_LIMIT)
            self.compile_seconds += seconds
        state.sparse_share = lambda: selected_share(selected, mask, per_block)
        return rearrange(y[0], "hk (t g) d -> t (hk g) d", g=g)[: q.shape[0]]

    def _gathered(self, q, k_cache, v_cache, selected, state: FlexState, sinks) -> torch.Tensor:
        """Sparse attention over each token's gathered picks, one flat call per chunk of tokens: token t's
        query heads of a KV head as rows (padded to a power of two) over its K' gathered keys (the top-k in
        whole KV blocks, picks first); the BlockMask lists only the blocks holding picks (flex_sparse.py).
        Chunks of whole query blocks bound the buffer."""
        group, rows, kv_block = self.num_heads // self.num_kv_heads, self.gather_rows, GATHER_KV_BLOCK
        width = gathered_width(selected.shape[1], kv_block)
        per_block = self._gathered_masks.tokens_per_block
        padded = -(-q.shape[0] // per_block) * per_block
        # picks first, -1 (none) last: the indexer's order already; sorting keeps any other exact
        picks = selected.sort(dim=1, descending=True).values
        picks = F.pad(picks, (0, width - picks.shape[1], 0, padded - picks.shape[0]), value=-1)
        counts = (picks >= 0).sum(dim=1, dtype=torch.int32)
        x = rearrange(q, "t (hk g) d -> t hk g d", g=group)
        x = F.pad(x, (0, 0, 0, rows - group, 0, 0, 0, padded - q.shape[0]))  # rows to a power of two, whole blocks
        if sinks is not None:  # [H] -> like flex's log-sum-exp [1, H_kv, t * rows]
            sinks = F.pad(sinks.view(self.num_kv_heads, group), (0, rows - group))
        out = q.new_empty(*q.shape[:2], v_cache.shape[-1])
        for t0, t1, k, v, _ in read_selected(k_cache, v_cache, picks, None, q.dtype, tokens_multiple=per_block):
            mask = self._gathered_masks.block_mask(counts[t0:t1], width)
            k, v = (rearrange(t, "t hk w d -> 1 hk (t w) d") for t in (k, v))  # views where H_kv is 1
            chunk_sinks = None if sinks is None else repeat(sinks, "hk g -> 1 hk (t g)", t=t1 - t0)
            args = (rearrange(x[t0:t1], "t hk g d -> 1 hk (t g) d"), k, v, mask, self.scale, self.gather_options,
                    self.score_mod, chunk_sinks)  # fmt: skip
            if not self.compiled:
                y = attend(*args)
            else:
                y, seconds = attend_compiling("sparse", args, RECOMPILE_LIMIT)
                self.compile_seconds += seconds
            real = min(t1, q.shape[0]) - t0
            if real > 0:
                y = rearrange(y[0], "hk (t g) d -> t hk g d", g=rows)[:real, :, :group]
                out[t0 : t0 + real] = rearrange(y, "t hk g d -> t (hk g) d")
        state.sparse_share = lambda: gathered_share(counts[: q.shape[0]], kv_block)
        return out

    def _packed(self, call: FlexCall) -> bool:
        return call.kind == "decode" and self.packed_heads > 1

    def _query_rows(self, rows: torch.Tensor, call: FlexCall) -> torch.Tensor:
        """[batch * q_len, H, D] -> flex's queries: [batch, H, q_len, D], or packed [batch, H_kv, q_len * G, D]."""
        if self._packed(call):
            return rearrange(rows, "(b q) (h g) d -> b h (q g) d", b=call.batch, g=self.packed_heads)
        return rearrange(rows, "(b q) h d -> b h q d", b=call.batch)

    def _token_rows(self, y: torch.Tensor, call: FlexCall) -> torch.Tensor:
        if self._packed(call):
            return rearrange(y, "b h (q g) d -> (b q) (h g) d", g=self.packed_heads)
        return rearrange(y, "b h q d -> (b q) h d")

    def _sinks(self, sinks: torch.Tensor | None, call: FlexCall) -> torch.Tensor | None:
        """Sink logits [H] shaped like flex's log-sum-exp [B, H, Q] (or packed [B, H_kv, Q * G])."""
        if sinks is None:
            return None
        if self._packed(call):
            return sinks.view(1, self.num_kv_heads, 1, self.packed_heads).expand(-1, -1, call.q_len, -1).flatten(2)
        return sinks.view(1, -1, 1)

    def _attend(self, x, k, v, call: FlexCall, state: FlexState, sinks) -> torch.Tensor:
        sinks = self._sinks(sinks, call)
        args = (x, k, v, call.block_mask, self.scale, self._options(call, x, k, v, sinks), self.score_mod, sinks)
        if not self.compiled:
            return attend(*args)
        if state.shapes_seen:  # only the step's first layer can miss the compile cache
            return attend_compiled(*args)
        y, seconds = attend_compiling(call.kind, args, RECOMPILE_LIMIT)
        self.compile_seconds += seconds
        return y

    def _options(self, call: FlexCall, x, k, v, sinks) -> dict | None:
        """The call's kernel_options: on CUDA a decode's are searched once per static batch on its
        own inputs (flex_tune.py; cached on disk, PAGEDBENCH_FLEX_TUNE=0 turns it off), never
        inside a CUDA-graph capture (the engine's warm-up before capture has run the search)."""
        base = self.kernel_options[call.kind]
        if call.kind != "decode" or not self.tuned_decode:
            return base
        found = self.decode_options.get(call.batch)
        if found is not None:
            return found
        if torch.cuda.is_current_stream_capturing():
            return base
        name, sms = current_gpu(self.device)
        shape = DecodeShape(name, torch.__version__, self.num_heads, self.num_kv_heads, self.head_dim,
                            self.block_size, str(self.dtype).removeprefix("torch."), call.batch)  # fmt: skip

        def seconds(options: dict) -> float:
            args = (x, k, v, call.block_mask, self.scale, options, self.score_mod, sinks)
            try:
                attend_compiling(call.kind, args, RECOMPILE_LIMIT)
            except Exception as e:  # a candidate the template cannot build (shared memory, tile)
                logger.debug("flex: decode candidate %s failed: %s", options, e)
                return float("inf")
            return cuda_seconds(lambda: attend_compiled(*args))

        found, spent = tuned_decode_options(shape, base, self.kv_block_size, sms, seconds, DecodeOptionsCache())
        self.compile_seconds += spent  # the search is compile time, never a step's
        self.decode_options[call.batch] = found
        return found

    # --- diagnostics ---------------------------------------------------------------------------

    @torch.inference_mode()
    def tile_efficiency(self, state: FlexState) -> float:
        """Share of the computed score entries the mask keeps, over real query rows: for each BlockMask
        row, its real query rows x (full blocks x kv_block + kept slots of its masked blocks), over
        its real query rows x (full + masked blocks) x kv_block; from the BlockMasks as built. A sparse
        step's: its last layer's selected slots over the slots of the blocks listed for them."""
        if state.sparse_share is not None:
            return state.sparse_share()
        kept = computed = 0
        for call in state.calls:
            call_kept, call_computed = self._masks.tile_counts(call.block_mask, call.kind, call.real_rows)
            kept, computed = kept + call_kept, computed + call_computed
        return kept / computed if computed else 1.0
