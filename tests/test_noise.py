"""Noise-aware results: intervals of the median, "tied" rankings, the notes a table carries."""

import numpy as np
import pandas as pd

from pagedbench.bench import compare as compare_module
from pagedbench.bench.noise import NO_INTERVAL, median_interval, rankings, spread
from pagedbench.bench.report_schema import SERVING_COLUMNS
from pagedbench.bench.report_tables import serving_section, serving_summary


def test_the_interval_holds_the_median_and_needs_three_runs():
    low, high = median_interval([100.0, 104.0, 98.0, 101.0, 99.0])
    assert low <= 100.0 <= high and 98.0 <= low and high <= 104.0
    assert median_interval([100.0, 104.0, 98.0, 101.0, 99.0]) == (low, high), "seeded: the same runs, the same interval"
    assert all(np.isnan(median_interval([100.0, 90.0])))


def test_overlapping_intervals_tie_and_separated_ones_give_a_ratio():
    """Timings from a fake source: a backend 3 % behind within the noise ties; one 30 % behind does not."""
    best = spread([100.0, 110.0, 95.0, 105.0])
    close = spread([97.0, 107.0, 92.0, 102.0])
    far = spread([70.0, 72.0, 69.0, 71.0])
    ranked = rankings({"flex": best, "sdpa": close, "triton": far})
    assert ranked == {"flex": "best", "sdpa": "tied", "triton": f"{far['median'] / best['median']:.2f}x"}
    one_run = rankings({"flex": spread([100.0]), "sdpa": spread([50.0])})
    assert set(one_run.values()) == {NO_INTERVAL}, "one run: no ranking presents noise as a 2x gap"


class FakeMeasurement:
    def __init__(self, throughput):
        self.row, self.outputs = {"output_throughput": throughput}, [[1, 2, 3]]


def test_compare_rows_carry_the_spread_and_the_ranking():
    measured = {
        ("flex", "off"): [FakeMeasurement(t) for t in (100.0, 104.0, 98.0)],
        ("sdpa", "off"): [FakeMeasurement(t) for t in (99.0, 103.0, 97.0)],
        ("reference", "off"): [FakeMeasurement(t) for t in (50.0, 52.0, 51.0)],
    }
    rows = [{"status": "ok", "backend": b, "speculative": "off"} for (b, _), runs in measured.items() for _ in runs]
    compare_module._add_cross_backend_columns(rows, measured, greedy=True)
    by = {r["backend"]: r for r in rows}
    assert by["flex"]["ranking"] == "best" and by["sdpa"]["ranking"] == "tied"
    assert by["reference"]["ranking"] == "0.51x"  # median 51 of 100
    assert by["flex"]["output_throughput_min"] == 98.0 and by["flex"]["output_throughput_max"] == 104.0
    assert by["flex"]["output_throughput_ci_low"] <= 100.0 <= by["flex"]["output_throughput_ci_high"]


def _serving(throughputs: dict, attention_share: float) -> pd.DataFrame:
    rows = []
    for backend, values in throughputs.items():
        for i, t in enumerate(values):
            rows.append(
                {
                    "kind": "serving",
                    "status": "ok",
                    "backend": backend,
                    "device_name": "cpu",
                    "dtype": "float32",
                    "model": "m",
                    "scenario": "s",
                    "scale": 1.0,
                    "scenario_hash": "h",
                    "num_blocks": 8,
                    "block_size": 16,
                    "max_num_seqs": 4,
                    "max_num_batched_tokens": 64,
                    "arrival": "batch",
                    "request_rate": None,
                    "repeat": i,
                    "num_requests": 4,
                    "output_throughput": t,
                    "total_token_throughput": 2 * t,
                    "attention_share": attention_share,
                    "peak_kv_utilization": 0.5,
                }  # fmt: skip
            )
    return pd.DataFrame(rows).reindex(columns=SERVING_COLUMNS)


def test_the_markdown_gives_intervals_and_says_when_attention_cannot_matter():
    text = serving_section(_serving({"flex": [100.0, 104.0, 98.0], "sdpa": [60.0, 61.0, 59.0]}, 0.006))
    assert "95% CI" in text and "98.0–104.0" in text and "0.60x" in text
    assert "the end-to-end ranking cannot reflect the attention backend" in text and "pagedbench kernels" in text
    single = serving_section(_serving({"flex": [100.0], "sdpa": [46.5]}, 0.3))
    assert NO_INTERVAL in single and "have no interval" in single
    assert "cannot reflect" not in single


def test_kernel_rows_carry_the_forward_medians_interval():
    from pagedbench.bench.timing import forward_columns

    point = {"kv_bytes": 1e9, "flops": 1e12, "peak_bandwidth_gbps": 1000.0, "copy_bandwidth_gbps": 900.0}
    row = forward_columns([0.010, 0.011, 0.0105, 0.012, 0.0102], point)
    assert row["forward_min_ms"] == 10.0 and row["forward_max_ms"] == 12.0
    assert row["forward_ci_low_ms"] <= row["forward_median_ms"] <= row["forward_ci_high_ms"]
    one = forward_columns([0.010], point)  # an interpreted backend's single call: no interval
    assert np.isnan(one["forward_ci_low_ms"])


def test_the_interval_is_min_max_below_six_runs_says_its_confidence_and_narrows_with_more():
    """Order statistics: under 6 runs no interval of the median reaches 95 %, so it is min-max with
    its own confidence (75 % at 3 runs); from 6 runs it is 95 % or more and leaves the extremes."""
    from pagedbench.bench.noise import RUNS_FOR_LEVEL, interval_text, median_interval_level

    assert RUNS_FOR_LEVEL == 6
    assert [median_interval_level(n) for n in (3, 5)] == [0.75, 0.9375] and np.isnan(median_interval_level(2))
    assert all(median_interval_level(n) >= 0.95 for n in range(6, 40))
    five = [100.0, 104.0, 98.0, 101.0, 99.0]
    assert median_interval(five) == (98.0, 104.0) and interval_text(98.0, 104.0, level=0.9375) == "98.0–104.0 (94%)"
    twelve = [float(v) for v in range(90, 102)]  # 90..101
    assert median_interval(twelve) == (92.0, 99.0)  # x(3)..x(10): narrower than min-max
    assert interval_text(92.0, 99.0, level=median_interval_level(12)) == "92.0–99.0"


def test_the_markdown_ranks_a_peer_that_ran_without_an_engine_setting():
    """A peer library's rows lack how our engine ran (compile): it is still ranked with the backends."""
    serving = _serving({"sdpa": [100.0, 104.0, 98.0], "hf": [57.0, 58.0, 56.0]}, 0.3)
    serving["compile"] = np.where(serving["backend"] == "sdpa", False, None)
    summary = serving_summary(serving).set_index("backend")
    assert summary.loc["hf", "rank"] == "0.57x" and summary.loc["hf", "vs best"] == 0.57
    assert summary.loc["sdpa", "rank"] == "best"
    assert "| 0.57x " in next(line for line in serving_section(serving).splitlines() if line.startswith("| hf "))
