"""`compare --peer hf`: Hugging Face transformers' continuous batching on the identical requests."""

import pandas as pd
import pytest

import pagedbench.bench.compare
import pagedbench.engine.llm_engine
from pagedbench.bench.compare import compare
from pagedbench.bench.scenario import load_scenario
from pagedbench.entrypoints.cli.main import main
from pagedbench.model.loader import resolve_model_config


def test_hf_peer_runs_the_identical_requests(tiny_models, monkeypatch):
    """Same weights (a model directory), greedy fp32: transformers' continuous batching produces
    exactly the tokens our engine does, request by request. The model is resolved once for the
    whole command (a GGUF's costs seconds): engines, peer and columns get it passed down."""
    scenario = load_scenario("mixed").scaled(0.02)
    scenario.engine.model = str(tiny_models["llama"][0])
    resolved = []

    def counted(model, **kwargs):
        resolved.append(model)
        return resolve_model_config(model, **kwargs)

    for module in (pagedbench.bench.compare, pagedbench.engine.llm_engine):
        monkeypatch.setattr(module, "resolve_model_config", counted)
    result = compare(scenario, ["sdpa", "reference"], 0.02, "cpu", "fp32", warmup=False, peers=["hf"])
    assert resolved == [scenario.model]
    rows = {r["backend"]: r for r in result.rows}
    assert rows["hf"]["status"] == "ok" and rows["hf"]["provider"].startswith("transformers ")
    assert rows["hf"]["total_output_tokens"] == rows["sdpa"]["total_output_tokens"] > 0
    assert rows["hf"]["identical_token_share"] == 1.0
    assert rows["hf"]["output_throughput"] > 0 and 0 < rows["hf"]["throughput_vs_best"] <= 1


def test_peer_on_a_preset_reports_throughput_only(tmp_path, capsys):
    code = main(
        ["compare", "--backends", "sdpa", "--peer", "hf", "--scenario", "mixed", "--scale", "0.02", "--repeats", "1"]
        + ["--model", "tiny-llama", "--device", "cpu", "--dtype", "fp32", "--no-warmup", "--out", str(tmp_path)]
    )
    assert code == 0
    df = pd.read_csv(tmp_path / "compare-mixed.csv").set_index("backend")
    assert df.loc["hf", "status"] == "ok" and pd.isna(df.loc["hf", "identical_token_share"])  # other weights
    assert df.loc["hf", "total_output_tokens"] == df.loc["sdpa", "total_output_tokens"]
    assert "| hf " in capsys.readouterr().out


def test_peer_refuses_what_it_cannot_run(tmp_path):
    scenario = load_scenario("parallel-sampling").scaled(0.02)
    scenario.engine.model = "tiny-llama"
    result = compare(scenario, [], 0.02, "cpu", "fp32", warmup=False, peers=["hf"])
    assert result.unavailable == {"hf": "n > 1: transformers' continuous batching returns one sample per request"}
    with pytest.raises(ValueError, match="unknown peer 'vllm'"):
        compare(scenario, [], 0.02, "cpu", "fp32", peers=["vllm"])
