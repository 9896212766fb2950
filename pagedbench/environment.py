"""What every reported number is recorded with: code version, torch, device, time."""
import datetime
import subprocess
from pathlib import Path

import torch


def git_sha() -> str:
    """The commit of the pagedbench source tree, "+dirty" when it has uncommitted changes; "unknown" outside git."""
    source = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=source, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=source,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def environment(device: torch.device, dtype: torch.dtype) -> dict:
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": git_sha(),
        "torch_version": torch.__version__,
        "device": device.type,
        "device_name": device_name(device),
        "cpu_threads": torch.get_num_threads(),  # CPU timings move with it (OMP_NUM_THREADS)
        "dtype": str(dtype).removeprefix("torch."),
    }
