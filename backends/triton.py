"""Our own fused paged attention in Triton (`backends/triton_kernels.py`): pages read in place
through the block table, no gather; decode and prefill in one kernel.

A step is at most two launches: its one-token decodes with the keys split into segments
processed in parallel and merged by a second kernel (flash-decoding), and its other sequences
(prefill chunks, or a few query tokens each as in speculative decoding) as tiles of query
tokens x the query heads of one KV head, split too when they are short. Launch shapes depend
only on host counts that a CUDA graph bucket fixes (sequences, tokens, the longest sequence),
and every per-sequence length is read on the device, so a decode graph captures it.

Latent attention (DeepSeek's MLA, absorbed: many query heads over one latent "head" whose first
dims are the values) has its own kernel (`backends/triton_mla_kernels.py`): one query token x
a block of heads per program, the key dims as latent + rope dots.

On CUDA the kernels are JIT-compiled; on CPU they run in Triton's interpreter (numpy, one
program at a time): correct and slow, for tests and `check`, never for timings.
"""

import contextlib
import functools
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from pagedbench.backends.base import (
    PLAIN,
    QUANTIZED_KV,
    AttentionBackend,
    AttentionMetadata,
    import_or_reason,
    per_token_scales,
)
from pagedbench.backends.cascade import CascadeAttention, CascadeState

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256  # tl.dot needs K >= 16; a [BLOCK_M, 256] fp32 accumulator is the ceiling
MAX_LATENT_HEAD_DIM = 1024  # DeepSeek's 512 + 64 (the latent kernel: latent and rope dots apart)
LATENT_WARPS = 8  # a [32, 512] fp32 accumulator: 4 warps would spill it
SHORT_QUERY = 16  # sequences with at most this many query tokens are split along their keys like decodes
INSTALL_HINT = "pip install 'pagedbench[triton]'"
# paged_attention's compile-time parameters that cascade_prefix shares (with its own BLOCK_R)
CASCADE_CONSTANTS = ("GROUP", "GROUP_P2", "BLOCK_M", "BLOCK_N", "HEAD_DIM", "HEAD_DIM_P2", "V_DIM", "V_DIM_P2",
                     "PAGE_SIZE", "SOFTCAP", "FP32_DOTS", "KV_SCALES")  # fmt: skip


def _triton() -> Any:
    """The triton module, or a one-line reason it cannot be imported."""
    return import_or_reason("triton", INSTALL_HINT)


@functools.cache
def _cascade_kernel(device_type: str) -> Any:
    import triton
    from pagedbench.backends.triton_cascade_kernels import cascade_prefix

    return triton.jit(cascade_prefix) if device_type == "cuda" else _Interpreted(cascade_prefix)


def kernels(device_type: str) -> tuple[Any, Any, Any]:
    """(paged_attention, combine_segments, mla_attention) compiled for CUDA, or interpreted for CPU tensors."""
    import triton
    from pagedbench.backends import triton_kernels as src
    from pagedbench.backends import triton_mla_kernels as mla

    functions = (src.paged_attention, src.combine_segments, mla.mla_attention)
    return tuple(triton.jit(f) if device_type == "cuda" else _Interpreted(f) for f in functions)


class _Interpreted:
    """A kernel run by Triton's interpreter whatever TRITON_INTERPRET said when triton was imported.

    Without it, triton.language's own helpers (tl.zeros, tl.max, tl.sum) were built compile-only
    and refuse to be called from Python; during an interpreted launch they run interpreted too.
    (Compiled kernels never call `JITFunction.__call__`: the code generator inlines helpers.)
    The interpreter's int32 overflow sanitizer is off during our launches, as it is in compiled
    kernels: it triples the run time (cache addresses are int64; token rows stay far below 2**31)."""

    def __init__(self, fn):
        from triton.runtime.interpreter import InterpretedFunction

        self.kernel = InterpretedFunction(fn)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with interpreting():
                self.kernel[grid](*args, **kwargs)

        return launch


