"""How `kernels` times a call and reads the result: device time per call, the memory's speed as a
yardstick (the spec sheet's, and a measured copy's), and a forward's timing columns."""

import re
import statistics
import time

import torch

from pagedbench.bench.environment import synchronize
from pagedbench.bench.noise import median_interval

# Spec-sheet HBM bandwidth (TB/s), matched against torch.cuda.get_device_name in order.
PEAK_BANDWIDTH_TBPS = [
    (r"H200", 4.8),
    (r"H100.*PCIe", 2.0),
    (r"H100", 3.35),
    (r"A100.*80GB", 2.0),
    (r"A100", 1.555),
    (r"\bL4\b", 0.3),
]


def time_kernel(fn, device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Device seconds per call after `warmup` untimed calls. On CUDA, as triton's do_bench: the L2
    cache flushed before each call, each call between its own events, and no sync until the last,
    so the host queues launches ahead and the GPU's time is measured, not one Python call's
    launch latency (longer than a whole decode kernel at small batches; it is what the engine's
    CUDA graphs remove). A call whose launch is slower than its kernel still shows the gap.
    On CPU: time_call."""
    if device.type != "cuda":
        return time_call(fn, device, warmup, repeats)
    for _ in range(warmup):
        fn()
    flush = torch.empty(2 * torch.cuda.get_device_properties(device).L2_cache_size, dtype=torch.uint8, device=device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    synchronize(device)
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    synchronize(device)
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def time_call(fn, device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Seconds per call, host included (a step's plan): CUDA events around each call, synced
    after each, on GPU; perf_counter on CPU; after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return times


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The CPU's last-level cache (Linux sysfs), else `default`."""
    for index in (3, 2):
        try:
            text = open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size").read().strip()
        except OSError:
            continue
        return int(text[:-1]) << (20 if text.endswith("M") else 10) if text[-1] in "KM" else int(text)
    return default


def time_cold(fn, device: torch.device, warmup: int, repeats: int) -> list[float]:
    """time_kernel, with the caches cold before each call on a CPU too (a buffer twice the last-level
    cache read first, untimed: clean lines, so the call pays no write-backs of it): what a layer
    meets in a model, after the rest of the model's work."""
    if device.type == "cuda":
        return time_kernel(fn, device, warmup, repeats)
    for _ in range(warmup):
        fn()
    flush = torch.ones(2 * last_level_cache_bytes() // 4, dtype=torch.int32)
    times = []
    for _ in range(repeats):
        flush.max()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def copy_bandwidth(device: torch.device) -> float:
    """GB/s of a large device-to-device copy (read + write): the memory speed a kernel can reach."""
    nbytes = (256 if device.type == "cuda" else 64) << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = min(time_kernel(lambda: dst.copy_(src), device, warmup=2, repeats=10))
    return 2 * nbytes / seconds / 1e9


def bandwidth_columns(device: torch.device) -> dict:
    """The yardsticks every `kernels` row carries: the peak bandwidth (the spec sheet for known GPUs,
    else the measured copy) and where it comes from, and the measured copy's."""
    copy = copy_bandwidth(device)
    peak, source = copy, "measured copy (read + write)"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for pattern, tbps in PEAK_BANDWIDTH_TBPS:
            if re.search(pattern, name):
                peak, source = tbps * 1e3, "spec sheet"
                break
    return {"peak_bandwidth_gbps": peak, "peak_bandwidth_source": source, "copy_bandwidth_gbps": copy}


def forward_columns(forward: list[float], point: dict) -> dict:
    """The forward's timing columns: min, median, max and the median's interval (noise.py: order
    statistics, 95 % from 6 repeats, min-max below; none under 3), and the bandwidth and TFLOP/s of
    the median (`point` holds kv_bytes, flops and the bandwidth_columns)."""
    median = statistics.median(forward)
    bandwidth = point["kv_bytes"] / median / 1e9
    low, high = median_interval(forward)
    return {
        "forward_min_ms": 1e3 * min(forward),
        "forward_median_ms": 1e3 * median,
        "forward_max_ms": 1e3 * max(forward),
        "forward_ci_low_ms": 1e3 * low,
        "forward_ci_high_ms": 1e3 * high,
        "bandwidth_gbps": bandwidth,
        "pct_of_peak_bandwidth": 100 * bandwidth / point["peak_bandwidth_gbps"],
        "pct_of_copy_bandwidth": 100 * bandwidth / point["copy_bandwidth_gbps"],
        "tflops": point["flops"] / median / 1e12,
    }
