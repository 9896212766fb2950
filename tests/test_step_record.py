"""`run --record-steps` and `kernels --replay`: a recorded step rebuilds to the metadata the engine
built (block tables, lengths, query_start_loc, slot mapping, graph padding), each backend plans it to
the same outputs, the file stays small, and the commands round-trip."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from pagedbench.backends.registry import resolve

from pagedbench import EngineConfig, LLMEngine, SamplingParams
from pagedbench.bench.replay import ReplayOptions, replay_batch, replay_metadata, run_replay
from pagedbench.bench.step_record import (
    RecordedStep,
    attach_recorder,
    decode_pages,
    encode_pages,
    expand_runs,
    read_recording,
    run_length,
)
from pagedbench.worker.cuda_graphs import pad_decode_batch

CPU_BACKENDS = ["reference", "sdpa", pytest.param("flex", marks=pytest.mark.slow)]  # flex: a CPU compile


def recorded_run(backend: str, tmp_path, limit: int = 1000, prompts: int = 6):
    """A short engine run on the tiny llama with every step recorded (and the engine's own inputs kept)."""
    config = EngineConfig(
        model="tiny-llama", backend=backend, device="cpu", dtype="float32", max_num_batched_tokens=48,
        max_num_seqs=4, num_blocks=64, enable_prefix_caching=False, compile=False,
    )  # fmt: skip
    engine = LLMEngine(config)
    engine.set_timing(True)
    recorder = attach_recorder(engine, limit, backend, "run.csv")
    seen = []
    record = recorder.record
    recorder.record = lambda inputs, timer=None: (seen.append(inputs), record(inputs, timer))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i in range(prompts):
        engine.add_request({"prompt_token_ids": list(range(5, 5 + 7 * i + 3))}, params, str(i))
    while engine.has_unfinished_requests():
        engine.step()
    path = recorder.write(tmp_path / f"{backend}-steps.jsonl")
    return engine, path, seen


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_recorded_steps_replay_to_the_engines_metadata(backend, tmp_path):
    engine, path, seen = recorded_run(backend, tmp_path)
    header, steps = read_recording(path)
    assert header["backend"] == backend and header["num_cache_blocks"] == engine.executor.runner.num_cache_blocks
    assert [s.index for s in steps] == list(range(len(seen))) and len(steps) > 5
    assert any(max(s.query_lens) > 1 and min(s.query_lens) == 1 for s in steps)  # mixed steps among them
    assert all(s.attention_ms is not None and s.attention_ms > 0 for s in steps)  # the engine's own time
    found = resolve(backend, "cpu", torch.float32, 32, 16, num_heads=8, num_kv_heads=4)
    impl = found.cls(8, 4, 32, 32**-0.5, 16, torch.device("cpu"), torch.float32)
    k, v = (torch.randn(header["num_cache_blocks"], 16, 4, 32) for _ in "kv")
    for step, inputs in zip(steps, seen):
        engine_batch, replayed = inputs.batch, replay_batch(header, step)
        for name in ("query_start_loc", "seq_lens", "context_lens", "block_table", "slot_mapping", "positions"):
            np.testing.assert_array_equal(getattr(replayed, name), getattr(engine_batch, name), err_msg=name)
        meta, engine_meta = replay_metadata(header, step, torch.device("cpu")), inputs.metadata
        for name in ("max_query_len", "max_seq_len", "num_decodes", "num_prefills", "query_start_loc_cpu"):
            assert getattr(meta, name) == getattr(engine_meta, name), name
        q = torch.randn(meta.num_tokens, 8, 32)
        replayed_out = impl.forward(q, k, v, impl.plan(meta))
        torch.testing.assert_close(replayed_out, impl.forward(q, k, v, impl.plan(engine_meta)))


def test_graph_steps_replay_padded_as_the_engine_pads():
    header = {"block_size": 16, "num_cache_blocks": 40, "pad_block": 39, "graph_width": 8, "graph_max_seq_len": 128}
    step = RecordedStep(3, [1, 1, 1], [20, 5, 40], [np.array([4, 5]), np.array([9]), np.array([12, 11, 10])], graph=8)
    eager = replay_batch(header, RecordedStep(3, step.query_lens, step.context_lens, step.pages))
    padded = replay_batch(header, step)
    np.testing.assert_array_equal(padded.block_table, pad_decode_batch(eager, 8, 8, 39).block_table)
    assert padded.block_table.shape == (8, 8) and (padded.block_table[3:, 0] == 39).all()
    assert replay_metadata(header, step, torch.device("cpu")).max_seq_len == 128


def test_pages_encode_against_the_previous_line():
    rng = np.random.default_rng(0)
    for _ in range(50):
        pages = [rng.permutation(30)[: rng.integers(0, 9)].astype(np.int32) for _ in range(5)]
        assert all((expand_runs(run_length(p)) == p).all() for p in pages)
        grown = [np.concatenate([p, rng.integers(30, 60, rng.integers(0, 3))]).astype(np.int32) for p in pages]
        encoded = encode_pages(grown, pages)
        assert all((a == b).all() for a, b in zip(decode_pages(encoded, pages), grown))
        assert all(row[0] >= 0 for row, p in zip(encoded, pages) if len(p))  # each names the row it extends
    assert run_length(np.array([9, 8, 7, 3, 4, 5, 6])) == [9, -3, 3, 4]


def test_the_record_keeps_at_most_its_limit_evenly_and_stays_small(tmp_path):
    _, path, seen = recorded_run("sdpa", tmp_path, limit=5, prompts=8)
    header, steps = read_recording(path)
    assert 3 <= len(steps) <= 5 < len(seen) and header["steps_seen"] == len(seen)
    assert np.diff([s.index for s in steps]).tolist() == [header["stride"]] * (len(steps) - 1)
    lines = path.read_text().splitlines()
    assert len(lines) == len(steps) + 1 and all(json.loads(line) for line in lines)
    per_step = max(len(line) for line in lines[1:])
    assert per_step < 60 * 4 + 400  # a few numbers per sequence (4 at most here)


def test_replay_times_every_step_beside_the_engines(tmp_path):
    _, path, _ = recorded_run("sdpa", tmp_path, prompts=3)
    summary, per_step = run_replay([str(path)], ["sdpa", "reference"], ReplayOptions(warmup=0, repeats=1))
    by_backend = {row["backend"]: row for row in summary}
    assert set(by_backend) == {"sdpa", "reference"} and all(r["status"] == "ok" for r in summary)
    sdpa = by_backend["sdpa"]
    assert sdpa["replay_attention_ms_per_step"] > 0 and sdpa["engine_over_replay"] > 0
    assert sdpa["replay_layer_ms_per_step"] * 4 == pytest.approx(sdpa["replay_attention_ms_per_step"])
    assert np.isnan(by_backend["reference"]["engine_over_replay"])  # the engine ran sdpa
    assert len(per_step) == 2 * sdpa["steps"]


@pytest.mark.slow
def test_record_and_replay_commands_round_trip(tmp_path):
    run = [sys.executable, "-m", "pagedbench"]
    subprocess.run([*run, "run", "--scenario", "mixed", "--scale", "0.03", "--model", "tiny-llama", "--no-warmup",
                    "--record-steps", "20", "--out", str(tmp_path)], check=True, capture_output=True)  # fmt: skip
    steps = tmp_path / "run-mixed-steps.jsonl"
    assert steps.is_file() and (tmp_path / "run-mixed.csv").is_file()
    out = subprocess.run([*run, "kernels", "--replay", str(steps), "--backends", "sdpa", "--repeats", "1",
                          "--out", str(tmp_path)], check=True, capture_output=True, text=True)  # fmt: skip
    assert "replay_attention_ms_per_step" in out.stdout and (tmp_path / "replay.png").is_file()
    import pandas as pd

    row = pd.read_csv(tmp_path / "replay.csv").iloc[0]
    assert row["run_attention_ms_per_step"] > 0 and row["engine_over_replay"] > 0
    bad = subprocess.run([*run, "kernels", "--replay", str(tmp_path / "none.jsonl")], capture_output=True, text=True)
    assert bad.returncode != 0 and "no such recording" in bad.stderr and "Traceback" not in bad.stderr
