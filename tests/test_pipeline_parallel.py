"""Pipeline parallelism over gloo on CPU: layers split over stages (evenly or as asked), each
stage built with the whole model's weights for its layers, lanes that keep one step per stage in
flight, greedy outputs at PP 2 and 3 and PP 2 x TP 2 identical to one process under preemption,
and a killed stage that reaches the user quickly and leaves no process behind."""

import pandas as pd
import pytest
import torch

from pagedbench.engine.block_manager import BlockManager
from pagedbench.engine.scheduler import Scheduler
from pagedbench.engine.sequence import Sequence
from pagedbench.entrypoints.cli.main import main
from pagedbench.entrypoints.llm import LLM
from pagedbench.model.loader import build_model, resolve_model_config
from pagedbench.model.parallel import TPShard, layer_partition, pipeline_stage
from pagedbench.sample.sampling_params import SamplingParams
from tests.conftest import TINY_MODELS, build_hf_model
from tests.test_tensor_parallel import GREEDY, PRESSURE, decisive_prompts, kill_and_step, no_workers_left, prompts


def test_layers_split_evenly_the_remainder_to_the_last_stages_or_as_asked():
    assert layer_partition(4, 2) == [2, 2]
    assert layer_partition(5, 3) == [1, 2, 2]
    assert layer_partition(5, 2, "4,1") == [4, 1]
    stages = [pipeline_stage(i, [1, 2, 2]) for i in range(3)]
    assert [list(s.layers(5)) for s in stages] == [[0], [1, 2], [3, 4]]
    assert stages[0].first and not stages[0].last and stages[2].last


@pytest.mark.parametrize(
    "size, partition, message",
    [
        (5, None, "pipeline_parallel_size=5 exceeds the model's 4 layers"),
        (2, "3,3", "must give 2 stages at least one layer each, 4 layers in all"),
        (2, "4,0", "at least one layer each"),
        (2, "two,two", "comma-separated layer counts"),
    ],
)
def test_bad_partitions_are_one_line_errors(size, partition, message):
    with pytest.raises(ValueError, match=message) as err:
        layer_partition(4, size, partition)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("model", ["qwen3", "preset"])  # qwen3: tied embeddings, the last stage's LM head
def test_each_stage_holds_the_whole_models_weights_of_its_layers(tiny_models, model):
    cfg, path = resolve_model_config(tiny_models[model][0] if model != "preset" else "tiny-llama")
    cpu = torch.device("cpu")
    whole = dict(build_model(cfg, path, cpu, torch.float32, 64, 3).named_parameters())
    counts = layer_partition(cfg.num_layers, 2)
    seen = set()
    for i, tp in [(0, TPShard()), (1, TPShard())]:
        stage = build_model(cfg, path, cpu, torch.float32, 64, 3, tp, stage=pipeline_stage(i, counts))
        for name, weight in stage.named_parameters():
            expected = whole.get(name, whole["model.embed_tokens.weight"])  # a tied LM head
            assert torch.equal(weight, expected), name
            seen.add(name)
    assert set(whole) <= seen | {"lm_head.weight"}


def test_a_lane_schedules_and_preempts_only_its_own_sequences():
    """Another lane's step may be in flight: its sequences are neither scheduled nor preempted."""
    scheduler = Scheduler(BlockManager(4, 4, False), max_num_seqs=8, max_num_batched_tokens=64)
    older, newer = (Sequence(str(i), None, [5] * 8, SamplingParams(), arrival_time=float(1 - i)) for i in (0, 1))
    newer.lane, older.lane = 0, 1
    for seq in (newer, older):
        scheduler.add(seq)
    for lane, seq in ((0, newer), (1, older)):
        out = scheduler.schedule(lane)
        assert out.seqs == [seq]  # its prompt: 2 pages of the 4
        scheduler.step_update.computed(out)
        seq.token_ids.append(7)  # its first output token: the next step needs a third page
    out = scheduler.schedule(1)  # no page is free: the older sequence must make room
    assert out.empty and out.num_preempted == 1
    assert older.status.name == "WAITING" and newer.status.name == "RUNNING"  # not the newer, in flight
    assert scheduler.schedule(0).seqs == [newer]


