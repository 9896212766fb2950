"""The device lane: where an engine step's device work runs, in launch order. On CUDA it is the
caller's thread (kernels queue on the stream and the host goes on at once); on a CPU it is one
worker thread (torch releases the GIL inside its ops), the CPU's stand-in for a device, so that
under async scheduling the host schedules the next step while this one computes. `inline`: always
the caller's thread (the synchronous engine)."""

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class DeviceLane:
    def __init__(self, device: torch.device, inline: bool = True):
        threaded = not inline and device.type != "cuda"
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="pagedbench-device") if threaded else None
        self.busy_seconds = 0.0  # wall time the lane spent running work (the host benchmark's device time)

    def submit(self, fn, *args) -> Future:
        """Run `fn(*args)` after everything submitted before it; its result (or error) in the Future."""
        if self.pool is not None:
            return self.pool.submit(self._timed, fn, *args)
        done = Future()
        try:
            done.set_result(self._timed(fn, *args))
        except BaseException as e:  # an interrupt too: re-raised where the result is read
            done.set_exception(e)
        return done

    def _timed(self, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.busy_seconds += time.perf_counter() - start

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
