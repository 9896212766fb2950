"""Tensor parallelism over gloo on CPU: shards that reassemble into the full weights, greedy
outputs at tp=2 identical to tp=1 (GQA split across ranks, and one KV head replicated),
under preemption and chunked prefill, and a failing worker that reaches the user quickly and
leaves no process behind."""

import multiprocessing
import os
import shutil
import signal
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedbench.entrypoints.cli.main import main
from pagedbench.entrypoints.llm import LLM
from pagedbench.model.config import ModelConfig
from pagedbench.model.loader import build_model, resolve_model_config
from pagedbench.model.parallel import TPShard
from pagedbench.sample.sampling_params import SamplingParams
from pagedbench.worker.tp_workers import WorkerError
from tests.helpers import ENGINE_BACKENDS

PRESSURE = dict(block_size=8, num_blocks=11, max_model_len=80, max_num_batched_tokens=20, max_num_seqs=4)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompts(n: int = 6, vocab: int = 320, seed: int = 7) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {"prompt_token_ids": torch.randint(3, vocab, (int(length),), generator=gen).tolist()}
        for length in torch.randint(3, 40, (n,), generator=gen)
    ]


def min_top2_gap(hf_model, prompt_ids: list[int], steps: int) -> float:
    """The smallest gap between Hugging Face's two best logits along its greedy path."""
    ids, gaps = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(steps):
            top = hf_model(torch.tensor([ids])).logits[0, -1].topk(2)
            gaps.append(float(top.values[0] - top.values[1]))
            ids.append(int(top.indices[0]))
    return min(gaps)


def decisive_prompts(hf_model, n: int = 6) -> list[dict]:
    """Prompts whose greedy continuations never pass a near-tie (top-2 gap < 1e-3): there, a
    different fp32 summation order (the all-reduce) may pick either token, legitimately."""
    chosen = [p for p in prompts(4 * n) if min_top2_gap(hf_model, p["prompt_token_ids"], GREEDY.max_tokens) > 1e-3]
    assert len(chosen) >= n
    return chosen[:n]


def no_workers_left() -> bool:
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not multiprocessing.active_children()


@pytest.mark.parametrize(
    "heads, kv_heads, size, expected",
    [
        (16, 8, 2, [((0, 8), (0, 4)), ((8, 8), (4, 4))]),  # GQA split
        (4, 1, 2, [((0, 2), (0, 1)), ((2, 2), (0, 1))]),  # one KV head, replicated
        (8, 2, 4, [((0, 2), (0, 1)), ((2, 2), (0, 1)), ((4, 2), (1, 1)), ((6, 2), (1, 1))]),
    ],
)
def test_heads_per_rank(heads, kv_heads, size, expected):
    got = [(TPShard(r, size).heads(heads), TPShard(r, size).kv_heads(kv_heads)) for r in range(size)]
    assert got == expected
    for r, ((h0, h), (k0, _)) in enumerate(got):  # each rank's q heads use the KV head it holds
        assert (h0 // (heads // kv_heads)) == k0 and ((h0 + h - 1) // (heads // kv_heads)) == k0 + got[r][1][1] - 1


def test_sizes_that_do_not_divide_the_model_are_refused():
    cfg = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 100,
            "hidden_size": 48,
            "intermediate_size": 96,
            "num_hidden_layers": 1,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
        }
    )
    TPShard(0, 2).validate(cfg)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide the model's num_attention_heads=6"):
        TPShard(0, 4).validate(cfg)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        TPShard(0, 3).validate(cfg)


@pytest.mark.parametrize("model", ["llama", "qwen3", "qwen2"])
def test_shards_reassemble_into_the_full_weights(tiny_models, model):
    cfg, path = resolve_model_config(tiny_models[model][0])
    cpu = torch.device("cpu")
    full = dict(build_model(cfg, path, cpu, torch.float32, 64, 0).named_parameters())
    shards = [dict(build_model(cfg, path, cpu, torch.float32, 64, 0, TPShard(r, 2)).named_parameters()) for r in (0, 1)]
    for name, weight in full.items():
        parts = [s[name] for s in shards]
        if not hasattr(parts[0], "tp_slice"):
            assert all(torch.equal(p, weight) for p in parts), name
            continue
        dim = parts[0].tp_slice[0]
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")) and cfg.num_kv_heads < 2:
            assert all(torch.equal(p, weight) for p in parts), name  # the one KV head on both ranks
        else:
            assert torch.equal(torch.cat(parts, dim=dim), weight), name