def generate(path: str, backend: str, requests: list[dict], **parallel) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, backend=backend, **PRESSURE, **parallel)
    try:
        outputs = llm.generate(requests, GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs], llm.engine.stats
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    spec = {"llama3": ("LlamaConfig", TINY_MODELS["llama"][1] | {"num_hidden_layers": 3})}
    path = tmp_path_factory.mktemp("pp") / "llama3"
    return str(path), build_hf_model("llama3", path, spec)


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, backend, parallel",
    [
        ("llama", "sdpa", dict(pipeline_parallel_size=2)),
        ("three-layers", "flex", dict(pipeline_parallel_size=3)),
        ("qwen3", "reference", dict(pipeline_parallel_size=2, tensor_parallel_size=2)),
    ],
)
def test_greedy_identical_to_one_process_under_preemption(tiny_models, three_layers, model, backend, parallel):
    path, hf_model = three_layers if model == "three-layers" else tiny_models[model]
    requests = decisive_prompts(hf_model)
    expected, _ = generate(path, backend, requests)
    got, stats = generate(path, backend, requests, **parallel)
    assert stats.preemptions > 0, "the pressure setup must preempt"
    assert got == expected
    assert stats.in_flight_steps / stats.steps > 1.3  # the stages overlap: most steps launch beside another
    assert no_workers_left()


@pytest.mark.slow
def test_an_abort_while_its_step_is_in_flight_waits_for_the_step(tiny_models):
    llm = LLM(tiny_models["llama"][0], backend="sdpa", pipeline_parallel_size=2, num_blocks=64)
    engine = llm.engine
    try:
        for i, p in enumerate(prompts(4)):
            engine.add_request(p, GREEDY, request_id=str(i))
        engine.step()  # both lanes launched, lane 0's step completed: lane 1's is in flight
        busy = [rid for rid in map(str, range(4)) if engine.requests[rid].lane in engine.core.busy_lanes]
        assert busy
        engine.abort_request(busy[0])
        assert busy[0] in engine.requests  # not yet: its pages are being written
        finished = {o.request_id for _ in range(200) if engine.has_unfinished_requests() for o in engine.step()}
        assert busy[0] not in engine.requests and not engine.has_unfinished_requests()
        assert set(map(str, range(4))) - {busy[0]} <= finished
        assert engine.lane_load == [0, 0]
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_killed_stage_fails_the_step_within_seconds_and_leaves_no_process(tiny_models):
    llm = LLM(tiny_models["llama"][0], backend="sdpa", pipeline_parallel_size=2, num_blocks=64)
    kill_and_step(llm, llm.engine.workers.procs[0].pid, "exited with code -9")


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(pipeline_parallel_size=5), "pipeline_parallel_size=5 exceeds the model's 4 layers"),
        (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be >= 1"),
        (
            dict(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
            "speculative decoding does not run with pipeline_parallel_size > 1",
        ),
        (
            dict(pipeline_parallel_size=2, distributed_executor_backend="external_launcher"),
            "pipeline_parallel_size > 1 runs with distributed_executor_backend='mp'",
        ),
    ],
)
def test_bad_pipeline_settings_are_one_line_errors(args, message):
    with pytest.raises(ValueError, match=message) as err:
        LLM("tiny-llama", device="cpu", num_blocks=64, **args)
    assert "\n" not in str(err.value)
    assert no_workers_left()


@pytest.mark.slow
def test_cli_run_with_pipeline_parallel_size(tmp_path, capsys):
    out = tmp_path / "reports"
    code = main(["run", "--model", "tiny-llama", "--scale", "0.1", "--pipeline-parallel-size", "2", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    row = pd.read_csv(out / "run-synthetic.csv").iloc[0]
    assert (row["pipeline_parallel_size"], row["world_size"]) == (2, 2)
    assert row["mean_steps_in_flight"] > 1
    assert no_workers_left()
