"""Metric math on a hand-made trace, checked against numbers computed by hand with vLLM
benchmark_serving's definitions (p99 by linear interpolation, as np.percentile)."""

import pytest

from pagedbench.bench.metrics import identical_token_share, latency_summary, request_latencies, throughput_summary
from pagedbench.engine.outputs import RequestMetrics


def trace(arrival, token_times):
    return RequestMetrics(arrival, token_times[0], token_times, token_times[-1])


TRACE = [
    trace(0.0, [0.1, 0.3, 0.6]),  # TTFT 100, E2EL 600, TPOT (600-100)/2 = 250, ITL 200, 300
    trace(0.2, [0.5]),  # TTFT 300, E2EL 300, one output token: no TPOT, no ITL
    trace(1.0, [1.05, 1.15, 1.2, 1.4]),  # TTFT 50, E2EL 400, TPOT 350/3, ITL 100, 50, 200
]


def test_per_request_latencies():
    assert request_latencies(TRACE[0]) == pytest.approx({"ttft_ms": 100, "tpot_ms": 250, "e2el_ms": 600})
    single = request_latencies(TRACE[1])
    assert single["ttft_ms"] == pytest.approx(300) and single["tpot_ms"] != single["tpot_ms"]  # NaN


def test_latency_summary_matches_hand_computed_numbers():
    got = latency_summary(TRACE)
    want = {
        # TTFT [100, 300, 50]: p99 of sorted [50, 100, 300] at rank 1.98 -> 100 + 0.98 * 200
        "mean_ttft_ms": 150,
        "median_ttft_ms": 100,
        "p99_ttft_ms": 296,
        # TPOT over the two requests with > 1 token: [250, 116.67]
        "mean_tpot_ms": (250 + 350 / 3) / 2,
        "median_tpot_ms": (250 + 350 / 3) / 2,
        "p99_tpot_ms": 350 / 3 + 0.99 * (250 - 350 / 3),
        # ITL pooled over requests: [200, 300, 100, 50, 200]; sorted rank 3.96 -> 200 + 0.96 * 100
        "mean_itl_ms": 170,
        "median_itl_ms": 200,
        "p99_itl_ms": 296,
        # E2EL [600, 300, 400]
        "mean_e2el_ms": 1300 / 3,
        "median_e2el_ms": 400,
        "p99_e2el_ms": 596,
    }
    assert got == pytest.approx(want)


def test_empty_samples_are_zero_as_in_vllm():
    got = latency_summary([TRACE[1]])
    assert got["mean_tpot_ms"] == 0 and got["p99_itl_ms"] == 0 and got["mean_ttft_ms"] == pytest.approx(300)


def test_throughput_summary():
    got = throughput_summary([10, 20, 30], [3, 1, 4], duration_s=2.0)
    assert got == pytest.approx(
        {
            "num_requests": 3,
            "total_input_tokens": 60,
            "total_output_tokens": 8,
            "duration_s": 2.0,
            "request_throughput": 1.5,
            "output_throughput": 4.0,
            "total_token_throughput": 34.0,
        }
    )


def test_identical_token_share():
    assert identical_token_share([[1, 2, 3], [4]], [[1, 2, 3], [4]]) == 1.0
    assert identical_token_share([[1, 2, 9, 9]], [[1, 2, 3, 4]]) == 0.5
    assert identical_token_share([[1, 2]], [[1, 2, 3, 4]]) == 0.5  # missing tokens count as different
    with pytest.raises(ValueError):
        identical_token_share([[1]], [[1], [2]])
