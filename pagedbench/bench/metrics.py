"""Serving metrics with vLLM benchmark_serving's names and definitions.

TTFT: first token time - arrival. E2EL: finish time - arrival. TPOT: (E2EL - TTFT) /
(output tokens - 1), only for requests with more than one output token. ITL: the gaps
between consecutive token times, pooled over all requests. Times in, milliseconds out."""

import numpy as np

from pagedbench.engine.outputs import RequestMetrics

LATENCIES = ("ttft", "tpot", "itl", "e2el")
STATISTICS = {"mean": np.mean, "median": np.median, "p99": lambda x: np.percentile(x, 99)}


def request_latencies(metrics: RequestMetrics) -> dict[str, float]:
    """One request's TTFT, TPOT (NaN with a single output token) and E2EL, in ms."""
    ttft = metrics.first_token_time - metrics.arrival_time
    e2el = metrics.finished_time - metrics.arrival_time
    num_output = len(metrics.token_times)
    tpot = (e2el - ttft) / (num_output - 1) if num_output > 1 else float("nan")
    return {"ttft_ms": 1e3 * ttft, "tpot_ms": 1e3 * tpot, "e2el_ms": 1e3 * e2el}


def latency_summary(requests: list[RequestMetrics]) -> dict[str, float]:
    """mean/median/p99 of TTFT, TPOT, ITL and E2EL over the requests (0 when there are none, as in vLLM)."""
    per_request = [request_latencies(m) for m in requests]
    samples = {
        "ttft": [r["ttft_ms"] for r in per_request],
        "tpot": [r["tpot_ms"] for r in per_request if not np.isnan(r["tpot_ms"])],
        "itl": [1e3 * gap for m in requests for gap in np.diff(m.token_times)],
        "e2el": [r["e2el_ms"] for r in per_request],
    }
    return {
        f"{stat}_{name}_ms": float(fn(samples[name])) if samples[name] else 0.0
        for name in LATENCIES
        for stat, fn in STATISTICS.items()
    }


def throughput_summary(input_lens: list[int], output_lens: list[int], duration_s: float) -> dict[str, float]:
    total_in, total_out = sum(input_lens), sum(output_lens)
    return {
        "num_requests": len(output_lens),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "duration_s": duration_s,
        "request_throughput": len(output_lens) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }


def identical_token_share(outputs: list[list[int]], baseline: list[list[int]]) -> float:
    """Share of output positions where both runs produced the same token (per request,
    position by position; a length mismatch counts as different tokens)."""
    same = sum(sum(a == b for a, b in zip(out, base)) for out, base in zip(outputs, baseline, strict=True))
    total = sum(max(len(out), len(base)) for out, base in zip(outputs, baseline))
    return same / total if total else 1.0
