"""Spans of device work measured without waiting for the device: CUDA events recorded in the
stream and read once, after a run; on CPU the work runs synchronously, so perf_counter spans
are the device's time. What `bench` reports as GPU time, attention time and engine overhead."""

import time
from collections import defaultdict

import torch


class DeviceTimer:
    """Off (marks are None, spans ignored) until `enabled`: a server must not collect forever."""

    def __init__(self, device: torch.device, enabled: bool = False):
        self.cuda = device.type == "cuda"
        self.enabled = enabled
        self._spans: dict[str, list] = defaultdict(list)  # name -> [(start, end)], events or floats

    def mark(self):
        """Now, in the device's stream (an event on CUDA); None while off."""
        if not self.enabled:
            return None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def span(self, name: str, start, end=None) -> None:
        """Count start..end (default: now) under `name`."""
        if start is None:
            return
        self._spans[name].append((start, self.mark() if end is None else end))

    def totals(self) -> dict[str, float]:
        """Seconds per span name, summed (waits for the device once, on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize()
        return {name: self.seconds(spans) for name, spans in self._spans.items()}

    def spans(self, name: str) -> list:
        """The spans counted under `name` so far: the live list (a step recorder slices its own)."""
        return self._spans[name]

    def seconds(self, spans: list) -> float:
        """Seconds of `spans` (a slice of `spans(name)`), summed; on CUDA, after the device has run them."""
        if self.cuda:
            return sum(s.elapsed_time(e) for s, e in spans) / 1e3
        return sum(e - s for s, e in spans)

    def reset(self) -> None:
        self._spans.clear()
