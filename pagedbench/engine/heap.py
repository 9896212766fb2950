"""Python's cyclic collector and a long-lived engine. A full collection walks every tracked object:
after torch, transformers and a model are loaded that is some 200k objects and 0.25 s on this CPU,
a stall of every step it lands in, and it lands every ~50k surviving allocations. Frozen after
startup (as vLLM's engine core does), those objects are left out of every later collection. An
engine's shutdown thaws them, and so does the next engine's construction before it sizes its cache,
so that an engine built and dropped in one process (`compare`'s backends, a notebook's second LLM)
is collected, its reference cycles included."""

import gc

from pagedbench import envs


def collect_dropped_engines() -> None:
    """Before an engine is built: thaw and collect, so that an engine dropped without shutdown() (its
    objects frozen with the heap, cycles and all) frees its pages before this one sizes its cache."""
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()


def freeze_startup_heap() -> None:
    """Collect what startup left, then freeze what is live (unless PAGEDBENCH_GC_FREEZE=0)."""
    if envs.enabled("PAGEDBENCH_GC_FREEZE"):
        gc.collect()
        gc.freeze()


def thaw_heap() -> None:
    """Give the frozen objects back to the collector (an engine's shutdown)."""
    if gc.get_freeze_count():
        gc.unfreeze()
