"""flex's decode kernel options, chosen per device and shape by a small search, cached on disk.

PyTorch's decoding template caps its KV tile at the BlockMask's block size, defaults to one stage
and two warps, and splits a row's KV across thread blocks only until the SMs hold two programs
each (SPLIT_KV collapses to 1 at batch 64 with 8 KV heads on 132 SMs). Those are `kernel_options`
(SPLIT_KV, num_stages, num_warps, BLOCK_N), so the first decode call of each (GPU, torch, heads,
head_dim, page size, dtype, batch bucket) times a few of them on its own inputs and keeps the
fastest: a coordinate search (split, then stages, then warps, then the tile), about a dozen
compiles, counted as compile time, within PAGEDBENCH_FLEX_TUNE_SECONDS (45). The result is kept
in a JSON file (PAGEDBENCH_CACHE_DIR, else ~/.cache/pagedbench) so later processes only look it
up. PAGEDBENCH_FLEX_TUNE=0 turns the search off (the template's defaults and our BLOCK_N cap run);
the provider string says which, the kernels report's `kernel_options` column names the options.
`DecodeTuner` keeps a backend's options per static batch.
"""

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from pagedbench.backends.flex_compile import attend_compiled, attend_compiling

from pagedbench import envs

logger = logging.getLogger(__name__)

CACHE_FILE = "flex-decode-options.json"
STAGES = (1, 2, 3, 4)
WARPS = (2, 4, 8)
MAX_SPLIT = 64


def tune_enabled() -> bool:
    return envs.enabled("PAGEDBENCH_FLEX_TUNE")


def tune_budget() -> float:
    """PAGEDBENCH_FLEX_TUNE_SECONDS: the most one shape's search may take (each candidate is a
    compile of a few seconds on a GPU); the best found by then is kept."""
    return float(envs.get("PAGEDBENCH_FLEX_TUNE_SECONDS"))


def cache_path() -> Path:
    return envs.cache_dir() / CACHE_FILE


@dataclass(frozen=True, slots=True)
class DecodeShape:
    """What a decode kernel's best options depend on (the context length varies every step: not a key)."""

    gpu: str
    torch_version: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    batch: int  # the static decode batch (a power of two)

    @property
    def key(self) -> str:
        return "|".join(map(str, (self.gpu, self.torch_version, self.num_heads, self.num_kv_heads, self.head_dim,
                                  self.page_size, self.dtype, self.batch)))  # fmt: skip


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


def search(
    base: dict, axes: list[tuple[str, list]], seconds: Callable[[dict], float], budget_s: float = float("inf")
) -> tuple[dict, int]:
    """Coordinate search: each axis in turn, its values tried with the best found so far, until
    `budget_s` seconds have passed (the best so far is kept). `seconds(options)` times one
    candidate (inf: it failed). Returns (best options, candidates timed)."""
    best, best_time, timed = dict(base), float("inf"), {}
    deadline = time.perf_counter() + budget_s
    for name, values in axes:
        for value in values:
            if timed and time.perf_counter() > deadline:
                return best, len(timed)
            options = best | {name: value}
            key = tuple(sorted(options.items()))
            if key not in timed:
                timed[key] = seconds(options)
            if timed[key] < best_time:
                best, best_time = options, timed[key]
    return best, len(timed)


class DecodeOptionsCache:
    """The searched options by DecodeShape.key, read once and rewritten after each search."""

    def __init__(self, path: Path | None = None):
        self.path = path or cache_path()
        try:
            self.entries: dict[str, dict] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.entries = {}

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
    axes = [
        ("SPLIT_KV", split_choices(num_sms, shape.batch, shape.num_kv_heads)),
        ("num_stages", list(STAGES)),
        ("num_warps", list(WARPS)),
        ("BLOCK_N", tile_choices(kv_block)),
    ]
    best, count = search(base, axes, seconds, tune_budget())
    spent = time.perf_counter() - start
    logger.info("flex: tuned the decode kernel for batch %d in %.1f s (%d candidates): %s", shape.batch, spent,
                count, describe(best))  # fmt: skip
    cache.put(shape, best)
    return best, spent


class DecodeTuner:
    """A backend's decode options per static batch: searched on the batch's first call, on its own inputs,
    never inside a CUDA-graph capture (the engine's warm-up before capture has run the search)."""

    def __init__(self, device: torch.device, num_heads, num_kv_heads, head_dim, page_size, dtype, kv_block: int):
        self.device, self.kv_block = device, kv_block
        self.shape = (num_heads, num_kv_heads, head_dim, page_size, str(dtype).removeprefix("torch."))
        self.chosen: dict[int, dict] = {}

    def options(
        self, batch: int, base: dict, call_with: Callable[[dict], tuple], recompile_limit: int
    ) -> tuple[dict, float]:
        """(the options of `batch`, seconds spent searching them); `call_with(options)`: the call's `attend` args."""
        found = self.chosen.get(batch)
        if found is not None:
            return found, 0.0
        if torch.cuda.is_current_stream_capturing():
            return base, 0.0
        name, sms = current_gpu(self.device)
        shape = DecodeShape(name, torch.__version__, *self.shape, batch)

        def seconds(options: dict) -> float:
            args = call_with(options)
            try:
                attend_compiling("decode", args, recompile_limit)
            except Exception as e:  # a candidate the template cannot build (shared memory, tile)
                logger.debug("flex: decode candidate %s failed: %s", options, e)
                return float("inf")
            return cuda_seconds(lambda: attend_compiled(*args))

        found, spent = tuned_decode_options(shape, base, self.kv_block, sms, seconds, DecodeOptionsCache())
        self.chosen[batch] = found
        return found, spent

    def used(self, base: dict | None) -> str:
        """The options each batch searched so far ran with ("batch 64: stages 3, ..."), else `base`'s."""
        if not self.chosen:
            return describe(base)
        return "; ".join(f"batch {b}: {describe(o)}" for b, o in sorted(self.chosen.items()))


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


def current_gpu(device: torch.device) -> tuple[str, int]:
    """(name, SM count) of `device`."""
    props = torch.cuda.get_device_properties(device)
    return props.name, props.multi_processor_count
