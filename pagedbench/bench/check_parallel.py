"""Running the check's grid in helper processes too, from the far end, on a multi-core CPU.

On a CPU nearly all of a cold `check` is single-core work: compiling flex graphs (a C++ build of a
few seconds per configuration and call kind) and interpreting Triton. The grid is split into
configurations (runs of cases that share compiled graphs); the check takes them from the front,
helpers from the back (each claimed by creating a file), until they meet, so every core works
and each graph is built once, or twice where the two meet. Helpers run the same `run_case` with
the check's thread count (part of the key under which inductor caches a CPU graph, so graphs a
helper built are loaded, not rebuilt, by a later run) and leave each configuration's rows in a
file; the check writes every row in grid order. A configuration whose helper died is run by the
check itself."""

import contextlib
import functools
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from pagedbench.device.cpu_threads import default_threads

logger = logging.getLogger(__name__)

MAX_HELPERS = 3
MIN_GROUPS = 4  # fewer configurations than this: not worth a process that imports torch
SLOW_BACKENDS = {"flex", "triton"}  # compiled per configuration, or interpreted, on a CPU


def compile_group(case) -> tuple:
    """Cases with equal keys run on the same compiled flex graphs (the window and the soft-cap's
    value are runtime values in them)."""
    return (
        case.dtype,
        case.heads,
        case.head_dim,
        case.block_size,
        case.variant.softcap is not None,
        case.variant.sinks,
    )


def groups_of(cases: list) -> list[list]:
    """The cases as runs of one configuration each, in order."""
    groups = []
    for i, case in enumerate(cases):
        if i == 0 or compile_group(case) != compile_group(cases[i - 1]):
            groups.append([])
        groups[-1].append(case)
    return groups


def helper_count(groups: list, backends: list[str], device: torch.device) -> int:
    """Helpers worth starting: one per core beyond the first (at most MAX_HELPERS) on a CPU when a
    slow backend is among `backends`, every backend loads by name in a fresh process (not one
    registered at run time, nor one whose import failed) and the grid has MIN_GROUPS configurations."""
    from pagedbench.backends.registry import loads_by_name

    if device.type != "cpu" or not SLOW_BACKENDS & set(backends) or len(groups) < MIN_GROUPS:
        return 0
    if not all(loads_by_name(name) for name in backends):
        return 0
    free_cores = default_threads()[0]  # a helper on a busy core would only slow the others
    return max(0, min(free_cores - 1, MAX_HELPERS))


class Sharing:
    """The grid's configurations between the check and its helpers. Each is claimed by creating a
    file (O_EXCL: exactly one process wins it); the check claims from the front and stops at the
    first one a helper has, helpers from the back, passing over those already taken."""

    def __init__(self, groups: list[list], folder: Path | None = None, helpers=(), run_here: Callable | None = None):
        self.groups, self.folder, self.helpers, self.run_here = groups, folder, list(helpers), run_here
        self.first_theirs = len(groups)  # where the check stopped: the helpers have every group from here

    def claim(self, index: int) -> bool:
        if self.folder is None:
            return True
        try:
            os.close(os.open(self.folder / f"{index}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def claimed(self, index: int) -> bool:
        return self.folder is None or (self.folder / f"{index}.claim").exists()

    def mine(self) -> Iterator[int]:
        """The check's configurations, claimed one at a time as it gets to them."""
        for index in range(len(self.groups)):
            if not self.claim(index):
                self.first_theirs = index
                return
            yield index

    def collect(self, wait: bool = True) -> dict[int, list[dict]]:
        """The helpers' rows by group: those finished so far, or (wait) every one from first_theirs
        on, waiting while a helper lives and running here any whose helper died."""
        theirs = range(self.first_theirs, len(self.groups)) if wait else range(len(self.groups))
        got = {}
        while self.folder is not None:
            alive = any(helper.is_alive() for helper in self.helpers)  # before the look: a last one after they exit
            for index in theirs:
                path = self.folder / f"{index}.pkl"
                if index not in got and path.exists():
                    got[index] = pickle.loads(path.read_bytes())
            if not wait or len(got) == len(theirs) or not alive:
                break
            time.sleep(0.05)
        if wait and self.helpers:
            logger.info("helpers ran %d of %d configurations", len(got), len(self.groups))
        for index in theirs if wait else ():
            if index not in got:
                logger.warning("a helper died; the check runs configuration %d itself", index)
                got[index] = self.run_here(self.groups[index])
        return got


@contextlib.contextmanager
def sharing_groups(
    groups: list[list], backends: list[str], device: torch.device, run_case: Callable
) -> Iterator[Sharing]:
    """A Sharing of `groups` with helper processes running `run_case` on theirs (none where
    helper_count says so: the check runs every group)."""
    count = helper_count(groups, backends, device)
    if not count:
        yield Sharing(groups)
        return
    ctx = multiprocessing.get_context("spawn")  # never fork a process whose OpenMP threads have run
    helpers = []
    with tempfile.TemporaryDirectory(prefix="pagedbench-check-") as folder:
        try:
            for _ in range(count):
                args = (run_case, groups, backends, str(device), torch.get_num_threads(), folder)
                helpers.append(ctx.Process(target=_help, args=args, daemon=True))
                helpers[-1].start()
            logger.info("running the grid in %d helper process(es) too", count)
            run_here = functools.partial(_rows, run_case, backends=backends, device=device)
            yield Sharing(groups, Path(folder), helpers, run_here)
        finally:
            for helper in helpers:
                helper.terminate()
            for helper in helpers:
                helper.join(timeout=5)
                if helper.is_alive():
                    helper.kill()
                    helper.join()


def _rows(run_case: Callable, cases: list, backends: list[str], device: torch.device) -> list[dict]:
    return [row for case in cases for row in run_case(case, backends, device)]


def _help(run_case: Callable, groups, backends, device: str, threads: int, folder: str) -> None:
    """In a helper: claim configurations from the back and leave their rows in files (written whole,
    then renamed) until the front is reached or the check is gone."""
    import warnings

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the check's to handle
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))  # stopped by the check: clean up on the way out
    warnings.simplefilter("ignore")  # the check says whatever there is to say
    torch.set_num_threads(threads)
    sharing, parent = Sharing(groups, Path(folder)), multiprocessing.parent_process()
    for index in reversed(range(len(groups))):
        if parent is not None and not parent.is_alive():
            return
        if not sharing.claim(index):
            continue
        rows = _rows(run_case, groups[index], backends, torch.device(device))
        partial = Path(folder, f"{index}.tmp")
        partial.write_bytes(pickle.dumps(rows))
        partial.rename(Path(folder, f"{index}.pkl"))
