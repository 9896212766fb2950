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
from pagedbench.model.tokenizer import preset_tokenizer

EXAMPLES = Path(str(resources.files("pagedbench.scenarios")))
BAD = Path(__file__).parent / "datasets"  # one small file per way a dataset goes wrong


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
        ("trace", "Timestamp,Request tokens,Response tokens\n0.5,abc,3\n", "line 2: Request tokens must be an integer"),
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

    row = pd.read_csv(tmp_path / "run-custom-custom-example.csv").iloc[0]
    assert row["num_requests"] == 4 and row["dataset_name"] == "custom"
    assert row["scenario"] == "custom:custom-example" and row["prompts"] == "custom"
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


@pytest.mark.parametrize(
    "name,file,message",
    [
        ("custom", "empty.jsonl", "the file: has no rows (an empty dataset)"),
        ("custom", "huge-output.jsonl", "line 2: prompt 19 + output 1,000,000,000,000 tokens is longer than "
         "max_model_len 2,048 (--skip-long-requests skips such rows)"),
        ("custom", "negative-tokens.jsonl", "line 2: output_tokens must be an integer >= 1, got -5"),
        ("custom", "too-long.jsonl", "line 2: prompt 19 + output 5,000 tokens is longer than max_model_len 2,048 "
         "(--skip-long-requests skips such rows)"),
        ("trace", "huge-request.csv", "line 3: prompt 1,000,000,000 + output 4 tokens is longer than "
         "max_model_len 2,048 (--skip-long-requests skips such rows)"),
        ("trace", "inf-timestamp.csv", "line 3: timestamp must be a finite time (seconds or an ISO date-time), "
         "got 'inf'"),
        ("trace", "fractional-tokens.csv", "line 3: input_len must be an integer >= 0, got '10.5'"),
        ("trace", "decreasing-timestamps.csv", "line 4: timestamp goes back in time (1.000 s before the row "
         "above's): timestamps must not decrease"),
        ("trace", "zero-tokens.csv", "every row: filtered out (2 of zero tokens): nothing to run"),
    ],
)  # fmt: skip
def test_a_bad_dataset_is_refused_before_anything_is_built_naming_its_line(name, file, message):
    tokenizer = preset_tokenizer(320, [0])  # a byte per token: prompt lengths in the messages are bytes
    with pytest.raises(ValueError) as e:
        load_dataset(name, BAD / file, 10, 320, tokenizer, seed=0, max_model_len=2048)
    assert str(e.value) == f"dataset {str(BAD / file)!r}: {message}"