@contextlib.contextmanager
def interpreting():
    """Triton's interpreter made whole for the launches inside, whatever TRITON_INTERPRET said when
    triton was imported (`_Interpreted`'s reasons): triton.language's helpers and any other
    `triton.jit` function a kernel calls run interpreted, the int32 overflow sanitizer is off, and
    one-element arrays read as scalars. (flash-linear-attention's kernels on CPU run inside it too:
    model/delta_rule.py.)"""
    from triton.language import standard
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    compiled_only, options = JITFunction.__call__, interpreter.interpreter_builder.options
    patch_tensor = interpreter._patch_lang_tensor
    JITFunction.__call__ = lambda helper, *a, **k: _interpreted_body(helper.fn)(*a, **k)
    interpreter.interpreter_builder.options = replace(options, sanitize_overflow=False)
    interpreter._patch_lang_tensor = functools.partial(_patch_scalar_index, patch_tensor)
    helpers_scope = interpreter._patch_lang(standard.zeros.fn)  # the helpers' module (tl.core), once
    try:
        yield
    finally:
        helpers_scope.restore()
        interpreter._patch_lang_tensor = patch_tensor
        interpreter.interpreter_builder.options = options
        JITFunction.__call__ = compiled_only


def _patch_scalar_index(patch_tensor, tensor, scope) -> None:
    """The interpreter's tensor patches, with `__index__` reading a one-element array as a scalar:
    triton 3.6's `int(data)` fails on NumPy >= 2.4 for the shape-(1,) scalars a loop bound can be
    (`range(step_lo, step_hi)`); later triton squeezes first, as this does."""
    patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


@functools.cache
def _interpreted_body(fn):
    """`fn` rewritten for the interpreter; the launch has already patched triton.language."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn).rewrite()


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _floor_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


@dataclass(frozen=True, slots=True)
class Tuning:
    """The rule that sizes launches on one device (recorded in the provider string)."""

    block_n: int  # keys per inner step
    prefill_block_m: int  # query rows (tokens x heads of a group) per prefill program
    target_programs: int  # split keys until a launch has about this many programs
    min_segment_keys: int  # ... but never into segments shorter than this
    max_segments: int
    combine_heads: int  # heads per program of the segment merge (0: all)
    latent_block_h: int = 16  # latent attention: query heads per program ...
    latent_block_n: int = 32  # ... and keys per inner step (a [block_n, 512 + 64] latent tile)
    # batch_invariant: decodes split into segments of this many keys (a multiple of block_n), however many
    # that makes: a row's segments then depend on its own length only, not on the batch
    invariant_segment_keys: int = 2048

    def describe(self) -> str:
        return (
            f"BLOCK_N {self.block_n}, prefill BLOCK_M {self.prefill_block_m}, "
            f"split-KV <= {self.max_segments} segments of >= {self.min_segment_keys} keys, "
            f"latent {self.latent_block_h} heads x {self.latent_block_n} keys"
        )


def shared_bytes(dtype: torch.dtype, head_dim: int, block_m: int, block_n: int) -> int:
    """Shared memory of one attention program as Triton 3.9 allots it (sm_80/86/90 compiles): the Q
    tile, a K and a V tile, in fp32 the score tile, and up to 1 KiB of reduction scratch (the
    gathered loads are not pipelined, so num_stages does not change it)."""
    scores = 4 * block_m * block_n if dtype == torch.float32 else 0
    return dtype.itemsize * head_dim * (block_m + 2 * block_n) + scores + 1024


def cuda_tuning(dtype: torch.dtype, head_dim: int, num_sms: int, shared_limit: int = 227 * 1024) -> Tuning:
    """Tiles for a GPU with `num_sms` SMs and `shared_limit` bytes of shared memory per block (227
    KiB on sm_90, 163 KiB on sm_80, 99 KiB on sm_86/89): halve the key tile, then the query tile,
    until a program fits (fp32 head_dim 256 needs 136 KiB at 64x32)."""
    wide = head_dim > 128 or dtype == torch.float32
    block_m, block_n = (64 if wide else 128), (32 if head_dim > 128 and dtype == torch.float32 else 64)
    while shared_bytes(dtype, head_dim, block_m, block_n) > shared_limit and block_n > 16:
        block_n //= 2
    while shared_bytes(dtype, head_dim, block_m, block_n) > shared_limit and block_m > 16:
        block_m //= 2
    return Tuning(
        block_n=block_n,
        prefill_block_m=block_m,
        target_programs=2 * num_sms,
        min_segment_keys=256,
        max_segments=16,
        combine_heads=1,
        # Measured with ptxas (sm_90, sm_80): the largest tiles that compile without spilling at 8 warps.
        latent_block_h=16 if dtype == torch.float32 else 32,
        latent_block_n=16 if dtype == torch.float32 else 32,
    )


def tuning(device: torch.device, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128) -> Tuning:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        # Older torch builds lack the opt-in limit: assume the smallest of sm_80+ (sm_86/89).
        limit = getattr(props, "shared_memory_per_block_optin", 99 * 1024)
        return cuda_tuning(dtype, head_dim, props.multi_processor_count, limit)
    # The interpreter runs programs one by one: big tiles, and splits only as deep as tests need to cover them.
    return Tuning(
        block_n=64, prefill_block_m=64, target_programs=64, min_segment_keys=64, max_segments=4, combine_heads=0,
        invariant_segment_keys=128,
        latent_block_h=64, latent_block_n=64,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Launch:
    """One kernel launch over sequences seq_start..seq_start+num_seqs-1 (tokens token_start..+num_tokens)."""

    seq_start: int
    num_seqs: int
    token_start: int
    num_tokens: int
    block_m: int
    block_q: int
    num_segments: int
    num_warps: int
    # Scratch of the split: partial outputs, maxima and sums (None when the launch is not split).
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(compare=False)
    segment_steps: int = 0  # BLOCK_N steps per segment (batch_invariant); 0: the keys split evenly

    @property
    def num_tiles(self) -> int:
        """Query tiles the launch numbers (an upper bound: surplus programs exit at once)."""
        return (self.num_tokens - self.num_seqs) // self.block_q + self.num_seqs


def keys_read(variant, max_seq_len: int, max_query_len: int) -> int:
    """The most keys one query tile of a launch reads: its longest row's, capped by a window or a top-k."""
    keys = max_seq_len
    if variant.topk:
        keys = min(keys, variant.topk)
    if variant.sliding_window:
        keys = min(keys, variant.sliding_window + max_query_len - 1)
    return keys


