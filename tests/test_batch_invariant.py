"""batch_invariant (EngineConfig): each request's logprobs bitwise the same alone or in any batch --
the model's GEMMs in fixed row tiles, attention in the backend's batch-invariant form, and a
backend without one refused with its reason."""

import pytest
import torch
import torch.nn.functional as F
from pagedbench.backends import registry

from pagedbench import LLM, SamplingParams
from pagedbench.bench.alone_check import alone_indices
from pagedbench.bench.capabilities import capability_row
from pagedbench.bench.check_determinism import run_determinism
from pagedbench.bench.compare import compare
from pagedbench.bench.scenario import load_scenario
from pagedbench.entrypoints.cli.main import main
from pagedbench.model.batch_invariant import BatchInvariantGemms, unsupported_reason
from pagedbench.model.config import ModelConfig
from pagedbench.model.presets import PRESETS
from tests.test_determinism import TINY, BatchDependent, claims_hold
from tests.test_repro import report, rerun

CPU = torch.device("cpu")
ROWS = (1, 7, 64, 256)  # the batch sizes: torch's CPU GEMM gives row 0 other bits at M=1 than at M=7


class ClaimsItUnderTheSetting(BatchDependent):
    """Batch-dependent, yet says its batch-invariant form is invariant."""

    name = "claims-under-setting"

    @classmethod
    def batch_invariance(cls, device, batch_invariant=False, **settings):
        return None if batch_invariant else cls.batch_invariant_reason


def test_tiled_gemms_give_a_row_the_same_bits_in_any_number_of_rows():
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(256, 256, generator=gen), torch.randn(96, 256, generator=gen), torch.randn(96, generator=gen)
    with BatchInvariantGemms():
        rows = [F.linear(x[:m], w, b) for m in ROWS]
        module = torch.nn.Linear(256, 96)
        assert module(x[:3]).shape == (3, 96)  # nn.Linear goes through it too
    for m, out in zip(ROWS, rows):
        assert out.shape == (m, 96) and torch.equal(out[0], rows[0][0]), f"row 0 differs at M={m}"
    assert torch.equal(rows[-1][:7], rows[1])  # every row of the smaller batch, not only the first


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_backends_in_their_batch_invariant_form_are_invariant(backend):
    rows = run_determinism([backend], CPU, [torch.float32, torch.bfloat16], batch_invariant=True, **TINY)
    claims_hold(rows)
    assert all(row["claimed_invariant"] and row["batch_invariant"] for row in rows)


@pytest.mark.slow
def test_flex_in_its_batch_invariant_form_is_invariant():
    rows = run_determinism(["flex"], CPU, [torch.float32], batch_invariant=True, variants=("plain",),
                           phases=("decode", "mixed"), batch_sizes=(1, 3))  # fmt: skip
    claims_hold(rows)


def test_a_backend_that_claims_invariance_under_the_setting_and_breaks_it_fails(monkeypatch):
    monkeypatch.setitem(registry._loaded, ClaimsItUnderTheSetting.name, ClaimsItUnderTheSetting)
    (row,) = run_determinism([ClaimsItUnderTheSetting.name], CPU, [torch.float32], phases=("decode",),
                             variants=("plain",), batch_sizes=(1, 3), batch_invariant=True)  # fmt: skip
    assert row["claimed_invariant"] and not row["batch_invariant"] and row["status"] == "fail"
    assert row["reason"].startswith("claims batch invariance but differs by")


def test_triton_in_its_batch_invariant_form_is_invariant():
    """One tile shape and no split-KV (interpreted here; without the setting its prefill rows and
    its split decodes vary with the batch: docs/correctness.md)."""
    rows = run_determinism(["triton"], CPU, [torch.float32], batch_invariant=True, phases=("decode", "mixed"),
                           variants=("plain", "window"), batch_sizes=(1, 3))  # fmt: skip
    claims_hold(rows)


def test_a_backend_without_a_batch_invariant_form_is_skipped_by_check_and_refused_by_the_engine():
    (row,) = run_determinism(["flex"], CPU, [torch.float32], phases=("decode",), variants=("sinks",),
                             batch_sizes=(1, 2), batch_invariant=True)  # fmt: skip
    assert row["status"] == "skipped" and row["reason"].startswith("refused under batch_invariant: sinks run flex")
    with pytest.raises(ValueError, match=r"^backend 'flex' cannot run batch_invariant: sinks run flex eager"):
        LLM(model="gpt-oss-20b", backend="flex", batch_invariant=True, device="cpu")  # refused before its weights
    with pytest.raises(ValueError, match=r"^cascade_attention=True cannot run with batch_invariant: a shared"):
        LLM(model="tiny-llama", batch_invariant=True, cascade_attention=True, device="cpu")


