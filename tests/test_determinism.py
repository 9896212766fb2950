"""`check --determinism`: the same call twice bitwise equal, and a backend that claims batch
invariance held to it (each sequence alone, on other pages, inside other batches)."""

import re

import pandas as pd
import pytest
import torch
from pagedbench.backends import registry
from pagedbench.backends.reference import ReferenceBackend

from pagedbench.bench.capabilities import YES, capability_row
from pagedbench.bench.check_determinism import run_determinism
from pagedbench.entrypoints.cli.main import main

CPU = torch.device("cpu")
TINY = dict(phases=("decode", "mixed"), variants=("plain", "sinks"), batch_sizes=(1, 3))


class BatchDependent(ReferenceBackend):
    """reference plus 1e-6 per sequence in the batch: deterministic, never batch-invariant."""

    name = "batch-dependent"
    batch_invariant_reason = "adds 1e-6 per sequence of its batch"

    def forward(self, q, k_cache, v_cache, state, **extra):
        return super().forward(q, k_cache, v_cache, state, **extra) + 1e-6 * len(state)


class FalselyInvariant(BatchDependent):
    name = "falsely-invariant"
    batch_invariant_reason = None  # claims it


@pytest.fixture
def fakes(monkeypatch):
    for cls in (BatchDependent, FalselyInvariant):
        monkeypatch.setitem(registry._loaded, cls.name, cls)


def claims_hold(rows: list[dict]) -> None:
    ran = [row for row in rows if row["status"] != "skipped"]
    assert ran
    for row in ran:
        where = f"{row['backend']} {row['dtype']} {row['phase']} {row['variant']}"
        assert row["deterministic"] and row["max_abs_diff_repeat"] == 0.0, where
        if row["claimed_invariant"]:
            assert row["batch_invariant"] and row["max_abs_diff_batch"] == 0.0, f"{where}: {row['reason']}"
        assert row["status"] == "pass", f"{where}: {row['reason']}"


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_claims_hold_on_cpu(backend):
    rows = run_determinism([backend], CPU, [torch.float32, torch.bfloat16], **TINY)
    claims_hold(rows)
    assert all(row["claimed_invariant"] == (backend == "reference") for row in rows)


@pytest.mark.slow
@pytest.mark.parametrize("backend, grid", [
    ("flex", TINY),
    ("triton", dict(phases=("decode",), variants=("plain",), batch_sizes=(1, 2))),  # interpreted: slow
])  # fmt: skip
def test_claims_hold_on_cpu_compiled_and_interpreted(backend, grid):
    claims_hold(run_determinism([backend], CPU, [torch.float32], **grid))


def test_a_batch_dependent_backend_is_not_invariant_by_batch_size(fakes):
    rows = run_determinism(["batch-dependent"], CPU, [torch.float32], phases=("decode",), variants=("plain",),
                           batch_sizes=(1, 3))  # fmt: skip
    (row,) = rows
    assert row["deterministic"] and not row["batch_invariant"] and row["broken_by"] == "batch size"
    assert row["max_abs_diff_batch"] == pytest.approx(2e-6, rel=0.1)  # fp32 rounding of outputs near 1
    assert row["status"] == "pass" and row["reason"] == BatchDependent.batch_invariant_reason


def test_a_false_claim_of_invariance_fails(fakes):
    (row,) = run_determinism(["falsely-invariant"], CPU, [torch.float32], phases=("prefill",), variants=("plain",),
                             batch_sizes=(1, 3))  # fmt: skip
    assert row["claimed_invariant"] and not row["batch_invariant"] and row["status"] == "fail"
    assert re.match(r"claims batch invariance but differs by 2(\.\d+)?e-06 \(batch size 3\)", row["reason"])


def test_unknown_variant_and_bad_batch_size_are_one_line_errors():
    with pytest.raises(ValueError, match="unknown variant 'nope'"):
        run_determinism(["reference"], CPU, [torch.float32], variants=("nope",))
    with pytest.raises(ValueError, match="batch sizes must be >= 1"):
        run_determinism(["reference"], CPU, [torch.float32], batch_sizes=(0, 2))


def test_the_command_writes_its_csv_and_report_reads_it(tmp_path, capsys, fakes):
    out = tmp_path / "det"
    args = ["check", "--determinism", "--dtypes", "fp32", "--batch-sizes", "1,2", "--out", str(out)]
    assert main([*args, "--backends", "reference,flash-attn"]) == 0
    printed = capsys.readouterr().out
    assert max(len(line) for line in printed.splitlines() if line.startswith("|")) <= 120 and "| reference" in printed
    frame = pd.read_csv(out / "check-determinism.csv")
    assert list(frame.columns[-12:]) == ["backend", "dtype", "phase", "variant", "deterministic", "max_abs_diff_repeat",
                                         "batch_invariant", "max_abs_diff_batch", "broken_by", "claimed_invariant",
                                         "reason", "status"]  # fmt: skip
    assert set(frame["status"]) == {"pass", "skipped"} and len(frame) == 2 * 3 * 5
    assert main(["report", str(out / "check-determinism.csv"), "--out", str(tmp_path / "r")]) == 0
    assert "Determinism and batch invariance" in next((tmp_path / "r").glob("*.md")).read_text()
    assert main([*args, "--backends", "falsely-invariant", "--overwrite"]) == 1
    assert main(["check", "--batch-sizes", "1,2", "--out", str(out)]) == 2
    assert main([*args, "--batch-sizes", "0", "--backends", "reference"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "pagedbench: error: --batch-sizes takes positive integers, got '0'"


def test_the_capability_table_says_who_is_batch_invariant():
    assert capability_row("reference", CPU, torch.float32, 64, 16)["batch-invariant"] == YES
    assert "padded" in capability_row("sdpa", CPU, torch.float32, 64, 16)["batch-invariant"]
