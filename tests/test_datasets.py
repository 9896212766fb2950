"""A user's own workload: the shipped ShareGPT, custom and trace examples load; bad files are
one-line errors naming the file, the record and the field; a trace's arrivals drive the runs."""

import json
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from pagedbench.bench.datasets import MAX_PROMPT_LEN, load_dataset, load_sharegpt, load_trace
from pagedbench.bench.scenario import build_requests, load_scenario
from pagedbench.entrypoints.cli.main import main

EXAMPLES = Path(str(resources.files("pagedbench.scenarios")))


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return AutoTokenizer.from_pretrained(tiny_models["llama"][0])


def test_the_shipped_sharegpt_example_loads_as_vllm_reads_it(tokenizer):
    got = load_dataset("sharegpt", EXAMPLES / "sharegpt-example.json", 100, 320, tokenizer, seed=0)
    records = json.loads((EXAMPLES / "sharegpt-example.json").read_text())
    replied = [r for r in records if len(r["conversations"]) >= 2]
    assert 0 < len(got) <= len(replied), "the conversation without a reply is skipped"
    prompts = {tuple(tokenizer.encode(r["conversations"][0]["value"], add_special_tokens=False)) for r in replied}
    assert all(tuple(r.prompt_token_ids) in prompts and r.output_len >= 4 for r in got)
    again = load_dataset("sharegpt", EXAMPLES / "sharegpt-example.json", 5, 320, tokenizer, seed=0)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in got[:5]], "seeded draw"


def test_sharegpt_length_filters(tmp_path, tokenizer):
    long = " ".join(["word"] * (MAX_PROMPT_LEN + 10))
    records = [
        {"conversations": [{"from": "human", "value": long}, {"from": "gpt", "value": "a fine answer here"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a fine answer here"}]},
        {"conversations": [{"from": "human", "value": "what is paged attention"}, {"from": "gpt", "value": "pages"}]},
        {"conversations": [{"from": "human", "value": "what is paged attention"}, {"from": "gpt", "value": "x " * 9}]},
    ]
    path = tmp_path / "s.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    got = load_sharegpt(path, tokenizer, 10, np.random.default_rng(0))
    assert len(got) == 1 and got[0].output_len >= 4


def test_the_custom_and_trace_examples_load(tokenizer):
    custom = load_dataset("custom", EXAMPLES / "custom-example.jsonl", 100, 320, tokenizer, seed=0)
    first = json.loads((EXAMPLES / "custom-example.jsonl").read_text().splitlines()[0])
    assert len(custom) == 16 and custom[0].output_len == first["output_tokens"]
    assert custom[0].prompt_token_ids == tokenizer.encode(first["prompt"], add_special_tokens=False)
    trace = load_dataset("trace", EXAMPLES / "trace-example.csv", 100, 320, None, seed=0)
    assert len(trace) == 24 and trace[0].arrival_time == 0.0
    assert all(b.arrival_time >= a.arrival_time for a, b in zip(trace, trace[1:]))
    assert len(trace[0].prompt_token_ids) == 54 and trace[0].output_len == 29  # the file's first row


def test_azure_layout_and_its_timestamps(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n"
    )
    rows = load_trace(path, 10, 1000, np.random.default_rng(0))
    assert [len(r.prompt_token_ids) for r in rows] == [374, 396] and rows[1].arrival_time == pytest.approx(4.3145790)


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("custom", '{"prompt": "hi", "output_tokens": 4}\n{"prompt": 5}', "line 2: prompt must be a string"),
        ("custom", '{"prompt": "hi", "output_tokens": "many"}', "line 1: output_tokens must be an integer >= 1"),
        ("custom", '{"prompt": "hi"', "line 1: not valid JSON"),
        ("sharegpt", '[{"conversations": "nope"}]', "record 0: conversations must be a list"),
        ("trace", "Timestamp,Request tokens,Response tokens\n0.5,abc,3\n", "row 2: Request tokens must be an integer"),
        ("trace", "when,in,out\n0,1,2\n", "columns: need one layout of"),
    ],
)  # fmt: skip
def test_a_bad_file_is_one_line_naming_file_record_and_field(tmp_path, tokenizer, name, content, message):
    path = tmp_path / ("bad.csv" if name == "trace" else "bad.jsonl")
    path.write_text(content)
    with pytest.raises(ValueError) as e:
        load_dataset(name, path, 10, 320, tokenizer, seed=0)
    text = str(e.value)
    assert "\n" not in text and str(path) in text and message in text


def test_a_trace_scenario_keeps_its_arrivals_in_the_requests():
    scenario = load_scenario("synthetic")
    scenario.dataset_name, scenario.dataset_path = "trace", str(EXAMPLES / "trace-example.csv")
    scenario.validate()
    requests = build_requests(scenario, 320)
    loaded = load_trace(EXAMPLES / "trace-example.csv", 100, 320, np.random.default_rng(scenario.seed))
    assert [r.arrival_time for r in requests] == [r.arrival_time for r in loaded][: scenario.num_prompts]
    assert [r.params.max_tokens for r in requests] == [r.output_len for r in loaded][: scenario.num_prompts]


@pytest.mark.slow
def test_run_takes_a_dataset_and_a_bad_one_is_a_one_line_error(tiny_models, tmp_path, capsys):
    model = tiny_models["llama"][0]
    args = ["run", "--model", model, "--dataset-name", "custom", "--num-blocks", "64", "--out", str(tmp_path)]
    assert main([*args, "--dataset-path", str(EXAMPLES / "custom-example.jsonl"), "--num-prompts", "4"]) == 0
    import pandas as pd

    row = pd.read_csv(tmp_path / "run-synthetic.csv").iloc[0]
    assert row["num_requests"] == 4 and row["dataset_name"] == "custom"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi", "output_tokens": 0}\n')
    capsys.readouterr()
    assert main([*args, "--dataset-path", str(bad), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pagedbench: error: dataset") and "line 1: output_tokens" in err and "\n" not in err


def test_a_trace_drives_bench_serve_arrivals_within_5_percent(monkeypatch):
    """bench-serve sends each request of a trace at its own timestamp (rate None): launch times
    measured against the schedule, with the HTTP call replaced by one that records when it ran."""
    import asyncio
    import time

    from pagedbench.bench import serve_client
    from pagedbench.bench.scenario import Request
    from pagedbench.sample.sampling_params import SamplingParams

    stamps = [0.0, 0.2, 0.25, 0.6, 1.0, 1.5]
    requests = [Request([1, 2, 3], SamplingParams(max_tokens=2), t) for t in stamps]
    launched = []

    async def record(client, model, request):
        launched.append(time.perf_counter())
        return None

    monkeypatch.setattr(serve_client, "send", record)
    results, duration = asyncio.run(serve_client.replay("http://x", "m", requests, None, None, None, 0))
    offsets = [t - launched[0] for t in launched]
    assert len(results) == len(stamps) and duration >= stamps[-1]
    for want, got in zip(stamps, offsets):
        assert abs(got - want) <= max(0.05 * want, 0.02), (want, got)