def split_scratch(rows: tuple[int, int, int], value_dim: int, device) -> tuple | None:
    """A split launch's partial outputs, maxima and sums ([segments, tokens, heads(, value_dim)] fp32);
    None for one segment."""
    if rows[0] == 1:
        return None
    f32 = dict(dtype=torch.float32, device=device)
    return torch.empty(*rows, value_dim, **f32), torch.empty(rows, **f32), torch.empty(rows, **f32)


@dataclass(slots=True)
class TritonState:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    launches: list[Launch]


class TritonBackend(CascadeAttention, AttentionBackend):
    name = "triton"
    # Cascade: the suffixes through its own launches; a group's prefix one launch of cascade_prefix (its pages
    # read in place, each K/V tile once per BLOCK_R stacked rows); windows and latent attention: torch's path.
    cascade_attention = True
    quantized_kv = QUANTIZED_KV  # dequantized in the kernel, tile by tile
    cuda_graph_reason = None
    batch_invariant_reason = "split-KV: its number of key segments is chosen from the batch (sequences, longest one)"
    # batch_invariant: decodes in their own fixed tile, split into segments of a fixed number of keys; longer
    # query rows in one tile shape, unsplit (_launch)
    batch_invariant_form = True

    latent_values = True  # V tiles read the first value_dim dims of the key pages (V_DIM)
    sparse_selection = True  # the latent kernel reads the selected slots (SPARSE)

    def __init__(self, num_heads, num_kv_heads, head_dim, scale, block_size, device, dtype, variant=PLAIN,
                 batch_invariant=False):  # fmt: skip
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size, device, dtype, variant, batch_invariant)
        reason = self.unavailable_reason(device, dtype, head_dim, block_size, num_heads=num_heads, **variant.settings())
        if reason:
            raise ValueError(f"triton backend: {reason}")
        self.group = num_heads // num_kv_heads
        self.value_dim = variant.value_dim or head_dim  # latent attention: the keys' first value_dim dims
        self.latent = self.value_dim != head_dim  # absorbed MLA: its own kernel (triton_mla_kernels.py)
        self.tuning = tuning(torch.device(device), dtype, head_dim)
        self._attend, self._combine, self._latent = kernels(torch.device(device).type)
        self._compiled: set[tuple] = set()

    @classmethod
    def unavailable_reason(cls, device, dtype, head_dim, block_size, **kwargs) -> str | None:
        triton = _triton()
        if isinstance(triton, str):
            return triton
        device = torch.device(device)
        if device.type not in ("cuda", "cpu"):
            return f"Triton runs on CUDA (or interpreted on CPU), not {device.type}"
        if dtype not in DTYPES:
            return f"{dtype} is not one of fp32/fp16/bf16"
        latent = kwargs.get("value_dim") not in (None, head_dim)
        if not MIN_HEAD_DIM <= head_dim <= (MAX_LATENT_HEAD_DIM if latent else MAX_HEAD_DIM):
            return f"head_dim {head_dim} outside {MIN_HEAD_DIM}..{MAX_LATENT_HEAD_DIM if latent else MAX_HEAD_DIM}"
        if latent and (kwargs.get("num_kv_heads") or 1) != 1:
            return "latent attention reads one latent head per token"
        if kwargs.get("topk") and not latent:
            return "top-k sparse attention is in the latent (MLA) kernel only"
        if device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) < (8, 0):
            return "bf16 needs compute capability 8.0+"
        return None

    @classmethod
    def compiles_on_first_use(cls, device) -> bool:
        return torch.device(device).type == "cuda"  # Triton JITs each kernel; the CPU interpreter does not

    @classmethod
    def provider(cls, **settings) -> str:
        triton = _triton()
        if isinstance(triton, str):
            return f"none ({triton})"
        device = torch.device(settings.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
        rule = tuning(device, settings.get("dtype") or torch.bfloat16, settings.get("head_dim") or 128).describe()
        if device.type != "cuda":
            return f"triton {triton.__version__} interpreter (CPU: correct, not timed), {rule}"
        return f"triton {triton.__version__} JIT, {rule}"

    @classmethod
    def timing_caveat(cls, device) -> str | None:
        if torch.device(device).type == "cuda":
            return None
        return "Triton interpreter on CPU (numpy, one program at a time): correct, but not a kernel's speed"

    def plan(self, meta: AttentionMetadata) -> TritonState | CascadeState:
        if meta.cascade is not None:
            return self.plan_cascade_step(meta, self._plan_flat)
        return self._plan_flat(meta)

    def _plan_flat(self, meta: AttentionMetadata) -> TritonState:
        qsl, n, d = meta.query_start_loc_cpu, meta.num_seqs, meta.num_decodes
        launches = []
        if d:
            launches.append(self._launch(meta, 0, d, qsl[0], qsl[d], max_query_len=1))
        if n > d:
            launches.append(self._launch(meta, d, n - d, qsl[d], qsl[n] - qsl[d], meta.max_query_len))
        return TritonState(meta.query_start_loc, meta.seq_lens, meta.block_table, launches)

    def _launch(self, meta, seq_start, num_seqs, token_start, num_tokens, max_query_len) -> Launch:
        """Tile sizes and key segments for one launch, from host counts only (graph-stable)."""
        group_p2 = _pow2(self.group)
        t = self.tuning
        # batch-invariant: decodes keep their fixed tile (a launch of decodes only); longer rows take one shape
        short = max_query_len <= SHORT_QUERY and (not self.batch_invariant or max_query_len == 1)
        block_m = max(16, group_p2 * _pow2(max_query_len)) if short else max(t.prefill_block_m, group_p2)
        block_m = min(block_m, max(t.prefill_block_m, group_p2))
        block_q = block_m // group_p2
        if self.latent:  # a program per token and block of heads; only decodes are split
            block_m, block_q, short = min(t.latent_block_h, max(16, group_p2)), 1, max_query_len == 1
        segments, segment_steps = 1, 0
        keys = keys_read(self.variant, meta.max_seq_len, max_query_len)
        if short and self.batch_invariant:  # segments of fixed length: the count follows the longest row
            segment_steps = max(1, t.invariant_segment_keys // t.block_n)
            segments = _pow2(-(-keys // (segment_steps * t.block_n)))
        elif short:
            programs = (num_seqs + (num_tokens - num_seqs) // block_q) * self.num_kv_heads
            if self.latent:
                programs = num_tokens * -(-self.num_heads // block_m)
            wanted = _pow2(-(-t.target_programs // programs))
            segments = min(wanted, t.max_segments, _floor_pow2(keys // t.min_segment_keys))
        partials = split_scratch((segments, num_tokens, self.num_heads), self.value_dim, meta.seq_lens.device)
        warps = 8 if block_m >= 128 else 4
        return Launch(seq_start, num_seqs, token_start, num_tokens, block_m, block_q, segments, warps, partials,
                      segment_steps)  # fmt: skip

    def forward(self, q, k_cache, v_cache, state, sinks=None, kv_scales=None, selected=None):
        if isinstance(state, CascadeState) and selected is None:
            flat = lambda q, flat_state: self.forward(q, k_cache, v_cache, flat_state, sinks, kv_scales)
            return self.cascade_forward(q, k_cache, v_cache, state, flat, sinks, kv_scales)
        out = q.new_empty(*q.shape[:2], self.value_dim)  # [T, H, D_v]
        for launch in state.launches:
            if self.latent:
                self._run_latent(launch, q, k_cache, out, state, kv_scales, selected)
            else:
                self._run(launch, q, k_cache, v_cache, out, state, out if sinks is None else sinks, kv_scales)
        return out

    def constants(self, launch: Launch, page_size: int, kv_dtype: torch.dtype | None = None) -> dict:
        """The attention kernel's compile-time parameters for `launch` (pages stored as `kv_dtype`)."""
        kv_dtype = kv_dtype or self.dtype
        return dict(
            KV_SCALES=0 if kv_dtype == self.dtype else 2 if per_token_scales(kv_dtype) else 1,
            GROUP=self.group,
            GROUP_P2=_pow2(self.group),
            BLOCK_M=launch.block_m,
            BLOCK_Q=launch.block_q,
            BLOCK_N=self.tuning.block_n,
            HEAD_DIM=self.head_dim,
            HEAD_DIM_P2=max(16, _pow2(self.head_dim)),
            V_DIM=self.value_dim,
            V_DIM_P2=max(16, _pow2(self.value_dim)),
            PAGE_SIZE=page_size,
            NUM_SEGMENTS=launch.num_segments,
            SEGMENT_STEPS=launch.segment_steps,
            WINDOW=self.variant.sliding_window or 0,
            SOFTCAP=float(self.variant.softcap or 0.0),
            HAS_SINKS=self.variant.sinks,
            # The interpreter has no bf16 dot: it multiplies bf16 tiles in fp32.
            FP32_DOTS=self.dtype == torch.float32 or (self.dtype == torch.bfloat16 and self.device.type != "cuda"),
        )

    def _run(self, launch: Launch, q, k_cache, v_cache, out, state: TritonState, sinks, kv_scales) -> None:
        split = launch.partials is not None
        dummy = out  # never touched when the launch is not split (or the pages not quantized)
        part_out, part_max, part_sum = launch.partials if split else (dummy, dummy, dummy)
        k_scale, v_scale = kv_scales or (dummy, dummy)
        constants = self.constants(launch, page_size=k_cache.shape[1], kv_dtype=k_cache.dtype)
        start = time.perf_counter()
        self._attend[(launch.num_tiles, self.num_kv_heads, launch.num_segments)](
            out, q, k_cache, v_cache, state.block_table, state.query_start_loc, state.seq_lens, sinks,
            k_scale, v_scale, part_out, part_max, part_sum, self.scale,
            launch.seq_start, launch.num_seqs,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            state.block_table.stride(0), k_scale.stride(0), k_scale.stride(1), self.num_heads,
            **constants, num_warps=launch.num_warps,
        )  # fmt: skip
        if split:
            self._merge(launch, out)
        self._count_compile(tuple(constants.items()), start)

    def _merge(self, launch: Launch, out: torch.Tensor) -> None:
        """The split launch's segments into `out` (combine_segments)."""
        part_out, part_max, part_sum = launch.partials
        block_h = self.tuning.combine_heads or _pow2(self.num_heads)
        self._combine[(launch.num_tokens, -(-self.num_heads // block_h))](
            out, part_out, part_max, part_sum, launch.token_start, launch.num_tokens,
            out.stride(0), out.stride(1), self.num_heads, BLOCK_H=block_h,
            HEAD_DIM=self.value_dim, HEAD_DIM_P2=max(16, _pow2(self.value_dim)), NUM_SEGMENTS=launch.num_segments,
        )  # fmt: skip

    def latent_constants(self, launch: Launch, page_size: int, kv_dtype: torch.dtype, sparse: bool = False) -> dict:
        """The latent kernel's compile-time parameters for `launch` (pages stored as `kv_dtype`;
        `sparse`: it reads the slots selected per token)."""
        rope_dim = self.head_dim - self.value_dim
        return dict(
            SPARSE=sparse,
            TOPK=self.variant.topk or 1,
            BLOCK_H=launch.block_m,
            BLOCK_N=self.tuning.latent_block_n,
            V_DIM=self.value_dim,
            V_DIM_P2=max(16, _pow2(self.value_dim)),
            ROPE_DIM=rope_dim,
            ROPE_P2=max(16, _pow2(rope_dim)),
            PAGE_SIZE=page_size,
            NUM_SEGMENTS=launch.num_segments,
            FP32_DOTS=self.dtype == torch.float32 or (self.dtype == torch.bfloat16 and self.device.type != "cuda"),
            KV_SCALES=0 if kv_dtype == self.dtype else 2 if per_token_scales(kv_dtype) else 1,
        )

    def _run_latent(self, launch: Launch, q, cache, out, state: TritonState, kv_scales, selected=None) -> None:
        """Latent attention: one program per token x block of launch.block_m heads x key segment
        (`selected` [T, topk]: sparse attention's slots per token)."""
        split = launch.partials is not None
        part_out, part_max, part_sum = launch.partials if split else (out, out, out)
        scale = kv_scales[0] if kv_scales else out  # the latent's: its values are its first dims
        sparse = selected is not None
        chosen = selected if sparse else state.block_table  # never read when not sparse
        constants = self.latent_constants(launch, cache.shape[1], cache.dtype, sparse)
        start = time.perf_counter()
        self._latent[(launch.num_tokens, -(-self.num_heads // launch.block_m), launch.num_segments)](
            out, q, cache, state.block_table, state.query_start_loc, state.seq_lens, scale,
            part_out, part_max, part_sum, chosen, self.scale, launch.seq_start, launch.num_seqs,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), cache.stride(0), cache.stride(1),
            state.block_table.stride(0), scale.stride(0), scale.stride(1) if scale.dim() > 1 else 0,
            chosen.stride(0), self.num_heads, **constants, num_warps=LATENT_WARPS,
        )  # fmt: skip
        if split:
            self._merge(launch, out)
        self._count_compile(("latent", *constants.items()), start)

    def prefix_pass(self, q, k_cache, v_cache, g, kv_scales) -> tuple[torch.Tensor, torch.Tensor]:
        """Cascade's prefix pass: one cascade_prefix launch over the group's stacked rows, pages in place."""
        if self.variant.sliding_window is not None or self.latent:
            return super().prefix_pass(q, k_cache, v_cache, g, kv_scales)
        num_rows, group_p2 = g.rows.shape[0], _pow2(self.group)
        block_m = min(max(self.tuning.prefill_block_m, group_p2), max(16, group_p2 * _pow2(num_rows)))
        block_r = block_m // group_p2
        out = torch.empty(num_rows, self.num_heads, self.value_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_rows, self.num_heads, dtype=torch.float32, device=q.device)
        k_scale, v_scale = kv_scales or (out, out)
        constants = self.constants(Launch(0, 0, 0, 0, block_m, block_r, 1, 4, None), k_cache.shape[1], k_cache.dtype)
        constants = {name: constants[name] for name in CASCADE_CONSTANTS} | {"BLOCK_R": block_r}
        start = time.perf_counter()
        self._cascade[(-(-num_rows // block_r), self.num_kv_heads)](
            out, lse, q, g.rows, k_cache, v_cache, g.prefix_pages, k_scale, v_scale, num_rows, g.prefix_len,
            self.scale, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_scale.stride(0), k_scale.stride(1),
            self.num_heads, **constants, num_warps=8 if block_m >= 128 else 4,
        )  # fmt: skip
        self._count_compile(("cascade", *constants.items()), start)
        return out.to(q.dtype), lse

    @property
    def _cascade(self):
        """The cascade_prefix kernel, compiled (CUDA) or interpreted (CPU), built once per device type."""
        return _cascade_kernel(self.device.type)

    def _count_compile(self, key: tuple, start: float) -> None:
        """The first launch of each kernel configuration on CUDA pays its JIT compilation on the host."""
        if self.device.type == "cuda" and key not in self._compiled:
            self._compiled.add(key)
            self.compile_seconds += time.perf_counter() - start
