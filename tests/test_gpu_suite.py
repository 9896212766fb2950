"""The GPU suite's CPU-side parts: its step commands parse, limits cut and kill, the budget skips,
and every result lands in the one tarball as each step ends."""

import csv
import sys
import tarfile
import time

import pytest

from pagedbench.bench import gpu_suite as suite
from pagedbench.entrypoints.cli.main import build_parser, main


def test_every_pagedbench_step_parses(tmp_path):
    """A typo in a step's flags would cost device minutes: every step's command parses here."""
    parser = build_parser()
    steps = suite.default_steps(tmp_path / "reports")
    assert [s.name for s in steps][:3] == ["environment", "pytest-cuda-failed-before", "profile-graphs"]
    assert [s.needs_fa4 for s in steps][-3:] == [True, True, True], "FA4 steps come last"
    for step in steps:
        if step.argv[1:3] == ["-m", "pagedbench"]:
            args = parser.parse_args(step.argv[3:])
            assert callable(args.func), step.name


def _steps() -> list[suite.SuiteStep]:
    py = sys.executable
    return [
        suite.SuiteStep("fine", [py, "-c", "print('measured')"], 30, needs_cuda=False),
        suite.SuiteStep("broken", [py, "-c", "raise SystemExit(3)"], 30, needs_cuda=False),
        # a child that outlives its parent's SIGTERM must die with the step's process group
        suite.SuiteStep("hangs", ["bash", "-c", "sleep 60 & sleep 60"], 2, needs_cuda=False),
        suite.SuiteStep("gpu-only", [py, "-c", "pass"], 30, needs_cuda=True),
        suite.SuiteStep("fa4-only", [py, "-c", "pass"], 30, needs_cuda=False, needs_fa4=True),
    ]


@pytest.mark.slow
def test_steps_run_under_limits_and_land_in_the_tarball(tmp_path, capsys):
    work, out = tmp_path / "work", tmp_path / "out"
    t0 = time.monotonic()
    results = suite.run_suite(_steps(), work, out, budget_s=120, cuda=False, fa4=False)
    assert time.monotonic() - t0 < 30, "the hanging step was cut at its 2 s limit"
    assert [(r.name, r.status) for r in results] == [
        ("fine", "ok"),
        ("broken", "failed"),
        ("hangs", "cut"),
        ("gpu-only", "skipped"),
        ("fa4-only", "skipped"),
    ]
    assert results[1].detail == "rc=3" and results[3].detail == "no CUDA device"
    with tarfile.open(out / suite.TARBALL) as tar:
        names = set(tar.getnames())
        log = tar.extractfile("work/logs/00-fine.log").read().decode()
    assert {"work/summary.md", "work/summary.csv", "work/logs/02-hangs.log"} <= names
    assert "measured" in log
    rows = list(csv.DictReader((work / "summary.csv").open()))
    assert [r["status"] for r in rows] == ["ok", "failed", "cut", "skipped", "skipped"]
    assert "cut at its time limit" in (work / "logs" / "02-hangs.log").read_text()


@pytest.mark.slow
def test_an_exhausted_budget_skips_the_rest_but_keeps_what_ran(tmp_path):
    py = sys.executable
    steps = [
        suite.SuiteStep("first", [py, "-c", "import time; time.sleep(1.5)"], 60, needs_cuda=False),
        suite.SuiteStep("second", [py, "-c", "pass"], 60, needs_cuda=False),
    ]
    results = suite.run_suite(steps, tmp_path / "w", tmp_path / "o", budget_s=suite.MIN_STEP_SECONDS + 1, cuda=False)
    assert [r.status for r in results] == ["ok", "skipped"]
    assert "of the budget left" in results[1].detail
    with tarfile.open(tmp_path / "o" / suite.TARBALL) as tar:
        assert "w/logs/00-first.log" in tar.getnames()


def test_fa4_halves_are_kept_until_both_are_here(tmp_path):
    stash = tmp_path / "stash"
    first, second = tmp_path / "part1", tmp_path / "part2"
    first.write_bytes(b"half one")
    assert suite.install_fa4([first, second], stash) is None
    assert (stash / "fa4.0").read_bytes() == b"half one" and not (stash / "fa4.1").exists()


@pytest.mark.slow
def test_cli_on_cpu_skips_cuda_steps_and_prints_the_summary_last(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(suite, "cuda_available", lambda: False)  # on a GPU machine too
    rc = main(["gpu-suite", "--budget", "120", "--out", "o", "--steps", "environment,pytest-cuda"])
    printed = capsys.readouterr().out
    assert rc == 0
    assert printed.rstrip().splitlines()[-1].startswith("| pytest-cuda ")
    with tarfile.open(tmp_path / "o" / suite.TARBALL) as tar:
        env_log = tar.extractfile("gpu-suite-work/logs/00-environment.log").read().decode()
    assert "copy bandwidth" in env_log and "torch" in env_log


def test_cli_rejects_an_unknown_step(capsys):
    assert main(["gpu-suite", "--steps", "kernels-decode,warp-drive"]) == 2
    assert "unknown suite step 'warp-drive'" in capsys.readouterr().err


@pytest.mark.slow
def test_profile_counts_a_decode_step_outside_and_inside_attention(tmp_path, capsys):
    """`pagedbench profile` on CPU: a tiny-llama decode step's operations, attention's apart."""
    assert main(["profile", "--backends", "sdpa", "--batch-sizes", "4", "--context", "20", "--out", str(tmp_path)]) == 0
    import pandas as pd

    row = pd.read_csv(tmp_path / "profile.csv").iloc[0]
    assert row["unit"] == "ops" and row["batch"] == 4
    # every profiled step ran all 4 sequences, each holding its 20 prompt tokens and what it decoded
    assert row["running"] == 4 and 4 * 20 < row["kv_tokens"] < 4 * (20 + 10)
    # tiny-llama's eager layer: norms, projections, RoPE, the KV write outside; sdpa's gather and call inside
    assert 10 < row["outside_attention_per_layer"] < 80
    assert row["attention_per_step"] > 0 and row["per_step"] > row["attention_per_step"]
    assert "Top ops: sdpa batch 4" in (tmp_path / "profile.md").read_text()


def test_kernels_cuda_graphs_is_refused_without_cuda(capsys):
    rc = main(["kernels", "--cuda-graphs", "--backends", "sdpa", "--device", "cpu", "--batch-sizes", "1"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err == "pagedbench: error: --cuda-graphs captures CUDA graphs: it needs a CUDA device (device is cpu)"
