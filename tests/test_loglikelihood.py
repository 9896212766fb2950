"""Multiple-choice log-likelihoods per backend and page dtype (lm-eval's scoring) against the
reference: a tiny multiple-choice set written here, on the trained byte-level pair."""

import pytest
import torch

from pagedbench.bench.loglikelihood import ChoiceItem, compare_choices, loglikelihood_check
from pagedbench.entrypoints.cli.main import main


def b(text: str) -> list[int]:
    return list(text.encode())


ITEMS = [
    ChoiceItem(b("def add(a, b):\n    return"), [b(" a + b\n"), b(" qzx(\n"), b(" }}}}\n")], answer=0),
    ChoiceItem(b("for i in range(10):\n   "), [b(" 7(]"), b(" print(i)\n")], answer=1),
    ChoiceItem(b("import os\nimport"), [b(" ]]"), b(" (("), b(" sys\n")], answer=2),
]


def test_scores_pick_the_highest_sum_and_count_agreement():
    t = torch.tensor
    base = [[t([-1.0, -1.0]), t([-3.0, -0.5])], [t([-0.1]), t([-2.0])]]  # picks 0 (-2 > -3.5) and 0
    got = [[t([-1.0, -1.5]), t([-1.0, -0.5])], [t([-0.1]), t([-2.0])]]  # picks 1 (-1.5 > -2.5) and 0
    items = [ChoiceItem([1], [[2, 3], [4, 5]], 0), ChoiceItem([1], [[2], [3]], 1)]
    row = compare_choices(got, base, items)
    assert row["argmax_agreement"] == 0.5 and row["accuracy"] == 0.0 and row["accuracy_reference"] == 0.5
    assert row["mean_abs_dlogprob"] == pytest.approx(2.5 / 6) and row["max_abs_dlogprob"] == 2.0
    assert row["choice_tokens"] == 6 and row["items"] == 2


def test_backends_agree_with_reference_and_quantized_pages_move_the_logprobs():
    rows = loglikelihood_check(["reference", "sdpa"], ["auto", "int8"], items=ITEMS)
    by = {(r["backend"], r["kv_cache_dtype"]): r for r in rows}
    assert all(r["status"] == "ok" for r in rows)
    assert by["reference", "auto"]["mean_abs_dlogprob"] == 0 and by["reference", "auto"]["argmax_agreement"] == 1
    assert by["sdpa", "auto"]["max_abs_dlogprob"] < 1e-4 and by["sdpa", "auto"]["argmax_agreement"] == 1
    assert (
        by["sdpa", "auto"]["accuracy"]
        == by["reference", "auto"]["accuracy"]
        == by["sdpa", "auto"]["accuracy_reference"]
    )
    assert 0 < by["sdpa", "int8"]["mean_abs_dlogprob"] < 0.2  # quantized pages: close, not equal
    assert by["sdpa", "auto"]["choice_tokens"] == sum(len(c) for item in ITEMS for c in item.choices)


def test_a_backend_that_cannot_read_quantized_pages_says_why():
    rows = loglikelihood_check(["flex"], ["fp8"], items=ITEMS[:1])
    assert rows[0]["status"] == "unavailable" and "fp8" in rows[0]["reason"]


@pytest.mark.slow
def test_check_loglikelihood_command_writes_its_table(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["check", "--loglikelihood", "--backends", "reference,sdpa", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "argmax_agreement" in text and (out / "check-loglikelihood.csv").exists()
    assert main(["check", "--loglikelihood", "--kv-cache-dtype", "fp5", "--out", str(out)]) == 2
