"""vLLM's distributed_executor_backend="external_launcher": torchrun starts every rank, each runs
the same engine (its own scheduler and sampler, one tensor-parallel shard of the model, logits
gathered to every rank) and returns the same outputs, equal to a single process's; the CLI under
torchrun prints and writes reports on rank 0 only; two "nodes" meet through the rendezvous."""

import json
import os
import socket
import subprocess
import sys

import pandas as pd
import pytest

from pagedbench import LLM, SamplingParams

pytestmark = pytest.mark.slow  # each test starts torchrun

SCRIPT = """
import json, os, sys
from pagedbench import LLM, SamplingParams
llm = LLM("tiny-llama", backend=sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2,
          distributed_executor_backend="external_launcher", num_blocks=64)
prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8 + i] * (i + 1)} for i in range(3)]
greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
sampled = llm.generate(prompts, SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True), use_tqdm=False)
with open(os.path.join(sys.argv[2], f"rank{os.environ['RANK']}.json"), "w") as f:
    tokens = {"greedy": greedy, "sampled": sampled}
    json.dump({k: [o.outputs[0].token_ids for o in outs] for k, outs in tokens.items()}, f)
llm.shutdown()
"""
PROMPTS = [{"prompt_token_ids": [5 + i, 6, 7, 8 + i] * (i + 1)} for i in range(3)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def ranks_output(folder) -> dict[int, dict]:
    """What each rank wrote (its own file: ranks' stdout lines interleave)."""
    return {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in folder.glob("rank*.json")}


@pytest.fixture(scope="module")
def single_process():
    llm = LLM("tiny-llama", backend="sdpa", device="cpu", dtype="float32", num_blocks=64)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    sampled = llm.generate(
        PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in greedy], [o.outputs[0].token_ids for o in sampled]


def test_two_nodes_meet_through_the_rendezvous(tmp_path, single_process):
    """Two torchrun processes, one rank each, as two "nodes" on loopback (--nnodes 2 --node-rank r):
    every rank returns the single process's greedy and seeded outputs. (Two ranks of one torchrun run
    the engine in test_cli_under_torchrun_reports_from_rank_zero and the grids' test.)"""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    port, env = free_port(), {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                str(script),
                "sdpa",
                str(tmp_path),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outs = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    ranks = ranks_output(tmp_path)
    assert sorted(ranks) == [0, 1] and all((r["greedy"], r["sampled"]) == single_process for r in ranks.values())


def test_cli_under_torchrun_reports_from_rank_zero(tmp_path):
    out = tmp_path / "reports"
    done = torchrun(
        "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "pagedbench", "run", "--scenario", "mixed",
        "--scale", "0.02", "--model", "tiny-llama", "--tensor-parallel-size", "2", "--no-warmup", "--device", "cpu",
        "--distributed-executor-backend", "external_launcher", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("| sdpa ") == 1  # one table: rank 0's
    row = pd.read_csv(out / "run-mixed.csv").iloc[0]
    assert (row["tensor_parallel_size"], row["distributed_executor_backend"]) == (2, "external_launcher")


def test_outside_torchrun_and_a_wrong_size_are_one_line_errors(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    kwargs = dict(device="cpu", tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    with pytest.raises(ValueError, match="runs under torchrun") as err:
        LLM("tiny-llama", **kwargs)
    assert "\n" not in str(err.value)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must equal the launcher's world size 1"):
        LLM("tiny-llama", **kwargs)
    import torch.distributed as dist

    assert not dist.is_initialized()  # the failed engine left the group it joined


SMALL_CHECK = """
import sys
from pagedbench.bench import check
from pagedbench.entrypoints.cli.main import main
every_case = check.build_cases
check.build_cases = lambda dtypes, full: [c for c in every_case(dtypes, full) if "GQA-4 d64" in c.name]
sys.exit(main(sys.argv[1:]))
"""


def test_check_and_kernels_grids_spread_over_ranks(tmp_path, monkeypatch):
    """torchrun ... pagedbench check|kernels: each rank runs every world-th configuration or point,
    rank 0 gathers them, and the table is a single process's (same rows, same order). The check's
    grid is cut to its small GQA-4 cases (fifteen of them: the spread is what is tested)."""
    from pagedbench.bench import check as check_module
    from pagedbench.entrypoints.cli.main import main

    script = tmp_path / "small_check.py"
    script.write_text(SMALL_CHECK)
    every_case = check_module.build_cases
    small = lambda dtypes, full: [c for c in every_case(dtypes, full) if "GQA-4 d64" in c.name]  # noqa: E731
    monkeypatch.setattr(check_module, "build_cases", small)
    check = ["check", "--backends", "reference,sdpa", "--dtypes", "fp32", "--device", "cpu"]
    kernels = ["kernels", "--backends", "sdpa", "--batch-sizes", "1,4", "--context-lens", "256", "--phases",
               "decode,mixed", "--device", "cpu", "--repeats", "2", "--warmup", "1"]  # fmt: skip
    for command, csv, columns in (
        (check, "check.csv", ["case", "backend", "status", "max_abs_error", "tolerance"]),
        (kernels, "kernels.csv", ["backend", "phase", "batch_size", "context_len", "status", "kv_bytes", "flops"]),
    ):
        alone, spread = tmp_path / f"alone-{csv}", tmp_path / f"spread-{csv}"
        assert main([*command, "--out", str(alone)]) == 0
        launched = [str(script)] if command is check else ["-m", "pagedbench"]
        done = torchrun("--nproc-per-node", "2", "--master-port", str(free_port()), *launched, *command,
                        "--out", str(spread))  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        one, two = pd.read_csv(alone / csv), pd.read_csv(spread / csv)
        assert len(one) >= 8 and one[columns].equals(two[columns]), csv
        assert done.stdout.count("reports: ") == 1  # rank 0's


GATHER = """
import sys
import torch.distributed as dist
from pagedbench.bench.ranks import gather_rows, grid_world
rank, world = grid_world()
rows = gather_rows({i: [{"point": i, "rank": rank}] for i in range(rank, 5, world)})
assert not dist.is_initialized(), "the grid's group outlives the gather"
if rank == 0:
    assert [r["point"] for r in rows] == list(range(5)) and [r["rank"] for r in rows] == [0, 1, 0, 1, 0], rows
else:
    assert rows is None
"""


def test_grid_ranks_gather_in_grid_order_and_leave_the_group(tmp_path):
    """A rank that exits with its gloo group alive can abort while rank 0 still writes reports."""
    script = tmp_path / "gather.py"
    script.write_text(GATHER)
    done = torchrun("--nproc-per-node", "2", "--master-port", str(free_port()), str(script))
    assert done.returncode == 0, done.stderr[-2000:]
