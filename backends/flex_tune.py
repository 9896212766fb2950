"""flex's decode kernel options, chosen per device and shape by a small search, cached on disk.

PyTorch's decoding template caps its KV tile at the BlockMask's block size, defaults to one stage
and two warps, and splits a row's KV across thread blocks only until the SMs hold two programs
each (SPLIT_KV collapses to 1 at batch 64 with 8 KV heads on 132 SMs). Those are `kernel_options`
(SPLIT_KV, num_stages, num_warps, BLOCK_N), so the first decode call of each `DecodeShape` times a
few of them and keeps the fastest: a coordinate search (split, then stages, then warps, then the
tile), about a dozen compiles, counted as compile time, within PAGEDBENCH_FLEX_TUNE_SECONDS (45).

What is timed is a representative problem, never the call's own rows (a CUDA graph's warm-up runs
1-page padding rows): the call's static batch and query length, every row at the top of the call's
context class, in the engine's whole cache (the call's K/V), each row's pages in order as the block
manager allocates them. A context class is the power of two of pages at or above the call's longest
context (at least MIN_CONTEXT_PAGES; capped where the batch would outgrow the cache); a decode-only
step's is its max_seq_len's, which a captured graph sets to the longest context it serves. Candidates
compile in their own wrapper (`flex_compile.attend_candidate`), dropped after the search, and a search
never runs inside a CUDA-graph capture (the defaults run there, with a note).

The result is kept in a JSON file (PAGEDBENCH_CACHE_DIR, else ~/.cache/pagedbench) under a key of
everything that changes the winner (`DecodeShape.key`: GPU, torch and triton versions, heads, KV
heads, head dim, page size, dtype, batch, query length, context class, cache class); entries of an
older key format are dropped when read. PAGEDBENCH_FLEX_TUNE=0 turns the search off (the template's
defaults and our BLOCK_N cap run); the provider string says which, the kernels report's
`kernel_options` column names the options. `repeat_search` runs one search several times, uncached,
to show its result reproduces (`agree`). `DecodeTuner` keeps a backend's options per problem.
"""

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from pagedbench.backends.flex_compile import (
    attend,
    attend_candidate,
    attend_compiling,
    compile_enabled,
    forget_candidates,
    kernel_choice,
)
from pagedbench.backends.flex_masks import PagedBlockMasks
from pagedbench.backends.flex_plan import CallPlan, device_arrays, plan_decode
from torch.nn.attention.flex_attention import BlockMask

from pagedbench import envs

logger = logging.getLogger(__name__)

CACHE_FILE = "flex-decode-options.json"
KEY_FORMAT = "v2"  # the first field of DecodeShape.key; entries without it (an older key's) are dropped
STAGES = (1, 2, 3, 4)
WARPS = (2, 4, 8)
MAX_SPLIT = 64
MIN_CONTEXT_PAGES = 4  # the least context class: a search never times rows of one page


def tune_enabled() -> bool:
    return envs.enabled("PAGEDBENCH_FLEX_TUNE")


def tune_budget() -> float:
    """PAGEDBENCH_FLEX_TUNE_SECONDS: the most one shape's search may take (each candidate is a
    compile of a few seconds on a GPU); the best found by then is kept."""
    return float(envs.get("PAGEDBENCH_FLEX_TUNE_SECONDS"))


def cache_path():
    return envs.cache_dir() / CACHE_FILE


