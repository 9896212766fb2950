"""`pagedbench kernels`: each attention backend's plan() and forward() timed apart on fragmented
block tables (random_attention_batch), over variant x phase x query length x heads x block size x
context x batch (KernelGrid). Variant gdn times a hybrid model's DeltaNet layer instead, and the dsa
variant's rows carry its indexer's time (kernels_non_attention.py).

Two yardsticks in every attention row: the device's measured copy bandwidth (what a kernel that only
streams K/V could reach) and, for plain attention, a dense row — the same attention by SDPA over
contiguous, unpaged K/V — so each backend's cost of paging is a column (`vs_dense`)."""

import itertools
import statistics
from collections import Counter
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from pagedbench.backends.base import (
    PLAIN,
    AttentionVariant,
    kv_scale_layout,
    kv_storage_dtype,
    scale_bytes_per_slot,
    write_kv,
)
from pagedbench.backends.reference import ReferenceBackend
from pagedbench.backends.registry import resolve
from pagedbench.bench.environment import environment
from pagedbench.bench.kernels_cascade import CASCADE, cascade_rows
from pagedbench.bench.kernels_non_attention import GDN, gdn_rows, indexer_columns
from pagedbench.bench.problems import PLACEMENTS, causal_mask, error_columns, random_attention_batch
from pagedbench.bench.ranks import gather_rows, grid_world
from pagedbench.bench.timing import bandwidth_columns, forward_columns, time_call, time_kernel
from pagedbench.config import LINEAR_ATTENTION_KERNELS
from pagedbench.device.dtypes import resolve_device_dtype

PHASES = ("decode", "prefill", "mixed")
MIXED_CHUNK = 512  # the prefill chunk a mixed step carries next to its decodes
DENSE = "dense-sdpa"  # the unpaged yardstick's row name
# A backend's largest |Δ| from the reference backend's output at a point (same pages, same dtype) before
# its row is a mismatch: a few units in the last place of outputs near 1 (check holds the exact oracle).
KERNEL_TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# Where backends differ (`--variants`): Gemma 3's window (Gemma 2's is 4096), Gemma 2's soft-cap, gpt-oss's sinks.
VARIANTS = {
    "plain": PLAIN,
    "window-1024": AttentionVariant(sliding_window=1024),
    "softcap-50": AttentionVariant(softcap=50.0),
    "sinks": AttentionVariant(sinks=True),
    "gpt-oss": AttentionVariant(sliding_window=128, sinks=True),  # its windowed layers (--heads 64/8 --head-dim 64)
    # DeepSeek-V3's latent attention, absorbed: with --heads 128/1 (16/1 a TP-8 rank) --head-dim 576
    # --block-sizes 64, each query head meets the one latent whose first 512 dims are the values.
    "latent-512": AttentionVariant(value_dim=512),
    # DeepSeek-V3.2's sparse attention over that latent: each query reads the 2,048 tokens an indexer
    # picked (64 heads of 128 score them; `indexer` columns time that apart). Decode and mixed points only.
    "dsa": AttentionVariant(value_dim=512, topk=2048),
}