def test_random_preset_weights_are_the_same_at_every_size():
    cfg, _ = resolve_model_config("tiny-llama")
    cpu = torch.device("cpu")
    full = build_model(cfg, None, cpu, torch.float32, 64, 3).model.layers[1].mlp.down_proj.weight
    halves = [build_model(cfg, None, cpu, torch.float32, 64, 3, TPShard(r, 2)) for r in (0, 1)]
    assert torch.equal(torch.cat([m.model.layers[1].mlp.down_proj.weight for m in halves], dim=1), full)


def generate(path: str, backend: str, tp: int, requests: list[dict]) -> tuple[list[list[int]], int]:
    llm = LLM(path, backend=backend, tensor_parallel_size=tp, **PRESSURE)
    try:
        outputs = llm.generate(requests, GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs], llm.engine.stats.preemptions
    finally:
        llm.shutdown()


# KV heads split (llama) and one KV head replicated (qwen3), each backend once (the suite's time budget).
TP_CASES = [("llama", "flex"), ("qwen3", "sdpa"), ("qwen3", "reference")]


@pytest.mark.parametrize("model,backend", [c for c in TP_CASES if c[1] in ENGINE_BACKENDS])
def test_tp2_greedy_identical_to_tp1_under_preemption(tiny_models, model, backend):
    path, hf_model = tiny_models[model]
    requests = decisive_prompts(hf_model)
    expected, _ = generate(path, backend, 1, requests)
    got, preemptions = generate(path, backend, 2, requests)
    assert preemptions > 0, "the pressure setup must preempt"
    assert got == expected
    assert no_workers_left()


def kill_and_step(llm: LLM, pid: int, message: str, within_s: float = 10) -> None:
    """SIGKILL process `pid` mid-run: the next steps raise `message` within seconds, and no process is left."""
    engine = llm.engine
    if not engine.has_unfinished_requests():
        for p in prompts():
            engine.add_request(p, GREEDY)
        engine.step()
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=message):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < within_s
    assert no_workers_left()
    llm.shutdown()  # idempotent


def test_a_killed_worker_fails_the_step_within_seconds_and_leaves_no_process(tiny_models):
    llm = LLM(tiny_models["llama"][0], backend="sdpa", tensor_parallel_size=2, num_blocks=64)
    kill_and_step(llm, llm.engine.workers.procs[0].pid, "tensor-parallel worker pagedbench-tp1 exited with code -9")


def test_a_worker_error_reaches_the_user_as_its_message(tiny_models, tmp_path):
    """Rank 1 cannot load its part of the model (here: pipeline stage 1's layer is missing from
    the checkpoint, which stage 0 never reads): the engine raises that rank's one-line error and
    stops the other workers."""
    source = Path(tiny_models["llama"][0])
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    for file in broken.glob("*.safetensors"):
        tensors = load_file(file)
        save_file({name: t for name, t in tensors.items() if not name.startswith("model.layers.1.")}, file)
    start = time.monotonic()
    missing = r"pipeline stage rank 1: (ValueError: )?weights missing from .*model\.layers\.1\."
    with pytest.raises(WorkerError, match=missing):
        LLM(str(broken), backend="sdpa", pipeline_parallel_size=2, num_blocks=64)
    assert time.monotonic() - start < 30
    assert no_workers_left()


@pytest.mark.slow  # a whole command with worker processes
def test_cli_run_with_tensor_parallel_size(tmp_path, capsys):
    code = main(
        ["run", "--model", "tiny-llama", "--scale", "0.1", "--tensor-parallel-size", "2", "--out", str(tmp_path)]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "TP 2," in " ".join(out.split()) and "KV blocks/rank" in out  # one run: its settings on a line above
    df = pd.read_csv(tmp_path / "run-synthetic.csv")
    assert (df["tensor_parallel_size"] == 2).all()
    assert no_workers_left()


def test_cli_refuses_a_size_the_model_cannot_split(tmp_path, capsys):
    code = main(
        ["run", "--model", "tiny-llama", "--scale", "0.1", "--tensor-parallel-size", "3", "--out", str(tmp_path)]
    )
    err = capsys.readouterr().err
    assert code == 2 and "tensor_parallel_size=3 does not divide" in err and "Traceback" not in err