def test_a_model_with_gemms_it_does_not_tile_is_refused():
    reason = unsupported_reason(ModelConfig.from_dict(PRESETS["qwen3-30b-a3b"]))
    assert reason == "batch_invariant tiles dense models' GEMMs only; this model has mixture-of-experts layers " \
                     "(grouped expert GEMMs)"  # fmt: skip
    assert unsupported_reason(ModelConfig.from_dict(PRESETS["tiny-llama"])) is None


def greedy_alone_and_in_a_batch(batch_invariant: bool, backend: str = "sdpa"):
    llm = LLM(model="tiny-llama", backend=backend, batch_invariant=batch_invariant, dtype="fp32", device="cpu",
              preset_init="plain")  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 200 + 3 for j in range(5 + 9 * i)]} for i in range(9)]
    alone = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0]
    batched = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    logprobs = [[{t: lp.logprob for t, lp in step.items()} for step in out.logprobs] for out in (alone, batched)]
    return (alone.token_ids, batched.token_ids), logprobs


@pytest.mark.parametrize("backend", ["sdpa", "reference", pytest.param("triton", marks=pytest.mark.slow)])
def test_a_prompt_alone_and_in_a_batch_gets_bitwise_the_same_tokens_and_logprobs(backend):
    (alone, batched), (lp_alone, lp_batched) = greedy_alone_and_in_a_batch(True, backend)
    assert alone == batched and lp_alone == lp_batched


def test_without_the_setting_the_logprobs_move_with_the_batch():
    """The control: the same comparison with batch_invariant off differs (sdpa pads; GEMMs see other M)."""
    _, (lp_alone, lp_batched) = greedy_alone_and_in_a_batch(False)
    assert lp_alone != lp_batched


def test_alone_check_finds_every_request_identical_under_the_setting():
    scenario = load_scenario("mixed").scaled(0.02)
    scenario.engine.model, scenario.engine.batch_invariant, scenario.engine.preset_init = "tiny-llama", True, "plain"
    result = compare(scenario, ["sdpa"], 0.02, "cpu", "fp32", warmup=False, alone_check=3)
    (row,) = result.rows
    assert row["status"] == "ok" and row["batch_invariant"] and row["identical_alone"] == 1.0
    with pytest.raises(ValueError, match="--alone-check takes a positive number of requests, got -1"):
        compare(scenario, ["sdpa"], 0.02, "cpu", "fp32", alone_check=-1)


def test_alone_check_spreads_its_requests_over_the_set():
    assert alone_indices(10, 3) == [0, 4, 9] and alone_indices(2, 5) == [0, 1] and alone_indices(7, 1) == [0]


def test_kernels_times_each_backend_in_its_batch_invariant_form_and_its_row_reproduces(tmp_path):
    args = ["kernels", "--backends", "sdpa,flex", "--batch-sizes", "2", "--context-lens", "32", "--heads", "2/1"]
    args += ["--head-dim", "16", "--phases", "decode", "--warmup", "0", "--repeats", "1", "--batch-invariant"]
    args += ["--variants", "sinks"]
    assert main([*args, "--device", "cpu", "--out", str(tmp_path / "first")]) == 0
    rows = report(tmp_path / "first").set_index("backend")
    assert rows.loc["sdpa", "status"] == "ok" and rows.loc["sdpa", "batch_invariant"]
    assert rows.loc["flex", "status"] == "unavailable"
    assert rows.loc["flex", "reason"].startswith("refused under batch_invariant: sinks run flex eager")
    assert "--batch-invariant" in rows.loc["sdpa", "repro"]
    again = rerun(rows.loc["sdpa", "repro"], tmp_path / "again").set_index("backend")
    assert again.loc["sdpa", "batch_invariant"] and again.loc["sdpa", "status"] == "ok"


def test_the_capability_table_says_who_is_invariant_with_the_setting():
    cell = capability_row("sdpa", CPU, torch.float32, 64, 16)["batch-invariant"]
    assert cell.startswith("✓ with batch_invariant=True (else: its K/V gather is padded")
    assert capability_row("triton", CPU, torch.float32, 64, 16)["batch-invariant"].startswith("✓ with batch_invariant")
    assert "num_splits" in capability_row("flash-attn", CPU, torch.float32, 64, 16)["batch-invariant"]