@dataclass(slots=True)
class KernelGrid:
    batch_sizes: list[int]
    context_lens: list[int]
    block_sizes: list[int]
    heads: list[tuple[int, int]]  # (query heads, KV heads)
    head_dim: int
    phases: list[str]
    max_kv_tokens: int  # grid points holding more tokens than this are skipped (memory) ...
    max_query_tokens: int  # ... and so are those with more query tokens (prefill time)
    warmup: int
    repeats: int
    variants: list[str] = field(default_factory=lambda: ["plain"])  # names in VARIANTS
    # Query tokens per decoding sequence: 1, or k + 1 when it verifies k speculated tokens.
    query_lens: list[int] = field(default_factory=lambda: [1])
    # How pages are stored (kv_cache_dtype): each backend that reads quantized pages is timed on them too.
    kv_cache_dtypes: list[str] = field(default_factory=lambda: ["auto"])
    # Time each backend's forward captured in a CUDA graph and replayed, as the engine's decode
    # graphs run it: small batches then measure kernels, not a Python launch.
    cuda_graphs: bool = False
    # Variant gdn: the gated delta rule's kernels timed (EngineConfig.linear_attention_kernel's names).
    linear_kernels: list[str] = field(default_factory=lambda: ["torch"])
    # Engine-shaped problems: the cache's pages (the engine's whole cache as the K/V view; None: the
    # problem's and a few spare) and where a problem's pages lie (problems.PLACEMENTS).
    cache_blocks: int | None = None
    placement: str = "random"
    # EngineConfig.batch_invariant: each backend in its batch-invariant form; one without it is unavailable.
    batch_invariant: bool = False
    # Variant cascade: each sequence's own tokens after the group's shared prefix (kernels_cascade.py).
    suffix_lens: list[int] = field(default_factory=lambda: [64])

    def validate(self) -> None:
        for name in ("batch_sizes", "context_lens", "block_sizes", "query_lens", "suffix_lens"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be a non-empty list of integers >= 1, got {values}")
        for num_heads, num_kv_heads in self.heads:
            if min(num_heads, num_kv_heads) < 1 or num_heads % num_kv_heads:
                raise ValueError(f"heads {num_heads}/{num_kv_heads}: query heads must be a multiple of KV heads")
        for kv in self.kv_cache_dtypes:
            kv_storage_dtype(kv, torch.float32)  # an unknown name fails here, naming the known ones
        if not self.variants or set(self.variants) - {*VARIANTS, GDN, CASCADE}:
            known = ", ".join([*VARIANTS, GDN, CASCADE])
            raise ValueError(f"variants must be among {known}, got {', '.join(self.variants)}")
        if GDN in self.variants and (
            not self.linear_kernels or set(self.linear_kernels) - set(LINEAR_ATTENTION_KERNELS)
        ):
            known, got = ", ".join(LINEAR_ATTENTION_KERNELS), ", ".join(self.linear_kernels)
            raise ValueError(f"linear kernels must be among {known}, got {got}")
        unknown = set(self.phases) - set(PHASES)
        if unknown or not self.phases:
            raise ValueError(f"phases must be among {', '.join(PHASES)}, got {', '.join(self.phases)}")
        for name in self.variants:
            value_dim = VARIANTS.get(name, PLAIN).value_dim
            if value_dim is not None and (self.head_dim <= value_dim or any(kv != 1 for _, kv in self.heads)):
                raise ValueError(
                    f"variant {name}: latent attention needs one KV head (--heads H/1) and "
                    f"--head-dim > {value_dim} (DeepSeek-V3: 576), got {self.head_dim}"
                )
        if self.placement not in PLACEMENTS or self.cache_blocks is not None and self.cache_blocks < 2:
            raise ValueError(f"placement must be among {', '.join(PLACEMENTS)} and cache_blocks >= 2")
        if min(self.head_dim, self.max_kv_tokens, self.max_query_tokens, self.repeats) < 1 or self.warmup < 0:
            raise ValueError("head_dim, max_kv_tokens, max_query_tokens and repeats must be >= 1, warmup >= 0")

    def points(self):
        """(variant, phase, query len, (heads, kv heads), block size, context, batch) within the
        token limits (prefill points only at query length 1: they have no decoding rows)."""
        for point in itertools.product(
            self.variants,
            self.phases,
            self.query_lens,
            self.heads,
            self.block_sizes,
            self.context_lens,
            self.batch_sizes,
        ):
            if point[1] == "prefill" and point[2] != 1 or point[2] > point[5]:
                continue
            if point[0] == CASCADE and point[1] != "decode":
                continue  # a group's decodes (multi-token too) over its shared prefix
            if point[0] == GDN and (point[2] != 1 or point[4] != self.block_sizes[0]):
                continue  # a DeltaNet layer has no pages, and speculative decoding is refused on hybrid models
            if point[1] == "prefill" and VARIANTS.get(point[0], PLAIN).topk is not None:
                continue  # a random selection per prompt token is too slow to draw at these lengths
            spec = batch_spec(point[1], point[6], point[5], point[2])
            if sum(map(sum, spec)) <= self.max_kv_tokens and sum(q for _, q in spec) <= self.max_query_tokens:
                yield point


GRID_PRESETS = {
    "cpu": KernelGrid(
        batch_sizes=[1, 4],
        context_lens=[256, 1024],
        block_sizes=[16],
        heads=[(16, 8)],
        head_dim=64,
        phases=list(PHASES),
        max_kv_tokens=8192,
        max_query_tokens=4096,
        warmup=2,
        repeats=7,
    ),
    "gpu": KernelGrid(
        batch_sizes=[1, 16, 64, 256],
        context_lens=[512, 2048, 8192, 16384],
        block_sizes=[16, 128, 256],
        heads=[(16, 8), (32, 8)],
        head_dim=128,
        phases=list(PHASES),
        max_kv_tokens=1 << 19,
        max_query_tokens=1 << 15,
        warmup=3,
        repeats=20,
    ),
}


def batch_spec(phase: str, batch_size: int, context_len: int, query_len: int = 1) -> list[tuple[int, int]]:
    """(cached tokens, new tokens) per sequence, decodes first, every sequence ending at
    `context_len`; a decoding sequence runs `query_len` tokens (a speculative verify: k + 1)."""
    decodes = [(context_len - query_len, query_len)] * batch_size
    if phase == "decode":
        return decodes
    if phase == "prefill":
        return [(0, context_len)] * batch_size
    chunk = min(MIXED_CHUNK, context_len)
    return decodes + [(context_len - chunk, chunk)]


def attention_flops(
    spec: list[tuple[int, int]], num_heads: int, head_dim: int, window: int | None = None, value_dim: int | None = None
) -> int:
    """QK^T and PV over the visible keys (causal, within the window): 2 * H * (D + D_v) per (query, key) pair."""
    if window is None:
        pairs = sum(q * ctx + q * (q + 1) // 2 for ctx, q in spec)
    else:  # the query at position p sees min(p + 1, window) keys
        pairs = sum(int(torch.arange(ctx, ctx + q).add(1).clamp(max=window).sum()) for ctx, q in spec)
    return 2 * num_heads * (head_dim + (value_dim or head_dim)) * pairs


def visible_kv_tokens(spec: list[tuple[int, int]], window: int | None = None) -> int:
    """Keys some query of each sequence sees: all of them, or those within the first query's window on."""
    return sum(c + q if window is None else min(c + q, window + q - 1) for c, q in spec)


def dense_calls(spec: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, dtype, device):
    """The point's attention without paging: one SDPA call per group of alike sequences, over
    contiguous [n, H_kv, cached + new, D] K/V (decodes need no mask, whole prompts are causal,
    a chunk after cached tokens gets a bottom-right causal mask)."""
    calls = []
    for (cached, new), n in sorted(Counter(spec).items()):
        q = torch.randn(n, num_heads, new, head_dim, dtype=dtype, device=device)
        k, v = (torch.randn(n, num_kv_heads, cached + new, head_dim, dtype=dtype, device=device) for _ in "kv")
        mask = causal_mask(cached, new, device) if new > 1 and cached else None
        calls.append((q, k, v, mask, new > 1 and not cached))
    return calls


def dense_forward(calls, scale: float) -> None:
    for q, k, v, mask, causal in calls:
        F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )


def run_kernels(
    backends: list[str], grid: KernelGrid, device: str | None = None, dtype: str | None = None, rows: list | None = None
) -> list[dict]:
    """One row per backend x grid point: min and median of plan and forward, bandwidth, TFLOP/s.
    Rows are appended to `rows` (a report.CsvLog writes each one out) as they are measured; under
    torchrun each rank times every world-th point and rank 0 appends every rank's, in grid order."""
    grid.validate()
    dev, dt = resolve_device_dtype(device, dtype)
    if grid.cuda_graphs and dev.type != "cuda":
        raise ValueError(f"--cuda-graphs captures CUDA graphs: it needs a CUDA device (device is {dev})")
    columns = {**environment(dev, dt), **bandwidth_columns(dev)}  # every row's
    points = list(grid.points())
    if not points:
        raise ValueError("every grid point exceeds max_kv_tokens or max_query_tokens")
    rows = [] if rows is None else rows
    rank, world = grid_world()
    mine: dict[int, list[dict]] = {}  # under torchrun: this rank's rows, by point
    for index, point in enumerate(tqdm(points, desc="kernels", disable=None)):
        if index % world != rank:
            continue
        out = rows if world == 1 else mine.setdefault(index, [])
        variant, phase, query_len, (num_heads, num_kv_heads), _, context_len, batch_size = point
        spec = batch_spec(phase, batch_size, context_len, query_len)
        if variant == GDN:
            shape = (phase, batch_size, context_len, num_heads, num_kv_heads)
            out += gdn_rows(spec, shape, grid, dev, dt, columns)
        elif variant == CASCADE:
            cascade_rows(point, backends, grid, dev, dt, columns, out, (_shape_columns, _cascade_row))
        else:
            _attention_rows(point, spec, backends, grid, dev, dt, columns, out)
    if world > 1:
        rows += gather_rows(mine) or []
    return rows


def _attention_rows(grid_point, spec, backends: list[str], grid: KernelGrid, dev, dt, columns: dict, out) -> None:
    """One attention point's rows, appended to `out` as each is measured: the dense yardstick (plain
    variant only: it computes plain attention), then each page dtype x backend."""
    variant_name, phase, query_len, (num_heads, num_kv_heads), block_size, context_len, batch_size = grid_point
    variant = VARIANTS[variant_name]
    point = {
        **columns,
        "variant": variant_name,
        "phase": phase,
        "query_len": query_len,
        "batch_size": batch_size,
        "context_len": context_len,
        "block_size": block_size,
        "placement": grid.placement,
        "cache_blocks": grid.cache_blocks,
        "batch_invariant": grid.batch_invariant,
        **_shape_columns(spec, num_heads, num_kv_heads, grid, dt, variant),
    }
    dense_ms = float("nan")
    if variant == PLAIN:
        dense = _dense_row(spec, point, grid, dev, dt)
        out.append({"backend": DENSE, "provider": f"torch {torch.__version__} SDPA, unpaged", **dense})
        dense_ms = dense["forward_median_ms"]
    batch, pages, expected = None, {}, {}
    for kv, name in itertools.product(grid.kv_cache_dtypes, backends):
        found = resolve(
            name, dev, dt, grid.head_dim, block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
            kv_cache_dtype=kv, **variant.settings(),
        )  # fmt: skip
        stored = {"kv_cache_dtype": kv, "kv_bytes": round(point["kv_bytes"] * kv_bytes_per_slot(kv, dt, grid))}
        head = {"backend": name, "provider": found.provider, **point, **stored}
        reason = found.reason or refused_under_batch_invariance(found.cls, grid, dev, dt, block_size, variant)
        if reason:
            out.append({**head, "status": "unavailable", "reason": reason})
            continue
        if batch is None:  # built once per point, shared by the backends
            batch = random_attention_batch(
                spec, num_heads, num_kv_heads, grid.head_dim, block_size, dt, dev,
                value_dim=variant.value_dim, topk=variant.topk, cache_blocks=grid.cache_blocks,
                placement=grid.placement,
            )  # fmt: skip
            if variant.topk is not None:  # the selection's time, the same for every backend of the point
                indexer = indexer_columns(batch, variant.topk, grid, dev, dt)
                point.update(indexer)
                head.update(indexer)
        if kv not in pages:  # the same K/V stored as `kv`, and the reference backend's output over it
            pages[kv] = quantized_pages(batch, kv)
            backend, forward = _forward_of(ReferenceBackend, batch, head, grid, dev, dt, variant, pages[kv])
            expected[kv] = forward(backend.plan(batch.metadata))
        out.append(_backend_row(found.cls, batch, head, grid, dev, dt, variant, dense_ms, pages[kv], expected[kv]))


def refused_under_batch_invariance(cls, grid: KernelGrid, device, dtype, block_size: int, variant) -> str | None:
    """Why `cls` has no batch-invariant form here, when the grid asks for one (--batch-invariant)."""
    if not grid.batch_invariant:
        return None
    why = cls.batch_invariance(device, batch_invariant=True, dtype=dtype, head_dim=grid.head_dim,
                               block_size=block_size, **variant.settings())  # fmt: skip
    return why and f"refused under batch_invariant: {why}"


def kv_bytes_per_slot(kv_cache_dtype: str, dtype: torch.dtype, grid: KernelGrid) -> float:
    """Bytes one K or V value takes as stored, relative to `dtype` (int8 adds its fp16 scale per head)."""
    storage = kv_storage_dtype(kv_cache_dtype, dtype)
    scale = scale_bytes_per_slot(storage) / grid.head_dim
    return (storage.itemsize + scale) / dtype.itemsize


def quantized_pages(batch, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
    """(K pages, V pages, their scales) of `batch` stored as `kv_cache_dtype` (write_kv's rule, scale
    1.0 for fp8); the batch's own pages for "auto"."""
    storage = kv_storage_dtype(kv_cache_dtype, batch.k_cache.dtype)
    if storage == batch.k_cache.dtype:
        return batch.k_cache, batch.v_cache, None
    num_blocks, page, heads, dim = batch.k_cache.shape
    device = batch.k_cache.device
    scale_shape, scale_dtype = kv_scale_layout(storage, batch.k_cache.shape)
    slots = torch.arange(num_blocks * page, device=device)
    if batch.v_cache.shape[-1] < dim:  # latent attention: one plane and one scale, the values a view
        k = torch.empty_like(batch.k_cache, dtype=storage)
        scale = torch.ones(scale_shape, dtype=scale_dtype, device=device)
        write_kv(batch.k_cache.view(-1, heads, dim), None, k, k, slots, (scale, scale))
        return k, k[..., : batch.v_cache.shape[-1]], (scale, scale)
    scales = tuple(torch.ones(scale_shape, dtype=scale_dtype, device=device) for _ in range(2))
    k, v = (torch.empty_like(batch.k_cache, dtype=storage) for _ in range(2))
    write_kv(batch.k_cache.view(-1, heads, dim), batch.v_cache.view(-1, heads, dim), k, v, slots, scales)
    return k, v, scales


def _dense_row(spec, point: dict, grid: KernelGrid, device: torch.device, dtype: torch.dtype) -> dict:
    try:
        return {**point, **_time_dense(spec, point, grid, device, dtype)}
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {**point, "status": "failed", "reason": "out of device memory", "forward_median_ms": float("nan")}


def _backend_row(cls, batch, head: dict, grid: KernelGrid, device, dtype, variant, dense_ms: float, pages, expected):
    """One backend's timed row at one point (an interpreted backend's once, with its caveat), with its
    error against the reference backend's output `expected`: status mismatch beyond KERNEL_TOLERANCE."""
    caveat = cls.timing_caveat(device)
    # An interpreted backend's times say nothing of a kernel's speed: one call, no warm-up.
    timing = replace(grid, warmup=0, repeats=1) if caveat else grid
    try:
        timed = _time_backend(cls, batch, head, timing, device, dtype, variant, pages)
        backend, forward = _forward_of(cls, batch, head, grid, device, dtype, variant, pages)
        output = forward(backend.plan(batch.metadata))  # untimed, on a backend of its own
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {**head, "status": "failed", "reason": "out of device memory"}
    timed["vs_dense"] = timed["forward_median_ms"] / dense_ms
    counts = {"warmup": timing.warmup, "repeats": timing.repeats}
    errors, tol = error_columns(output, expected), KERNEL_TOLERANCE[dtype]
    if not errors["max_abs_error"] <= tol:  # NaN too
        mismatch = f"error {errors['max_abs_error']:.3g} > tolerance {tol:g} against reference"
        return {**head, "status": "mismatch", "reason": "; ".join(filter(None, [mismatch, caveat])), **timed,
                **counts, **errors}  # fmt: skip
    return {**head, "status": "ok", "reason": caveat or "", **timed, **counts, **errors}


def _cascade_row(cls, batch, head: dict, grid: KernelGrid, device, dtype, expected) -> dict:
    """A cascade point's backend row (plain attention, pages as the batch's): timed and checked as any other."""
    return _backend_row(cls, batch, head, grid, device, dtype, PLAIN, float("nan"), None, expected)


def _shape_columns(
    spec, num_heads: int, num_kv_heads: int, grid: KernelGrid, dtype: torch.dtype, variant: AttentionVariant = PLAIN
) -> dict:
    """Heads, the bytes of K/V (latent attention: of the one latent plane) and the FLOPs one forward
    of `spec` must move and do (only the keys within a window count), and the timing."""
    window, value_dim = variant.sliding_window, variant.value_dim
    kv_tokens = visible_kv_tokens(spec, window)
    flops = attention_flops(spec, num_heads, grid.head_dim, window, value_dim)
    if variant.topk is not None:  # sparse: each query reads only its picks (min(topk, past) tokens)
        reads = sum(min(variant.topk, p + 1) for ctx, q in spec for p in range(ctx, ctx + q))
        kv_tokens = reads
        flops = 2 * num_heads * (grid.head_dim + value_dim) * reads
    planes = 1 if value_dim is not None else 2
    return {
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": grid.head_dim,
        "num_query_tokens": sum(q for _, q in spec),
        "kv_bytes": planes * kv_tokens * num_kv_heads * grid.head_dim * dtype.itemsize,
        "flops": flops,
        "warmup": grid.warmup,
        "repeats": grid.repeats,
    }


def _forward_of(cls, batch, point: dict, grid: KernelGrid, device, dtype, variant=PLAIN, pages=None) -> tuple:
    """(a `cls` backend for the point, its forward(state) over the batch's pages as stored)."""
    args = (point["num_heads"], point["num_kv_heads"], grid.head_dim, grid.head_dim**-0.5, point["block_size"])
    extra = {} if variant == PLAIN else {"variant": variant}  # backends that predate variants take none
    extra |= {"batch_invariant": True} if grid.batch_invariant else {}
    backend = cls(*args, device, dtype, **extra)
    sinks = {}
    if variant.sinks:  # logits of the scores' size, fixed per point
        sinks = {"sinks": torch.randn(point["num_heads"], generator=torch.Generator().manual_seed(0)).to(device)}

    k_cache, v_cache, scales = pages or (batch.k_cache, batch.v_cache, None)
    quantized = {} if scales is None else {"kv_scales": scales}

    selected = {} if batch.selected is None else {"selected": batch.selected}

    def forward(state):
        return backend.forward(batch.q, k_cache, v_cache, state, **sinks, **quantized, **selected)

    return backend, forward


def _time_backend(cls, batch, point: dict, grid: KernelGrid, device, dtype, variant=PLAIN, pages=None) -> dict:
    backend, forward = _forward_of(cls, batch, point, grid, device, dtype, variant, pages)
    state = backend.plan(batch.metadata)
    if grid.warmup:
        forward(state)  # a JIT-compiling first call is never timed
    plan = time_call(lambda: backend.plan(batch.metadata), device, grid.warmup, grid.repeats)
    state = backend.plan(batch.metadata)
    timed, graphed = (lambda: forward(state)), ""
    if grid.cuda_graphs:
        timed, graphed = _graphed(forward, state, backend)
    forward_times = time_kernel(timed, device, grid.warmup, grid.repeats)
    efficiency = getattr(backend, "tile_efficiency", None)  # flex: share of computed scores its mask keeps
    return {
        "plan_min_ms": 1e3 * min(plan),
        "plan_median_ms": 1e3 * statistics.median(plan),
        **forward_columns(forward_times, point),
        "tile_efficiency": efficiency(state) if efficiency else float("nan"),
        # flex on CUDA: the decode kernel options it ran with (searched per batch, or the defaults)
        "kernel_options": getattr(backend, "decode_options_used", ""),
        "cuda_graphs": graphed or ("replayed" if grid.cuda_graphs else "off"),
    }


def _graphed(forward, state, backend) -> tuple:
    """(a replay of `forward(state)` captured in a CUDA graph, "") or, where capture fails (a host
    sync in the forward, say), (the eager call, "not graphed: why")."""
    try:
        forward(state)  # lazy initialisation and JIT compiles happen outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward(state)
    except Exception as e:  # a backend that cannot be captured is timed eagerly, and says so
        torch.cuda.synchronize()
        return (lambda: forward(state)), f"not graphed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    backend._graph_keepalive = (graph, out, state)  # what the replays write must outlive the capture
    return graph.replay, ""


def _time_dense(spec, point: dict, grid: KernelGrid, device: torch.device, dtype: torch.dtype) -> dict:
    calls = dense_calls(spec, point["num_heads"], point["num_kv_heads"], grid.head_dim, dtype, device)
    forward = time_kernel(lambda: dense_forward(calls, grid.head_dim**-0.5), device, grid.warmup, grid.repeats)
    return {"status": "ok", "reason": "", **forward_columns(forward, point), "vs_dense": 1.0}
