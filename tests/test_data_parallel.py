"""Data parallelism: replicas in their own processes, each with its own KV cache and scheduler;
requests balanced by load, outputs in request order and equal to one engine's (greedy under
preemption, seeded sampling), counters merged, one-line errors, no process left behind, and the
same through the CLI and the server."""

import re
import types

import pandas as pd
import pytest

from pagedbench.entrypoints.cli.main import main
from pagedbench.entrypoints.llm import LLM
from pagedbench.sample.sampling_params import SamplingParams
from pagedbench.worker.tp_workers import WorkerError
from tests.test_tensor_parallel import GREEDY, PRESSURE, decisive_prompts, kill_and_step, no_workers_left, prompts

pytestmark = pytest.mark.slow  # each test starts replica processes

SEEDED = SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)


def run(path, requests, params_list, **parallel):
    """Tokens of each of `params_list`'s runs of `requests` on one engine (started once), and the engine."""
    llm = LLM(path, backend="sdpa", **PRESSURE, **parallel)
    try:
        runs = [llm.generate(requests, params, use_tqdm=False) for params in params_list]
        return [[o.outputs[0].token_ids for o in outputs] for outputs in runs], llm.engine
    finally:
        llm.shutdown()


def test_two_replicas_give_one_engines_outputs_in_request_order(tiny_models):
    path, hf_model = tiny_models["llama"]
    requests = decisive_prompts(hf_model)
    expected, _ = run(path, requests, [GREEDY, SEEDED])
    got, front = run(path, requests, [GREEDY, SEEDED], data_parallel_size=2)
    assert got == expected
    assert front.replica_load()["replica_requests"] == "6 6"  # balanced: the least loaded takes each
    assert no_workers_left()


def test_replicas_preempt_on_their_own_budget_and_their_counters_merge(tiny_models):
    path, hf_model = tiny_models["llama"]
    requests = decisive_prompts(hf_model)
    llm = LLM(path, backend="sdpa", data_parallel_size=2, **PRESSURE)
    try:
        outputs = llm.generate(requests, GREEDY, use_tqdm=False)
        counters = llm.engine.run_counters()
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert counters.stats.generation_tokens == tokens
        assert counters.stats.preemptions > 0  # each replica has PRESSURE's 11 pages
        assert llm.engine.num_blocks == 2 * PRESSURE["num_blocks"]
        assert llm.engine.world_size == 2
    finally:
        llm.shutdown()


def test_replicas_speculation_counters_reach_the_servers_metrics(tiny_models):
    """Each replica speculates (n-gram); the front's gauges sum their proposal counters, and
    /metrics' collector names them as vLLM does."""
    from pagedbench.entrypoints.openai.metrics import EngineCounters

    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    repeating = [[5, 6, 7, 8] * 6 for _ in range(4)]  # prompt lookup finds proposals in them
    llm = LLM(tiny_models["llama"][0], backend="sdpa", data_parallel_size=2, speculative_config=ngram)
    try:
        llm.generate([{"prompt_token_ids": p} for p in repeating], GREEDY, use_tqdm=False)
        gauges = llm.engine.gauges()
        assert gauges["spec_draft_tokens"] >= gauges["spec_accepted_tokens"] and gauges["spec_drafts"] > 0
        counters = {m.name: m for m in EngineCounters(types.SimpleNamespace(engine=llm.engine)).collect()}
    finally:
        llm.shutdown()
    assert counters["vllm:spec_decode_num_drafts"].samples[0].value == gauges["spec_drafts"]
    per_position = counters["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
    assert sum(s.value for s in per_position) == gauges["spec_accepted_tokens"]


def test_a_bad_request_an_abort_and_a_killed_replica(tiny_models):
    """A bad request is refused by the front before any replica sees it; an aborted request ends and
    the rest finish; a killed replica fails the next step in one line (one engine for the three)."""
    llm = LLM(tiny_models["llama"][0], backend="sdpa", data_parallel_size=2, num_blocks=64)
    engine = llm.engine
    with pytest.raises(ValueError, match="token id 99999 is outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [5, 99999]}], GREEDY, use_tqdm=False)
    assert not engine.requests
    assert len(llm.generate([{"prompt_token_ids": [5, 6]}], GREEDY, use_tqdm=False)) == 1
    ids = [engine.add_request(p, GREEDY) for p in prompts(4)]
    engine.abort_request(ids[0])
    done = {o.request_id for _ in range(500) if engine.has_unfinished_requests() for o in engine.step() if o.finished}
    assert done == set(ids[1:]) and not engine.requests
    engine.add_request(prompts(1)[0], GREEDY, request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(prompts(1)[0], GREEDY, request_id="x")
    engine.add_request(prompts(1)[0], GREEDY)  # one request on each replica
    kill_and_step(llm, engine.procs[1].pid, "pagedbench-dp1 exited with code -9", within_s=15)


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(data_parallel_size=0), "data_parallel_size must be >= 1"),
        (
            dict(data_parallel_size=2, distributed_executor_backend="external_launcher"),
            "data_parallel_size > 1 runs with distributed_executor_backend='mp'",
        ),
        (dict(data_parallel_size=2, max_model_len=10**6), "max_model_len 1000000 exceeds the model's limit"),
    ],
)
def test_bad_data_parallel_settings_are_one_line_errors(args, message):
    with pytest.raises((ValueError, WorkerError), match=message) as err:
        LLM("tiny-llama", device="cpu", num_blocks=64, **args)
    assert "\n" not in str(err.value)
    assert no_workers_left()


