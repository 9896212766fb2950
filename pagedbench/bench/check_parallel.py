"""Running the check's grid in helper processes too, from the far end, on a multi-core CPU.

On a CPU nearly all of a cold `check` is compiling flex graphs (a C++ build of a few seconds per
configuration and call kind, on one core) and interpreting Triton. The grid is split into
configurations (cases sharing compiled graphs); the check takes them from the front, helpers
from the back, until they meet, so each graph is built once and every core works. Helpers run
the same `run_case` with the check's thread count (part of the key under which inductor caches
a CPU graph, so graphs a helper built are loaded, not rebuilt, by a later run), and send their
rows back; the check writes every row in grid order. A configuration whose helper died is run by
the check itself.
"""

import contextlib
import logging
import multiprocessing
import os
import queue
from collections.abc import Callable, Iterator

import torch

logger = logging.getLogger(__name__)

MAX_HELPERS = 3
MIN_GROUPS = 4  # fewer configurations than this: not worth a process that imports torch
SLOW_BACKENDS = {"flex", "triton"}  # compiled per configuration, or interpreted, on a CPU


def compile_group(case) -> tuple:
    """Cases with equal keys run on the same compiled graphs."""
    return (case.dtype, case.heads, case.head_dim, case.block_size, case.variant)


def groups_of(cases: list) -> list[list]:
    """The cases as runs of one configuration each, in order."""
    groups = []
    for i, case in enumerate(cases):
        if i == 0 or compile_group(case) != compile_group(cases[i - 1]):
            groups.append([])
        groups[-1].append(case)
    return groups


def helper_count(groups: list, backends: list[str], device: torch.device) -> int:
    """Helpers worth starting: one per spare core (at most MAX_HELPERS) on a CPU when a slow backend
    is among `backends`, every backend loads by name in a fresh process (not one registered at run
    time) and the grid has MIN_GROUPS configurations."""
    from pagedbench.backends.registry import loads_by_name

    if device.type != "cpu" or not SLOW_BACKENDS & set(backends) or len(groups) < MIN_GROUPS:
        return 0
    if not all(loads_by_name(name) for name in backends):
        return 0
    return max(0, min(len(os.sched_getaffinity(0)) - 1, MAX_HELPERS))


class Split:
    """Which configurations are whose: the check claims from the front, helpers from the back."""

    def __init__(self, ctx, num_groups: int):
        self.lock = ctx.Lock()
        self.front = ctx.Value("i", 0, lock=False)  # groups the check has claimed
        self.back = ctx.Value("i", num_groups, lock=False)  # first group a helper has claimed

    def claim_front(self) -> int | None:
        with self.lock:
            if self.front.value >= self.back.value:
                return None
            self.front.value += 1
            return self.front.value - 1

    def claim_back(self) -> int | None:
        with self.lock:
            if self.back.value <= self.front.value:
                return None
            self.back.value -= 1
            return self.back.value


@contextlib.contextmanager
def sharing_groups(
    groups: list[list], backends: list[str], device: torch.device, run_case: Callable
) -> Iterator[tuple[Split | None, Callable[[], dict[int, list[dict]]]]]:
    """Yields (split, collect): the body claims groups with split.claim_front() (split is None:
    no helpers, run everything), then collect() returns the helpers' rows by group, running any
    group a helper claimed but never delivered."""
    count = helper_count(groups, backends, device)
    if not count:
        yield None, dict
        return
    ctx = multiprocessing.get_context("spawn")  # never fork a process whose OpenMP threads have run
    split, results = Split(ctx, len(groups)), ctx.Queue()
    args = (run_case, groups, backends, str(device), torch.get_num_threads(), split, results)
    helpers = [ctx.Process(target=_help, args=args, daemon=True) for _ in range(count)]
    for helper in helpers:
        helper.start()
    logger.info("running the grid in %d helper process(es) too", count)

    def collect() -> dict[int, list[dict]]:
        got: dict[int, list[dict]] = {}
        mine = range(split.back.value, len(groups))
        while len(got) < len(mine):
            try:
                index, rows = results.get(timeout=1.0)
                got[index] = rows
            except queue.Empty:
                if not any(helper.is_alive() for helper in helpers) and results.empty():
                    break
        for index in mine:
            if index not in got:  # its helper died: run it here
                logger.warning("a helper died; the check runs its configuration itself")
                got[index] = [row for case in groups[index] for row in run_case(case, backends, device)]
        return got

    try:
        yield split, collect
    finally:
        for helper in helpers:
            helper.terminate()
        for helper in helpers:
            helper.join()


def _help(run_case, groups, backends, device: str, threads: int, split: Split, results) -> None:
    """In a helper: claim configurations from the back and send their rows until none is left."""
    import warnings

    warnings.simplefilter("ignore")  # the check says whatever there is to say
    torch.set_num_threads(threads)
    while (index := split.claim_back()) is not None:
        rows = [row for case in groups[index] for row in run_case(case, backends, torch.device(device))]
        results.put((index, rows))
