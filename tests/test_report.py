"""Report rendering from hand-made rows: CSV + markdown + PNGs, and `report` merging CSVs of
two machines."""

import pandas as pd
import pytest

from pagedbench.bench.report import load_csvs, tidy, write_reports
from pagedbench.bench.report_schema import SCHEMAS
from pagedbench.entrypoints.cli.main import main


def serving_rows(device_name: str) -> tuple[list[dict], list[dict]]:
    rows, requests = [], []
    for backend, speed in (("reference", 100.0), ("sdpa", 150.0)):
        for repeat in range(2):
            rows.append(
                {
                    "device_name": device_name,
                    "backend": backend,
                    "status": "ok",
                    "reason": "",
                    "scenario": "mixed",
                    "scenario_hash": "ab" * 32,
                    "scale": 0.1,
                    "repeat": repeat,
                    "num_requests": 4,
                    "total_input_tokens": 40,
                    "total_output_tokens": 20,
                    "duration_s": 1.0,
                    "request_throughput": 4.0,
                    "output_throughput": speed + repeat,
                    "total_token_throughput": 3 * speed,
                    "mean_ttft_ms": 10,
                    "p99_ttft_ms": 12,
                    "mean_tpot_ms": 5,
                    "p99_tpot_ms": 6,
                    "mean_itl_ms": 5,
                    "p99_itl_ms": 7,
                    "mean_e2el_ms": 50,
                    "preemptions": 0,
                    "peak_kv_utilization": 0.5,
                    "time_forward_s": 0.9,
                    "time_backend_plan_s": 0.05,
                    "throughput_vs_best": speed / 150,
                    "identical_token_share": 1.0,
                }
            )
            requests += [
                {
                    "device_name": device_name,
                    "backend": backend,
                    "scenario": "mixed",
                    "repeat": repeat,
                    "request": i,
                    "ttft_ms": 10 + i,
                    "tpot_ms": 5 + i,
                    "e2el_ms": 50 + i,
                }
                for i in range(4)
            ]
    rows.append(
        {
            "device_name": device_name,
            "backend": "flash-attn",
            "status": "unavailable",
            "reason": "no CUDA device",
            "scenario": "mixed",
        }
    )
    return rows, requests


def write_machine(out, device_name):
    rows, requests = serving_rows(device_name)
    frames = {"serving": tidy(rows, "serving", "compare"), "requests": tidy(requests, "requests", "compare")}
    return write_reports(frames, out, "compare-mixed")


def test_tidy_has_exactly_the_schema():
    frame = tidy([{"backend": "sdpa", "unexpected": 1}], "serving", "run")
    assert list(frame.columns) == SCHEMAS["serving"] and frame["command"].iloc[0] == "run"


def test_write_reports_makes_csv_markdown_and_plots(tmp_path):
    paths = write_machine(tmp_path, "cpu")
    names = sorted(p.name for p in paths)
    assert names == [
        "compare-mixed-latency-cdf.png",
        "compare-mixed-requests.csv",
        "compare-mixed-throughput.png",
        "compare-mixed.csv",
        "compare-mixed.md",
    ]
    assert all(p.stat().st_size > 0 for p in paths)
    md = (tmp_path / "compare-mixed.md").read_text()
    assert "| reference " in md and "no CUDA device" in md and "compare-mixed-throughput.png" in md
    assert "151" in md or "150.5" in md  # median over the two runs of sdpa


def test_report_merges_csvs_from_two_machines(tmp_path, capsys):
    write_machine(tmp_path / "a", "cpu")
    write_machine(tmp_path / "b", "NVIDIA H100 80GB HBM3")
    out = tmp_path / "merged"
    assert (
        main(
            [
                "report",
                str(tmp_path / "a" / "compare-mixed.csv"),
                str(tmp_path / "b" / "compare-mixed.csv"),
                "--out",
                str(out),
                "--name",
                "both",
            ]
        )
        == 0
    )
    assert "both.md" in capsys.readouterr().out
    md = (out / "both.md").read_text()
    assert "NVIDIA H100 80GB HBM3" in md and "| cpu " in md
    for png in ("both-throughput.png", "both-latency-cdf.png"):
        assert (out / png).stat().st_size > 0
    merged = load_csvs([str(tmp_path / "a" / "compare-mixed.csv"), str(tmp_path / "b" / "compare-mixed.csv")])
    assert set(merged["kind"]) == {"serving", "requests"}  # per-request siblings come along for the CDFs
    assert merged["device_name"].nunique() == 2


def test_report_rejects_foreign_and_missing_csvs(tmp_path):
    foreign = tmp_path / "other.csv"
    pd.DataFrame({"a": [1]}).to_csv(foreign, index=False)
    with pytest.raises(ValueError, match="not a pagedbench CSV"):
        load_csvs([str(foreign)])
    with pytest.raises(FileNotFoundError, match="no such CSV"):
        load_csvs([str(tmp_path / "missing.csv")])


def test_runs_of_different_scales_and_models_are_never_pooled():
    from pagedbench.bench.report_plots import _labels, _title
    from pagedbench.bench.report_tables import serving_summary

    rows = []
    for scale, model in ((0.1, "tiny-llama"), (0.5, "tiny-llama"), (0.1, "qwen3-0.6b")):
        for row in serving_rows("cpu")[0]:
            rows.append({**row, "scale": scale, "model": model, "dtype": "float32"})
    serving = tidy(rows, "serving", "compare")
    summary = serving_summary(serving)
    assert len(summary) == 6 and set(zip(summary["scale"], summary["model"])) == {
        (0.1, "tiny-llama"),
        (0.5, "tiny-llama"),
        (0.1, "qwen3-0.6b"),
    }
    labels = set(_labels(serving))
    assert "sdpa · scale 0.5 · tiny-llama" in labels and "sdpa · scale 0.1 · qwen3-0.6b" in labels
    one = serving[(serving["scale"] == 0.5)]
    assert _title("Output throughput", one) == "Output throughput\nmixed, scale 0.5, tiny-llama, cpu, float32"


def test_runs_of_two_datasets_are_never_pooled():
    """A run on a user's dataset is named by it (scenario custom:<file stem>, run by compare): two
    datasets merged into one report stay two workloads in its tables and plots."""
    from pagedbench.bench.report_plots import _labels
    from pagedbench.bench.report_tables import serving_section, serving_summary

    rows = []
    for stem, digest in (("chats", "aa"), ("support", "bb")):
        dataset = {"dataset_name": "custom", "dataset_path": f"/data/{stem}.jsonl", "prompts": "custom"}
        rows += [
            {**row, "scenario": f"custom:{stem}", "scenario_hash": digest * 32, **dataset}
            for row in serving_rows("cpu")[0]
        ]
    serving = tidy(rows, "serving", "compare")
    summary = serving_summary(serving)
    assert len(summary) == 4 and set(summary["scenario"]) == {"custom:chats", "custom:support"}
    assert {"sdpa · custom:chats", "sdpa · custom:support"} <= set(_labels(serving[serving["status"] == "ok"]))
    section = serving_section(serving)
    assert "| custom:chats " in section and "| custom:support " in section


def test_cpu_rows_name_the_machine():
    """Two CPUs are two devices in a merged report: the model name and core count, not just "cpu"."""
    import os

    import torch

    from pagedbench.bench.environment import device_name

    name = device_name(torch.device("cpu"))
    assert name.startswith("cpu: ") and name.endswith(f"({os.cpu_count()} cores)") and len(name) > len("cpu: ( cores)")