def test_cli_run_reports_each_replicas_load(tmp_path, capsys):
    out = tmp_path / "reports"
    code = main(["run", "--model", "tiny-llama", "--scale", "0.2", "--data-parallel-size", "2", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert "requests/replica" in capsys.readouterr().out
    row = pd.read_csv(out / "run-synthetic.csv").iloc[0]
    assert (row["data_parallel_size"], row["world_size"], row["replica_requests"]) == (2, 2, "3 3")
    assert no_workers_left()


def test_server_with_two_replicas_and_one_killed(tiny_models):
    """/metrics answers before the first request, the replicas serve and their counters merge; then
    kill -9 of one replica: the server notices within seconds (it need not be routed a request),
    stops, and exits 1 with one line naming the replica and how it ended."""
    import openai
    import psutil

    from tests.test_server import metrics, server_output, start_server

    path = tiny_models["llama"][0]
    proc, url = start_server(path, "--data-parallel-size", "2", "--num-blocks", "64")
    try:
        idle = metrics(url)  # a scrape before the first request: zeros, not a 500
        assert idle["vllm:num_requests_running"] == idle["vllm:generation_tokens_total"] == 0
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        answers = [client.completions.create(model=path, prompt=f"hello {i}", max_tokens=5) for i in range(3)]
        assert all(a.usage.completion_tokens == 5 for a in answers)
        m = metrics(url)
        assert m["vllm:generation_tokens_total"] == 15 and m["vllm:num_requests_running"] == 0
        # the two replicas: spawned, or forked from the server's fork server (child_processes.py)
        descendants = psutil.Process(proc.pid).children(recursive=True)
        replicas = [
            c
            for c in descendants
            if "spawn_main" in " ".join(c.cmdline()) or "forkserver" in " ".join(c.parent().cmdline())
        ]
        assert len(replicas) == 2, [(c.pid, c.ppid(), c.cmdline()) for c in descendants]
        replicas[-1].kill()
        rc = proc.wait(timeout=30)
    finally:
        last = server_output(proc).strip().splitlines()[-1]
    assert rc == 1 and re.fullmatch(
        r"pagedbench: error: data-parallel replica pagedbench-dp\d exited with code -9 \(killed by signal 9\); "
        r"the server stopped",
        last,
    ), last


def test_replicas_that_are_themselves_tensor_parallel(tiny_models):
    """Each replica starts its own tensor-parallel workers: 2 x 2 processes."""
    path, hf_model = tiny_models["llama"]
    requests = decisive_prompts(hf_model)
    expected, _ = run(path, requests, [GREEDY])
    got, front = run(path, requests, [GREEDY], data_parallel_size=2, tensor_parallel_size=2)
    assert got == expected and front.world_size == 4
    assert no_workers_left()
