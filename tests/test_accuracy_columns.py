"""kernels and check rows carry their error beside each timing: max_abs_error and max_rel_error
against the reference, and a status (kernels: ok, mismatch, unavailable, failed)."""

import pandas as pd
import pytest
import torch
from pagedbench.backends import registry
from pagedbench.backends.reference import ReferenceBackend

from pagedbench.bench.check import run_check
from pagedbench.bench.problems import error_columns
from pagedbench.entrypoints.cli.main import main


class OffByOne(ReferenceBackend):
    """reference plus 1e-3 everywhere: runs, times, and is wrong."""

    name = "off-by-1e-3"

    def forward(self, q, k_cache, v_cache, state, **extra):
        return super().forward(q, k_cache, v_cache, state, **extra) + 1e-3


def test_error_columns_are_absolute_and_relative_to_the_outputs_scale():
    expected = torch.tensor([[2.0, -4.0], [0.5, 0.0]])
    assert error_columns(expected + torch.tensor([[0.0, 0.5], [0.0, 0.0]]), expected) == {
        "max_abs_error": 0.5, "max_rel_error": 0.125}  # fmt: skip
    assert error_columns(expected, expected) == {"max_abs_error": 0.0, "max_rel_error": 0.0}


def test_kernels_rows_carry_their_error_and_a_wrong_backend_is_a_mismatch(tmp_path, monkeypatch):
    monkeypatch.setitem(registry._loaded, OffByOne.name, OffByOne)
    args = ["kernels", "--backends", f"reference,sdpa,{OffByOne.name},flash-attn", "--phases", "decode"]
    args += ["--batch-sizes", "2", "--context-lens", "32", "--repeats", "1", "--warmup", "0", "--device", "cpu"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    rows = pd.read_csv(tmp_path / "kernels.csv").set_index("backend")
    assert rows.loc["reference", "max_abs_error"] == 0.0 and rows.loc["reference", "status"] == "ok"
    assert rows.loc["sdpa", "status"] == "ok" and rows.loc["sdpa", "max_abs_error"] < 1e-5
    wrong = rows.loc[OffByOne.name]
    assert wrong["status"] == "mismatch" and wrong["max_abs_error"] == pytest.approx(1e-3, rel=1e-3)
    assert wrong["reason"].startswith("error 0.001 > tolerance 0.0001 against reference")
    assert wrong["forward_median_ms"] > 0  # timed all the same
    assert rows.loc["flash-attn", "status"] == "unavailable"


def test_check_rows_carry_the_relative_error_too():
    rows = [r for r in run_check(["sdpa"], torch.device("cpu"), [torch.float32]) if r["status"] == "pass"]
    assert rows and all(0 <= r["max_rel_error"] < 1e-5 and r["max_abs_error"] < 1e-5 for r in rows)
