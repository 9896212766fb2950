"""Every PAGEDBENCH_* environment knob, once: its name, default and meaning (vLLM's `envs`).
Code reads a knob through `get(name)` (or `enabled`, `cache_dir`), never os.environ: a knob is
read where it acts, each time, so tests and child processes that set one are seen. Settings a
user chooses per run are EngineConfig's (config.py); these are for measurements and debugging."""

import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Knob:
    name: str
    default: str
    meaning: str
    choices: tuple[str, ...] = ()
    measured: bool = False  # it changes what a measurement runs: a row's repro command sets it (bench/repro.py)


KNOBS = {
    knob.name: knob
    for knob in (
        Knob(
            "PAGEDBENCH_CACHE_DIR",
            "",
            "pagedbench's cache (GGUF conversions, flex's tuned decode options); unset: "
            "$XDG_CACHE_HOME/pagedbench, else ~/.cache/pagedbench",
        ),
        Knob("PAGEDBENCH_FLEX_COMPILE", "1", "0 runs flex eager (it materializes every score)", ("0", "1"), True),
        Knob(
            "PAGEDBENCH_FLEX_KERNEL",
            "triton",
            "flex's kernels: triton, or flash (FlexAttention's FA4-based ones, where torch and flash-attn-4 have them)",
            ("triton", "flash"),
            True,
        ),
        Knob(
            "PAGEDBENCH_FLEX_SPARSE",
            "auto",
            "flex's sparse (DeepSeek-V3.2) steps: auto, or gather / pages for every step",
            ("auto", "gather", "pages"),
            True,
        ),
        Knob("PAGEDBENCH_FLEX_TUNE", "1", "0 turns flex's decode option search off (its defaults)", ("0", "1"), True),
        Knob("PAGEDBENCH_FLEX_TUNE_SECONDS", "45", "the most one shape's flex decode search may take (s)", (), True),
        Knob(
            "PAGEDBENCH_FLASH_PROVIDER",
            "",
            "forces flash_attn's provider: fa3, fa4, fa2 or torch (unset: the first that runs)",
            ("", "fa3", "fa4", "fa2", "torch"),
            True,
        ),
        Knob(
            "PAGEDBENCH_GC_FREEZE",
            "1",
            "0 keeps the startup heap in Python's collector (1: frozen once an engine is built, as vLLM does)",
            ("0", "1"),
        ),
        Knob("PAGEDBENCH_DEBUG", "", "1: worker and replica processes print their full tracebacks"),
        Knob("PAGEDBENCH_GPU_STASH", "/tmp/pagedbench-gpu", "gpu-suite's files kept between calls on a warm machine"),
        Knob("PAGEDBENCH_EARLY_FAILURES", "", "1: the tests print each failure as it happens (gpu-suite sets it)"),
    )
}
RENAMED = {"PAGEDBENCH_CACHE": "PAGEDBENCH_CACHE_DIR"}  # old name -> its knob, still read, with a note


def get(name: str) -> str:
    """The knob's value (its default when unset or empty), stripped; a ValueError naming the
    knob when it is not one of its choices."""
    knob = KNOBS[name]
    value = os.environ.get(name, "").strip()
    for old, new in RENAMED.items():
        if new == name and not value and os.environ.get(old, "").strip():
            logger.warning("%s is deprecated: set %s instead", old, new)
            value = os.environ[old].strip()
    value = value or knob.default
    if knob.choices and value.lower() not in knob.choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(c for c in knob.choices if c)}")
    return value.lower() if knob.choices else value


def enabled(name: str) -> bool:
    """A 0/1 knob: anything but empty or "0" turns it on."""
    return get(name) not in ("", "0")


def cache_dir() -> Path:
    """PAGEDBENCH_CACHE_DIR, else $XDG_CACHE_HOME/pagedbench, else ~/.cache/pagedbench."""
    given = get("PAGEDBENCH_CACHE_DIR")
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedbench"
