"""Python's cyclic collector and a long-lived engine. A full collection walks every tracked object:
after torch, transformers and a model are loaded that is some 200k objects and 0.25 s on this CPU,
a stall of every step it lands in, and it lands every ~50k surviving allocations. Frozen after
startup (as vLLM's engine core does), those objects are left out of every later collection; an
engine's shutdown thaws them, so that an engine built and dropped in one process (`compare`'s
backends) is collected."""

import gc

from pagedbench import envs


def freeze_startup_heap() -> None:
    """Collect what startup left, then freeze what is live (unless PAGEDBENCH_GC_FREEZE=0)."""
    if envs.enabled("PAGEDBENCH_GC_FREEZE"):
        gc.collect()
        gc.freeze()


def thaw_heap() -> None:
    """Give the frozen objects back to the collector (an engine's shutdown)."""
    if gc.get_freeze_count():
        gc.unfreeze()
