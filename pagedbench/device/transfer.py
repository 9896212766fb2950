"""Every host<->device copy the engine makes goes through these helpers, so each one is
deliberate and `counting()` can count them per step (on CPU the "copies" are the same calls).

A decode step's budget: its host arrays in one copy per dtype (`to_device_packed`), sampling
parameters only when the batch's sequences change, and one device-to-host copy of the sampled
token ids. Nothing here waits for the device except `to_host`/`to_list`, which must.
"""

from collections import Counter
from contextlib import contextmanager

import numpy as np
import torch

_counters: list[Counter] = []  # the open `counting()` blocks


def _count(direction: str) -> None:
    for c in _counters:
        c[direction] += 1


@contextmanager
def counting():
    """`with counting() as copies:` ... `copies["h2d"]`, `copies["d2h"]`: copies made in the block."""
    c = Counter()
    _counters.append(c)
    try:
        yield c
    finally:
        _counters.remove(c)


def to_device(data: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """One host-to-device copy without a sync (pinned staging on CUDA)."""
    _count("h2d")
    t = torch.from_numpy(data) if isinstance(data, np.ndarray) else data
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def copy_to_device_(dst: torch.Tensor, array: np.ndarray) -> None:
    """One host-to-device copy into an existing tensor of the same size (a static buffer)."""
    _count("h2d")
    src = torch.from_numpy(array)
    if dst.device.type == "cuda":
        src = src.pin_memory()
    dst.copy_(src.view(dst.shape), non_blocking=True)


def pack(arrays: list[np.ndarray]) -> dict[np.dtype, np.ndarray]:
    """The arrays flattened into one host buffer per dtype (in order of first appearance)."""
    dtypes = dict.fromkeys(a.dtype for a in arrays)
    return {d: np.concatenate([a.ravel() for a in arrays if a.dtype == d]) for d in dtypes}


def unpack(buffers: dict[np.dtype, torch.Tensor], arrays: list[np.ndarray]) -> list[torch.Tensor]:
    """Views of packed buffers (`pack`'s layout) shaped like `arrays`, in their order."""
    offsets = dict.fromkeys(buffers, 0)
    views = []
    for a in arrays:
        start = offsets[a.dtype]
        views.append(buffers[a.dtype][start : start + a.size].view(a.shape))
        offsets[a.dtype] = start + a.size
    return views


def to_device_packed(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Copy host arrays with one transfer per dtype; they come back as views, in order. On CPU
    nothing moves: the arrays are wrapped as they are (counted as the same transfers)."""
    if device.type == "cpu":
        for _ in dict.fromkeys(a.dtype for a in arrays):
            _count("h2d")
        return [torch.from_numpy(a) for a in arrays]
    return unpack({d: to_device(h, device) for d, h in pack(arrays).items()}, arrays)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """One device-to-host copy (waits for the device)."""
    _count("d2h")
    return tensor.cpu()


class HostCopy:
    """A device-to-host copy under way (async scheduling's sampled tokens): on CUDA it runs on a side
    stream after the work that made `tensor`, into pinned memory, and `wait()` waits for its event
    only; elsewhere the tensor is already on the host."""

    _streams: dict = {}  # one side stream per device

    def __init__(self, tensor: torch.Tensor):
        _count("d2h")
        self.event = None
        if tensor.device.type != "cuda":
            self.host = tensor
            return
        side = self._streams.setdefault(tensor.device, torch.cuda.Stream(tensor.device))
        side.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(side):
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(side)
        tensor.record_stream(side)

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host


def to_list(tensor: torch.Tensor) -> list:
    """A device tensor as Python values: one device-to-host copy."""
    return to_host(tensor).tolist()
