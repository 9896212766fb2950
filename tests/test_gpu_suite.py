"""The GPU suite's CPU-side parts: its step commands parse, limits cut and kill, the budget skips,
and every result lands in the one tarball as each step ends."""

import csv
import sys
import tarfile
import time

import pytest

from pagedbench.bench import gpu_ledger as ledger_mod
from pagedbench.bench import gpu_suite as suite
from pagedbench.entrypoints.cli.main import build_parser, main


def test_every_pagedbench_step_parses(tmp_path):
    """A typo in a step's flags would cost device minutes: every step's command parses here."""
    parser = build_parser()
    steps = suite.default_steps(tmp_path / "reports")
    assert [s.name for s in steps][:3] == ["environment", "compare-mixed", "compare-mixed-async"]
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
    ledger = list(csv.DictReader((work / "ledger.csv").open()))  # the steps that ran, with their code's hash
    assert [(r["step"], r["status"]) for r in ledger] == [("fine", "ok"), ("broken", "failed"), ("hangs", "cut")]
    assert {r["code_hash"] for r in ledger} == {ledger_mod.code_hash(suite.ENGINE_CODE)}
    assert "Not measured in this draw" in (work / "summary.md").read_text()


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


def _ledger(tmp_path, rows):
    """A committed run's ledger under reports/<card>/runN/."""
    run = tmp_path / "nvidia-h200" / f"run{len(list(tmp_path.rglob('ledger.csv'))) + 1}"
    run.mkdir(parents=True)
    ledger_mod.write_ledger([ledger_mod.LedgerRow(*r) for r in rows], run)
    return tmp_path / "nvidia-h200"


def test_next_takes_the_steps_without_a_result_on_the_code_as_it_is(tmp_path):
    steps = suite.default_steps(tmp_path / "reports")
    engine, kernels = ledger_mod.code_hash(suite.ENGINE_CODE), ledger_mod.code_hash(suite.KERNEL_CODE)
    cards = _ledger(
        tmp_path,
        [
            ("environment", "ok", 7, engine, "abc", "2026-11-27T10:00:00Z"),  # always runs
            ("compare-mixed", "ok", 108, engine, "abc", "2026-11-27T10:01:00Z"),  # measured: left out
            ("compare-mixed-async", "cut", 200, engine, "abc", "2026-11-27T10:04:00Z"),  # cut: no result
            ("profile-graphs", "ok", 131, "0123456789abcdef", "old", "2026-11-20T10:00:00Z"),  # older code
            ("kernels-decode-graphs", "failed", 98, kernels, "abc", "2026-11-27T10:09:00Z"),  # fails again here
        ],
    )
    due, done = suite.due_steps(steps, ledger_mod.read_ledgers(cards))
    names = [s.name for s in due]
    assert names[:4] == ["environment", "compare-mixed-async", "profile-graphs", "profile-graphs-async"]
    assert "compare-mixed" not in names and "kernels-decode-graphs" not in names
    assert names == [s.name for s in steps if s.name not in ("compare-mixed", "kernels-decode-graphs")]
    assert done == [
        "compare-mixed: ok on this code already (2026-11-27T10:01:00Z, abc)",
        "kernels-decode-graphs: failed on this code already (2026-11-27T10:09:00Z, abc)",
    ]


def test_a_changed_source_file_makes_its_steps_due_again(tmp_path):
    (tmp_path / "backends").mkdir()
    source = tmp_path / "backends" / "triton.py"
    source.write_text("x = 1\n")
    (tmp_path / "backends" / "notes.txt").write_text("not source")
    before = ledger_mod.code_hash(("backends",), tmp_path)
    (tmp_path / "backends" / "notes.txt").write_text("still not source")
    assert ledger_mod.code_hash(("backends",), tmp_path) == before
    source.write_text("x = 2\n")
    assert ledger_mod.code_hash(("backends",), tmp_path) != before
    assert ledger_mod.gpu_slug("NVIDIA H200") == "nvidia-h200" and ledger_mod.gpu_slug("NVIDIA H100 80GB HBM3") == (
        "nvidia-h100-80gb-hbm3"
    )


def test_a_step_reading_an_earlier_steps_files_gets_them_or_is_skipped(tmp_path):
    replay = next(s for s in suite.default_steps(tmp_path / "reports") if s.name == "kernels-replay")
    assert suite.with_inputs(replay, tmp_path)[1].startswith("no compare-mixed/*-steps.jsonl")
    recorded = tmp_path / "reports" / "compare-mixed"
    recorded.mkdir(parents=True)
    for backend in ("triton", "flex"):
        (recorded / f"compare-mixed-{backend}-steps.jsonl").write_text("{}\n")
    step, skip = suite.with_inputs(replay, tmp_path)
    assert skip is None and step.argv[step.argv.index("--replay") + 1] == ",".join(
        str(recorded / f"compare-mixed-{b}-steps.jsonl") for b in ("flex", "triton")
    )


def test_next_without_cuda_needs_its_ledger_dir(tmp_path, capsys):
    if suite.cuda_available():
        pytest.skip("this machine has CUDA: reports/<card>/ is found")
    assert main(["gpu-suite", "--next", "--work", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "--ledger-dir" in capsys.readouterr().err
