"""How many CPU threads torch gets: the cores this process may use, less those busy at start.

Torch's OpenMP threads meet at a barrier after every parallel region. On a core that another
process holds, a thread is descheduled for a whole time slice and every other thread waits at
the barrier for it: with one of 2 cores busy, 2 threads ran the README's first command 2-2.5x
slower than 1 thread (docs/benchmarks.md; 10x has been seen). So a busy core gets no thread.
"""

import logging
import os

logger = logging.getLogger(__name__)

SAMPLE_SECONDS = 0.1


def usable_cores() -> list[int]:
    """The CPUs this process may run on (its affinity mask, so a cgroup or taskset limit counts)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def busy_cores(cores: list[int], seconds: float = SAMPLE_SECONDS) -> int | None:
    """How many of `cores` other work keeps busy now: each core's busy share over a short sample
    (psutil's per-core percentages; this process sleeps through it), summed and rounded. None where
    it cannot be measured (psutil is not installed, as under `pip install --no-deps`)."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        percents = psutil.cpu_percent(interval=seconds, percpu=True)
    except (OSError, RuntimeError, NotImplementedError):
        return None
    busy = sum(percents[cpu] for cpu in cores if cpu < len(percents)) / 100
    return int(busy + 0.5)


def default_threads() -> tuple[int, str]:
    """(threads, why): the usable cores less the busy ones, at least 1."""
    cores = usable_cores()
    busy = busy_cores(cores)
    if busy is None:
        return len(cores), f"{len(cores)} usable cores, busy ones unknown (no psutil)"
    threads = max(1, len(cores) - busy)
    return threads, f"{len(cores)} usable cores, {busy} busy at start"


def choose_threads() -> int | None:
    """Set torch's thread count for a command unless OMP_NUM_THREADS chose it; the count set, or None."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    import torch

    threads, why = default_threads()
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
        logger.info("CPU threads: %d (%s; OMP_NUM_THREADS or --threads overrides)", threads, why)
    return threads
