"""How many CPU threads torch gets: the cores this process may use, less those busy at start.

Torch's OpenMP threads meet at a barrier after every parallel region. On a core that another
process holds, a thread is descheduled for a whole time slice and every other thread waits at
the barrier for it: with one of 2 cores busy, 2 threads ran the README's first command 2-2.5x
slower than 1 thread (docs/benchmarks.md; 10x has been seen). So a busy core gets no thread.
"""

import logging
import os
import time

logger = logging.getLogger(__name__)

SAMPLE_SECONDS = 0.1


def usable_cores() -> list[int]:
    """The CPUs this process may run on (its affinity mask, so a cgroup or taskset limit counts)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _cpu_times() -> dict[int, tuple[int, int]]:
    """cpu index -> (busy jiffies, total jiffies) from /proc/stat; {} where there is none."""
    times = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if not name.startswith("cpu") or name == "cpu":
                    continue
                values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
                idle = values[3] + values[4]
                times[int(name[3:])] = (sum(values) - idle, sum(values))
    except (OSError, ValueError):
        return {}
    return times


def busy_cores(cores: list[int], seconds: float = SAMPLE_SECONDS) -> int:
    """How many of `cores` other work keeps busy now: each core's busy share over a short sample
    (this process sleeps through it), summed and rounded."""
    before = _cpu_times()
    time.sleep(seconds)
    after = _cpu_times()
    busy = 0.0
    for cpu in cores:
        if cpu in before and cpu in after:
            total = after[cpu][1] - before[cpu][1]
            busy += (after[cpu][0] - before[cpu][0]) / total if total > 0 else 0.0
    return int(busy + 0.5)


def default_threads() -> tuple[int, str]:
    """(threads, why): the usable cores less the busy ones, at least 1."""
    cores = usable_cores()
    busy = busy_cores(cores)
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