def power_of_two_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def context_class(context_tokens: int, page_size: int) -> int:
    """The context class of a decode call whose longest row holds `context_tokens`: the power of two
    of pages at or above it, at least MIN_CONTEXT_PAGES."""
    return max(MIN_CONTEXT_PAGES, power_of_two_at_least(-(-context_tokens // page_size)))


def decode_context_class(plan: CallPlan, num_calls: int, max_seq_len: int, page_size: int) -> int:
    """A decode call's context class: a decode-only step's max_seq_len (a captured graph's is the longest
    context it serves, its rows being 1-page padding), else its own rows' longest context; 0 for a prefill."""
    if plan.kind != "decode":
        return 0
    tokens = max_seq_len if num_calls == 1 else int(plan.host.mask_pos.max()) + 1
    return context_class(tokens, page_size)


class DecodeProblem(NamedTuple):
    """What a decode call's best options depend on besides the model and device: the search's problem."""

    batch: int  # the static decode batch (a power of two)
    query_len: int  # query tokens per row (1, or a short multi-token decode's 2, 4, 8)
    context_pages: int  # its context class (`context_class`)
    cache_pages: int  # pages in the engine's cache, which the call's K/V view spans

    @property
    def row_pages(self) -> int:
        """Pages of each representative row: the class, or as many as the cache holds for every row."""
        return min(self.context_pages, max(MIN_CONTEXT_PAGES, self.cache_pages // self.batch))


@dataclass(frozen=True, slots=True)
class DecodeShape:
    """The on-disk key of a search: everything that changes its winner."""

    gpu: str
    torch_version: str
    triton_version: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    batch: int  # the static decode batch (a power of two)
    query_len: int
    context_pages: int  # the context class
    cache_pages: int  # the cache's size class: the power of two of pages at or above it

    @property
    def key(self) -> str:
        return "|".join(map(str, (KEY_FORMAT, *(getattr(self, name) for name in self.__slots__))))


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def kernels_provider(device, sinks: bool = False) -> str:
    """The provider string of flex's kernels on `device` (None: unsaid): compiled or eager, FA4 prefill
    kernels where chosen, and on CUDA whether decode options are tuned."""
    cpu = device is not None and torch.device(device).type == "cpu"
    mode = "compiled" if compile_enabled() else "eager"
    if mode == "compiled" and sinks and cpu:
        mode = "eager (sinks need the log-sum-exp compiled CPU flex lacks)"
    try:
        flash = kernel_choice() == "flash" and (device is None or torch.device(device).type == "cuda")
    except ValueError:
        flash = False
    text = f"torch {torch.__version__} flex {mode}" + (", FA4 prefill kernels (BACKEND=FLASH)" if flash else "")
    if mode == "compiled" and device is not None and torch.device(device).type == "cuda":
        text += ", decode options tuned per batch" if tune_enabled() else ", decode options untuned"
    return text


def split_choices(num_sms: int, batch: int, num_kv_heads: int) -> list[int]:
    """SPLIT_KV candidates: powers of two from 1 up to what fills every SM twice (at most MAX_SPLIT)."""
    fill = max(1, -(-2 * num_sms // (batch * num_kv_heads)))
    splits = [1]
    while splits[-1] < min(fill, MAX_SPLIT):
        splits.append(splits[-1] * 2)
    return splits


def tile_choices(kv_block: int) -> list[int]:
    """BLOCK_N candidates: powers of two from 16 that divide the KV block (the template caps the tile there)."""
    return [n for n in (16, 32, 64, 128) if n <= kv_block and kv_block % n == 0]


def decode_axes(shape: DecodeShape, kv_block: int, num_sms: int) -> list[tuple[str, list]]:
    return [
        ("SPLIT_KV", split_choices(num_sms, shape.batch, shape.num_kv_heads)),
        ("num_stages", list(STAGES)),
        ("num_warps", list(WARPS)),
        ("BLOCK_N", tile_choices(kv_block)),
    ]


class Found(NamedTuple):
    """A search's result: the winner, its time, and every candidate's time (by `options_key`)."""

    options: dict
    seconds: float
    timings: dict[tuple, float]


def options_key(options: dict) -> tuple:
    return tuple(sorted(options.items()))


def coordinate_search(
    base: dict, axes: list[tuple[str, list]], seconds: Callable[[dict], float], budget_s: float = float("inf")
) -> Found:
    """Coordinate search: each axis in turn, its values tried with the best found so far, until
    `budget_s` seconds have passed (the best so far is kept). `seconds(options)` times one
    candidate (inf: it failed)."""
    best, best_time, timed = dict(base), float("inf"), {}
    deadline = time.perf_counter() + budget_s
    for name, values in axes:
        for value in values:
            if timed and time.perf_counter() > deadline:
                return Found(best, best_time, timed)
            options = best | {name: value}
            key = options_key(options)
            if key not in timed:
                timed[key] = seconds(options)
            if timed[key] < best_time:
                best, best_time = options, timed[key]
    return Found(best, best_time, timed)


def search(
    base: dict, axes: list[tuple[str, list]], seconds: Callable[[dict], float], budget_s: float = float("inf")
) -> tuple[dict, int]:
    """`coordinate_search`'s (best options, candidates timed)."""
    found = coordinate_search(base, axes, seconds, budget_s)
    return found.options, len(found.timings)


def agree(a: Found, b: Found, tolerance: float = 0.1) -> bool:
    """Two searches of one problem agree within noise: the same winner, or winners as fast within
    `tolerance` (candidates that fast are alike to the search: which one wins is the noise's choice)."""
    if a.options == b.options:
        return True
    return a.seconds <= b.seconds * (1 + tolerance) and b.seconds <= a.seconds * (1 + tolerance)


class DecodeOptionsCache:
    """The searched options by DecodeShape.key, read once and rewritten after each search."""

    def __init__(self, path=None):
        self.path = path or cache_path()
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            entries = {}
        prefix = KEY_FORMAT + "|"  # an older key format's entries would misname their shapes: dropped
        self.entries: dict[str, dict] = {k: v for k, v in entries.items() if k.startswith(prefix)}

    def get(self, shape: DecodeShape) -> dict | None:
        return self.entries.get(shape.key)

    def put(self, shape: DecodeShape, options: dict) -> None:
        self.entries[shape.key] = options
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.entries, indent=1, sort_keys=True))
            tmp.replace(self.path)  # never a half-written file for another process
        except OSError as e:
            logger.warning("flex: the tuned options are not cached (%s): %s", self.path, e)


def tuned_decode_options(
    shape: DecodeShape,
    base: dict,
    kv_block: int,
    num_sms: int,
    seconds: Callable[[dict], float],
    cache: DecodeOptionsCache,
) -> tuple[dict, float]:
    """(options, search seconds) for `shape`: the cached ones, else a search timed by `seconds`."""
    found = cache.get(shape)
    if found is not None:
        return found, 0.0
    start = time.perf_counter()
    best = coordinate_search(base, decode_axes(shape, kv_block, num_sms), seconds, tune_budget())
    spent = time.perf_counter() - start
    logger.info("flex: tuned the decode kernel for batch %d at %d pages in %.1f s (%d candidates): %s",
                shape.batch, shape.context_pages, spent, len(best.timings), describe(best.options))  # fmt: skip
    cache.put(shape, best.options)
    return best.options, spent


def representative_mask(masks: PagedBlockMasks, problem: DecodeProblem, page_size: int, full_blocks: bool) -> BlockMask:
    """The BlockMask of `problem`'s representative decode: `batch` rows of `query_len` new tokens, each
    `row_pages` pages long, their pages in order over the cache as the block manager allocates them."""
    b, q, pages = problem.batch, problem.query_len, problem.row_pages
    qsl = np.arange(b + 1, dtype=np.int64) * q
    ctx = np.full(b, max(pages * page_size - q, 0), dtype=np.int64)
    plan = plan_decode(np.arange(b), qsl, ctx, page_size, full_blocks, static_batch=True)
    arrays = device_arrays([plan], masks.device)[0]
    table = torch.arange(b * pages, dtype=torch.int32, device=masks.device).remainder_(problem.cache_pages)
    listing = masks.row_pages(plan, arrays, table.view(b, pages))
    masks.fill_inverse([listing], b, problem.cache_pages, full_too=False)
    return masks.block_mask(plan, arrays, listing, problem.cache_pages)


# measure(args_for, recompile_limit) -> seconds(options): how a search times its candidates, where
# `args_for(options)` is a candidate's `attend` arguments.
Measure = Callable[[Callable[[dict], tuple], int], Callable[[dict], float]]


def compiled_cuda_timer(args_for: Callable[[dict], tuple], recompile_limit: int) -> Callable[[dict], float]:
    """Each candidate compiled in the candidates' own wrapper and timed as do_bench times a kernel."""

    def seconds(options: dict) -> float:
        args = args_for(options)
        try:
            attend_compiling("decode", args, recompile_limit, attend_candidate)
        except Exception as e:  # a candidate the template cannot build (shared memory, tile)
            logger.debug("flex: decode candidate %s failed: %s", options, e)
            return float("inf")
        return cuda_seconds(lambda: attend_candidate(*args))

    return seconds


def eager_cpu_timer(
    args_for: Callable[[dict], tuple], recompile_limit: int, repeats: int = 5
) -> Callable[[dict], float]:
    """Each candidate run by eager flex, its least CPU time of `repeats` (a CPU's real timing, in the
    process's CPU seconds: time other processes take from shared cores is not counted; the CPU kernel
    takes no options, so candidates differ only by noise)."""

    def seconds(options: dict) -> float:
        args = args_for(options)
        attend(*args)  # a shape's first call pays for eager flex's set-up
        times = []
        for _ in range(repeats):
            start = time.process_time()
            attend(*args)
            times.append(time.process_time() - start)
        return min(times)

    return seconds


class DecodeTuner:
    """A backend's decode options per `DecodeProblem`: searched the first time one is met, on its
    representative problem (module docstring), never inside a CUDA-graph capture."""

    def __init__(
        self,
        device: torch.device,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        kv_block: int,
        new_masks: Callable[[], PagedBlockMasks],
        full_blocks: bool = False,
        measure: Measure = compiled_cuda_timer,
    ):
        self.device, self.kv_block, self.dtype = device, kv_block, dtype
        self.heads = (num_heads, num_kv_heads, head_dim, page_size)
        self.new_masks, self.full_blocks, self.measure = new_masks, full_blocks, measure
        self.chosen: dict[DecodeProblem, dict] = {}
        self._noted_capture = False

    def shape(self, problem: DecodeProblem) -> DecodeShape:
        gpu = current_gpu(self.device)[0]
        dtype = str(self.dtype).removeprefix("torch.")
        cache = power_of_two_at_least(problem.cache_pages)
        return DecodeShape(gpu, torch.__version__, triton_version(), *self.heads, dtype, problem.batch,
                           problem.query_len, problem.context_pages, cache)  # fmt: skip

    def options(self, problem: DecodeProblem, base: dict, operands: tuple, recompile_limit: int) -> tuple[dict, float]:
        """(the options of `problem`, seconds spent searching them); `operands`: the call's (k, v, scale,
        score_mod, sinks), whose K/V (the engine's cache) the representative problem reads."""
        found = self.chosen.get(problem)
        if found is not None:
            return found, 0.0
        if capturing():
            if not self._noted_capture:
                logger.info("flex: a decode met first inside a CUDA-graph capture runs the default options (no search)")
                self._noted_capture = True
            return base, 0.0
        shape, made = self.shape(problem), []

        def seconds(options: dict) -> float:  # the representative problem is built only if a search runs
            if not made:
                made.append(self.measure(self.representative(problem, operands), recompile_limit))
            return made[0](options)

        found, spent = tuned_decode_options(shape, base, self.kv_block, current_gpu(self.device)[1], seconds,
                                            DecodeOptionsCache())  # fmt: skip
        if made:
            forget_candidates()
        self.chosen[problem] = found
        return found, spent

    def representative(self, problem: DecodeProblem, operands: tuple) -> Callable[[dict], tuple]:
        """`args_for(options)`: the `attend` arguments of `problem`'s representative decode."""
        k, v, scale, score_mod, sinks = operands
        masks = self.new_masks()
        mask = representative_mask(masks, problem, self.heads[3], self.full_blocks)
        num_heads, _, head_dim, _ = self.heads
        g = masks.packed_heads  # query heads packed into each query row, as the backend's (CPU) decodes do
        shape = (problem.batch, num_heads // g, problem.query_len * g, head_dim)
        q = torch.randn(shape, device=self.device, dtype=self.dtype)
        torch._dynamo.mark_static(q, 0)
        return lambda options: (q, k, v, mask, scale, options, score_mod, sinks)

    def repeat_search(
        self, problem: DecodeProblem, base: dict, operands: tuple, runs: int = 2, recompile_limit: int = 256
    ) -> list[Found]:
        """`runs` searches of `problem`, uncached and unremembered, to show that one reproduces (`agree`)."""
        shape, sms = self.shape(problem), current_gpu(self.device)[1]
        seconds = self.measure(self.representative(problem, operands), recompile_limit)
        found = [coordinate_search(base, decode_axes(shape, self.kv_block, sms), seconds) for _ in range(runs)]
        forget_candidates()
        return found

    def used(self, base: dict | None) -> str:
        """The options each problem searched so far ran with ("batch 64: stages 3, ... at 64 pages"), else `base`'s."""
        if not self.chosen:
            return describe(base)
        return "; ".join(
            f"batch {p.batch}{f' x {p.query_len}' if p.query_len > 1 else ''}: {describe(o)} at {p.context_pages} pages"
            for p, o in sorted(self.chosen.items())
        )


def describe(options: dict | None) -> str:
    """The options as the provider string names them: "stages 3, warps 4, split 4, tile 64"."""
    if not options:
        return "template defaults"
    names = (("num_stages", "stages"), ("num_warps", "warps"), ("SPLIT_KV", "split"), ("BLOCK_N", "tile"))
    return ", ".join(f"{label} {options[name]}" for name, label in names if name in options)


def cuda_seconds(fn: Callable[[], object]) -> float:
    """Median seconds of `fn` as triton's do_bench times a kernel; inf when it fails (a candidate
    the template cannot build, e.g. too little shared memory)."""
    from triton.testing import do_bench

    try:
        return do_bench(fn, warmup=5, rep=20, return_mode="median") / 1e3
    except Exception as e:  # a candidate that does not compile or launch is skipped, not fatal
        logger.debug("flex: a decode candidate failed: %s", e)
        return float("inf")


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (never with a CPU-only torch)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def current_gpu(device: torch.device) -> tuple[str, int]:
    """(name, SM count) of `device`; a CPU's ("cpu", its cores), for searches timed on one."""
    if device.type != "cuda":
        return "cpu", os.cpu_count() or 1
    props = torch.cuda.get_device_properties(device)
    return props.name, props.multi_processor_count