def test_a_directory_or_a_missing_file_is_named():
    with pytest.raises(ValueError, match=r"^dataset '.*datasets' is a directory: --dataset-path takes one file"):
        load_dataset("custom", BAD, 10, 320, preset_tokenizer(320, [0]), seed=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_dataset("trace", BAD / "missing.csv", 10, 320, None, seed=0)


def test_long_requests_are_skipped_and_counted_when_asked_never_cut(caplog):
    tokenizer = preset_tokenizer(320, [0])
    got = load_dataset("custom", BAD / "too-long.jsonl", 10, 320, tokenizer, 0, max_model_len=2048, skip_long=True)
    assert [r.output_len for r in got] == [8, 8], "the 5,000-token row is skipped, not capped"
    assert "rows longer than max_model_len 2,048 skipped (--skip-long-requests): 1; kept: 2" in caplog.text
    with pytest.raises(ValueError, match=r"every row: filtered out \(3 longer than max_model_len 16\)"):
        load_dataset("custom", BAD / "too-long.jsonl", 2, 320, tokenizer, 0, max_model_len=16, skip_long=True)
    trace = load_dataset("trace", BAD / "huge-request.csv", 10, 320, None, 0, max_model_len=2048, skip_long=True)
    assert [len(r.prompt_token_ids) for r in trace] == [12]


def test_a_billion_token_trace_row_fails_fast_in_bounded_memory():
    """The lengths are checked before any prompt is built: no billion-token list on the way to the error."""
    import time
    import tracemalloc

    tracemalloc.start()
    start = time.perf_counter()
    with pytest.raises(ValueError, match="line 3: prompt 1,000,000,000"):
        load_dataset("trace", BAD / "huge-request.csv", 10, 320, None, seed=0, max_model_len=4096)
    seconds, peak = time.perf_counter() - start, tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seconds < 2 and peak < 10 * 2**20, (seconds, peak)
    with pytest.raises(ValueError, match="longer than max_model_len 4,194,304"):  # no engine given: a sane bound
        load_dataset("trace", BAD / "huge-request.csv", 10, 320, None, seed=0)


def test_lengths_are_whole_numbers_and_json_lists_name_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_len": 12.0, "output_len": "4"}\n{"timestamp": 1, "input_len": 8.5}\n')
    with pytest.raises(ValueError, match=r"line 2: input_len must be an integer >= 0, got 8.5$"):
        load_trace(path, 10, 320, np.random.default_rng(0))
    assert [len(r.prompt_token_ids) for r in load_trace(path, 1, 320, np.random.default_rng(0))] == [12]
    listed = tmp_path / "s.json"
    first = '{"conversations": [{"from": "human", "value": "hello there"},\n{"from": "gpt", "value": "hi you"}]}'
    listed.write_text(f'[\n  {first},\n  {{"conversations": 3}}\n]\n')
    with pytest.raises(ValueError, match=r": line 4, record 1: conversations must be a list"):
        load_sharegpt(listed, preset_tokenizer(320, [0]), 10, np.random.default_rng(0))


def test_skip_long_requests_is_a_dataset_setting_hashed_only_when_on():
    scenario = load_scenario("synthetic")
    with pytest.raises(ValueError, match="skip_long_requests applies to a dataset's requests"):
        scenario.replace(skip_long_requests=True).validate()
    custom = scenario.replace(dataset_name="custom", dataset_path=str(BAD / "too-long.jsonl"))
    assert custom.label == "custom:too-long" and scenario.label == "synthetic"
    skipping = custom.replace(skip_long_requests=True)
    skipping.validate()
    assert skipping.content_hash() != custom.content_hash()


@pytest.mark.slow
def test_a_run_on_a_dataset_is_named_by_it_and_skips_long_requests_only_when_asked(tmp_path, capsys, caplog):
    """tiny-llama (a byte per token) on 64 blocks of 16: max_model_len 1,024, under the file's 5,000-token row."""
    import pandas as pd

    args = ["run", "--dataset-name", "custom", "--dataset-path", str(BAD / "too-long.jsonl"), "--num-blocks", "64"]
    args += ["--no-warmup", "--out", str(tmp_path)]
    assert main(args) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]  # after the CPU threads' note
    assert error == (f"pagedbench: error: dataset {str(BAD / 'too-long.jsonl')!r}: line 2: prompt 19 + output 5,000 "
                     "tokens is longer than max_model_len 1,024 (--skip-long-requests skips such rows)")  # fmt: skip
    assert main([*args, "--skip-long-requests"]) == 0
    out = capsys.readouterr().out
    assert "rows longer than max_model_len 1,024 skipped (--skip-long-requests): 1; kept: 2" in caplog.text
    assert "dataset custom:too-long (scale 1, hash " in out and "): 2 requests, model tiny-llama" in out
    row = pd.read_csv(tmp_path / "run-custom-too-long.csv").iloc[0]
    assert (row["scenario"], row["dataset_name"], row["prompts"]) == ("custom:too-long", "custom", "custom")
    assert row["dataset_path"] == str(BAD / "too-long.jsonl") and row["num_requests"] == 2
    assert row["total_output_tokens"] == 16, "both kept requests ran in full"
    assert "custom:too-long" in (tmp_path / "run-custom-too-long.md").read_text()
    assert (tmp_path / "run-custom-too-long-throughput.png").stat().st_size > 0
