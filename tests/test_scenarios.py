"""Scenario files: parsing, one clear error per kind of bad field, scaling, and a request set
that is the same in every process."""

import hashlib
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from pagedbench.bench.scenario import (
    LengthRange,
    build_requests,
    builtin_scenarios,
    chat_conversations,
    load_scenario,
    parse_scenario,
)
from pagedbench.entrypoints.cli.main import main

REQUIRED_BUILTINS = {
    "decode-heavy",
    "prefill-heavy",
    "mixed",
    "long-context",
    "shared-prefix",
    "online",
    "parallel-sampling",
}
VALID = {
    "description": "a test workload",
    "num_prompts": 8,
    "input_len": {"min": 10, "max": 20},
    "output_len": 5,
    "kv_tokens": 1000,
}


def test_builtin_scenarios_load_and_are_listed(capsys):
    assert REQUIRED_BUILTINS <= set(builtin_scenarios())
    for name in builtin_scenarios():
        assert load_scenario(name).name == name
    assert main(["scenarios"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    for name in builtin_scenarios():
        assert f"| {name} " in out and f"{name}: " in out  # a row, and its description below the table
    assert max(map(len, out.splitlines())) <= 120  # a 120-column terminal
    assert re.search(r"\| mixed +\|.*\| tiny-llama \(qwen3-0\.6b\) +\|", out)  # what runs on this CPU
    assert "CPU threads" not in captured.err  # nothing here computes
    mixed = load_scenario("mixed")
    assert (mixed.num_prompts, mixed.input_len, mixed.output_len, mixed.ignore_eos) == (
        256,
        LengthRange(100, 1024),
        LengthRange(100, 1024),
        True,
    )
    assert load_scenario("online").arrival == "poisson"


def test_valid_file_parses_with_defaults(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(
        'description = "a test workload"\nnum_prompts = 8\ninput_len = { min = 10, max = 20 }\n'
        'output_len = 5\nkv_tokens = 1000\nblock_size = 32\nrequest_rate = 2\narrival = "poisson"\n'
    )
    s = load_scenario(str(path))
    assert s.name == "mine" and s.input_len == LengthRange(10, 20) and s.output_len == LengthRange(5, 5)
    assert s.request_rate == 2.0 and isinstance(s.request_rate, float)
    assert s.kv_blocks == 32  # ceil(1000 / 32): the budget in tokens becomes whole blocks
    assert s.temperature == 0.0 and s.num_blocks is None


@pytest.mark.parametrize(
    "change,message",
    [
        ({"num_promts": 3}, "num_promts is not a scenario field"),
        ({"num_prompts": None}, "num_prompts is required"),
        ({"num_prompts": "8"}, "num_prompts must be an int"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool"),
        ({"num_prompts": True}, "num_prompts must be an int"),
        ({"input_len": {"min": 10}}, "input_len must be an integer or {min = ..., max = ...}"),
        ({"output_len": {"min": 9, "max": 3}}, "output_len needs 1 <= min <= max"),
        ({"num_prompts": 0}, "num_prompts must be > 0"),
        ({"shared_prefix_len": -1}, "shared_prefix_len must be >= 0"),
        ({"arrival": "burst"}, "arrival must be one of batch, poisson"),
        ({"arrival": "poisson"}, "request_rate is required with arrival = 'poisson'"),
        ({"request_rate": 4.0}, "request_rate is required with arrival = 'poisson' and only then"),
        ({"arrival": "poisson", "request_rate": 0}, "request_rate must be > 0"),
        ({"num_blocks": 10}, "num_blocks or kv_tokens is required, and only one"),
        ({"kv_tokens": None}, "num_blocks or kv_tokens is required"),
        ({"temperature": -1}, "sampling temperature must be >= 0"),
        ({"n": 0}, "sampling n must be >= 1"),
        ({"n": 300, "temperature": 1.0}, "n must be <= max_num_seqs (256), got 300"),
        ({"name": "x"}, "name is not a scenario field"),
        ({"prompts": "chat", "shared_prefix_len": 4}, "shared_prefix_len must be 0 with prompts 'chat'"),
        ({"prompts": "sharegpt"}, "prompts must be one of random, python-source, chat"),
    ],
)
def test_invalid_field_is_a_one_line_error_naming_it(change, message):
    data = {k: v for k, v in {**VALID, **change}.items() if v is not None}
    with pytest.raises(ValueError) as err:
        parse_scenario(data, "bad")
    text = str(err.value)
    assert text.startswith("scenario 'bad': ") and message in text and "\n" not in text


def test_bad_toml_and_missing_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("num_prompts = = 3\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_scenario(str(path))
    with pytest.raises(FileNotFoundError, match="neither a file nor a built-in scenario"):
        load_scenario("no-such-scenario")


def test_scale_multiplies_counts_and_lengths_and_kv_by_its_square():
    s = load_scenario("mixed")
    small = s.scaled(0.1)
    assert (small.num_prompts, small.input_len, small.output_len, small.max_num_seqs) == (
        26,
        LengthRange(10, 102),
        LengthRange(10, 102),
        26,
    )
    assert small.num_blocks == round(s.kv_blocks * 0.01) and small.kv_tokens is None
    tiny = s.scaled(0.001)  # the budget never drops below one longest request
    assert tiny.num_blocks * tiny.block_size >= tiny.longest_request
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale must be a positive number"):
            s.scaled(bad)


def test_content_hash_follows_content_not_name_or_description():
    s = load_scenario("mixed")
    assert s.content_hash() == load_scenario("mixed").content_hash()
    renamed = parse_scenario({**VALID, "description": "other words"}, "renamed")
    assert renamed.content_hash() == parse_scenario(VALID, "bad").content_hash()
    assert s.scaled(0.5).content_hash() != s.content_hash()
    as_blocks = parse_scenario({**{k: v for k, v in VALID.items() if k != "kv_tokens"}, "num_blocks": 63}, "bad")
    assert as_blocks.content_hash() == parse_scenario(VALID, "bad").content_hash()  # 1000 tokens = 63 blocks
    # a JSON schema's property order is what outputs follow: two orders are two workloads
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    reordered = {**schema, "properties": dict(reversed(schema["properties"].items()))}
    hashes = {
        parse_scenario({**VALID, "structured_outputs": {"json": s}}, "j").content_hash() for s in (schema, reordered)
    }
    assert len(hashes) == 2


def test_structured_outputs_errors_name_the_field_once():
    with pytest.raises(ValueError, match=r"^scenario 's': structured_outputs\.choice must not be empty$"):
        parse_scenario({**VALID, "structured_outputs": {"choice": []}}, "s")
    with pytest.raises(ValueError, match=r"^scenario 's': structured_outputs has no field 'bogus'"):
        parse_scenario({**VALID, "structured_outputs": {"bogus": 1}}, "s")


def test_request_set_shapes():
    s = parse_scenario({**VALID, "shared_prefix_len": 4, "arrival": "poisson", "request_rate": 10.0}, "p")
    requests = build_requests(s, vocab_size=100)
    prefix = requests[0].prompt_token_ids[:4]
    for r in requests:
        assert r.prompt_token_ids[:4] == prefix
        assert 14 <= len(r.prompt_token_ids) <= 24 and r.params.max_tokens == 5 and r.params.ignore_eos
        assert all(0 <= t < 100 for t in r.prompt_token_ids)
    arrivals = [r.arrival_time for r in requests]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert all(r.arrival_time == 0 for r in build_requests(parse_scenario(VALID, "b"), 100))


def test_chat_prompts_are_conversations_under_the_chat_template():
    """prompts "chat": each prompt is a conversation cut after one of its user turns, formatted by
    the model's chat template with the assistant's turn opened; every such prompt within
    input_len is drawn once before any repeats, in an order the seed fixes."""
    from pagedbench.model.tokenizer import PRESET_CHAT_TEMPLATE, preset_tokenizer

    tokenizer = preset_tokenizer(512, [0])  # a preset's byte-level tokenizer and template
    conversations = chat_conversations()
    cuts = [c[: i + 1] for c in conversations for i, m in enumerate(c) if m["role"] == "user"]
    assert len(conversations) >= 20 and len(cuts) > len(conversations)  # multi-turn
    assert all(c[-1]["role"] == "user" for c in cuts)
    expected = {tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in cuts}
    assert "<|assistant|>" in PRESET_CHAT_TEMPLATE
    scenario = parse_scenario(
        {**VALID, "prompts": "chat", "num_prompts": len(cuts) + 5, "input_len": {"min": 1, "max": 4000}}, "c"
    )
    requests = build_requests(scenario, 512, tokenizer)
    texts = [tokenizer.decode(r.prompt_token_ids) for r in requests]
    assert set(texts[: len(cuts)]) == expected  # each once ...
    assert set(texts[len(cuts) :]) <= expected  # ... before any repeats
    assert [r.prompt_token_ids for r in build_requests(scenario, 512, tokenizer)] == [
        r.prompt_token_ids for r in requests
    ]
    short = parse_scenario({**VALID, "prompts": "chat", "input_len": {"min": 1, "max": 120}}, "c")
    assert all(len(r.prompt_token_ids) <= 120 for r in build_requests(short, 512, tokenizer))
    with pytest.raises(ValueError, match="prompts 'chat' need the model's tokenizer and chat template"):
        build_requests(scenario, 512)
    with pytest.raises(ValueError, match="no chat prompt is 1-5 tokens long"):
        build_requests(
            parse_scenario({**VALID, "prompts": "chat", "input_len": {"min": 1, "max": 5}}, "c"), 512, tokenizer
        )


def test_chat_scenario_runs_on_a_preset(tmp_path):
    """The built-in chat scenario, shrunk, end to end on a preset (byte-level tokenizer and template)."""
    args = ["run", "--scenario", "chat", "--scale", "0.05", "--model", "tiny-llama", "--no-warmup"]
    assert main([*args, "--device", "cpu", "--out", str(tmp_path)]) == 0
    import pandas as pd

    row = pd.read_csv(tmp_path / "run-chat.csv").iloc[0]
    assert row["prompts"] == "chat" and row["num_requests"] == load_scenario("chat").scaled(0.05).num_prompts


DIGEST = """
import hashlib, json
from pagedbench.bench.scenario import build_requests, load_scenario
reqs = build_requests(load_scenario("online").scaled(0.2), 32000)
rows = [(r.prompt_token_ids, r.params.max_tokens, r.arrival_time) for r in reqs]
print(hashlib.sha256(json.dumps(rows).encode()).hexdigest())
"""


@pytest.mark.slow
def test_request_set_is_identical_across_processes():
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DIGEST],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        for seed in ("1", "2")
    ]
    digests = [p.communicate(timeout=120)[0].strip() for p in procs]
    requests = build_requests(load_scenario("online").scaled(0.2), 32000)
    here = hashlib.sha256(
        json.dumps([(r.prompt_token_ids, r.params.max_tokens, r.arrival_time) for r in requests]).encode()
    ).hexdigest()
    assert digests == [here, here]
    assert len({len(r.prompt_token_ids) for r in requests}) > 1 and np.ptp([r.arrival_time for r in requests]) > 0


def test_parallel_sampling_counts_every_sample(tmp_path):
    """n samples per prompt: every sample's tokens count as output, pages are shared and copied on write."""
    args = ["run", "--scenario", "parallel-sampling", "--scale", "0.05", "--model", "tiny-llama", "--no-warmup"]
    assert main([*args, "--device", "cpu", "--out", str(tmp_path)]) == 0
    import pandas as pd

    row = pd.read_csv(tmp_path / "run-parallel-sampling.csv").iloc[0]
    scenario = load_scenario("parallel-sampling").scaled(0.05)
    requests = build_requests(scenario, 32000)
    assert row["n"] == scenario.n == 4 and row["num_requests"] == len(requests)
    assert row["total_output_tokens"] == 4 * sum(r.params.max_tokens for r in requests)  # ignore_eos
    assert row["peak_shared_blocks"] > 0 and row["block_copies"] > 0
    assert row["max_num_seqs"] >= 4
