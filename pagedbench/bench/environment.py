"""What every reported number is recorded with: code version, torch, device, time."""

import datetime
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from pagedbench.device.dtypes import dtype_name


def git_sha() -> str:
    """The commit of the pagedbench source tree, "+dirty" when it has uncommitted changes; "unknown" outside git."""
    source = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=source, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=source,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model and core count (so `report` never merges two machines'
    CPU rows as one): "cpu: AMD EPYC 7B13 (2 cores)"."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {cpu_model()} ({os.cpu_count()} cores)"


def cpu_model() -> str:
    """/proc/cpuinfo's model name (Linux), else what platform says, else "unknown"."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


BUSY_LOAD_PER_CORE = 0.5  # a 1-minute load average above this many runnable tasks per core: CPU timings suffer


def load_average() -> float:
    """The 1-minute load average (NaN where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return float("nan")


def busy_warning(device: torch.device) -> str | None:
    """A warning when CPU figures are about to be taken on a machine that is already busy."""
    load, cores = load_average(), os.cpu_count() or 1
    if device.type == "cpu" and load > BUSY_LOAD_PER_CORE * cores:
        # one line of a 120-column terminal, with "pagedbench: warning: " in front
        return f"busy machine (load {load:.2f}, {cores} cores): CPU timings slow and noisy; compare when idle"
    return None


# The attention libraries a row's backend may run, by their distribution names (read, never imported).
LIBRARIES = {
    "triton": ("triton",),
    "flash_attn": ("flash-attn", "flash_attn_3", "flash-attn-4"),
    "flashinfer": (
        "flashinfer-python",
        "flashinfer",
    ),
}


def library_version(distributions: tuple[str, ...]) -> str:
    """The installed versions of a library's distributions ("flash-attn 2.8.3, flash-attn-4 4.0.0b1" where
    several are), "" where none is."""
    found = []
    for name in distributions:
        try:
            found.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            continue
    return found[0][1] if len(found) == 1 else ", ".join(f"{n} {v}" for n, v in found)


def driver_version() -> str:
    """The NVIDIA kernel driver's version (/proc/driver/nvidia/version: no CUDA call), "" without one."""
    try:
        text = open("/proc/driver/nvidia/version").read()
    except OSError:
        return ""
    words = text.split("Kernel Module", 1)[-1].split()
    return words[0] if words else ""


def versions(device: torch.device) -> dict:
    """torch's, each attention library's, and on CUDA torch's CUDA and the driver's."""
    cuda = device.type == "cuda"
    return {
        "torch_version": torch.__version__,
        **{f"{lib}_version": library_version(dists) for lib, dists in LIBRARIES.items()},
        "cuda_version": (torch.version.cuda or "") if cuda else "",
        "driver_version": driver_version() if cuda else "",
    }


def environment(device: torch.device, dtype: torch.dtype) -> dict:
    return {
        "load_average": round(load_average(), 2),  # at the start; CPU timings move with it
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_sha": git_sha(),
        **versions(device),
        "device": device.type,
        "device_name": device_name(device),
        "cpu_threads": torch.get_num_threads(),  # CPU timings move with it (OMP_NUM_THREADS)
        "dtype": dtype_name(dtype),
    }
