"""Priority scheduling (vLLM's): the lowest priority value runs first, the highest is preempted
first, a waiting request that outranks a running one takes its place; outputs do not change."""

import pytest

from pagedbench import LLM, SamplingParams
from tests.conftest import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def finish_order(engine):
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    return order


def test_priority_decides_who_runs_first(tiny_models):
    llm = LLM(tiny_models["llama"][0], dtype="float32", device="cpu", max_num_seqs=1, scheduling_policy="priority")
    engine = llm.engine
    for rid, priority in [("a", 3), ("b", 1), ("c", 2), ("d", 0), ("e", 1)]:
        engine.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY, request_id=rid, priority=priority)
    assert finish_order(engine) == ["d", "b", "e", "c", "a"]  # ties by arrival


def test_fcfs_ignores_nothing_and_refuses_priorities(tiny_models):
    llm = LLM(tiny_models["llama"][0], dtype="float32", device="cpu", max_num_seqs=1)
    for rid in "abc":
        llm.engine.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY, request_id=rid)
    assert finish_order(llm.engine) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="priority 2 given, but scheduling_policy is 'fcfs'"):
        llm.generate([{"prompt_token_ids": [1]}], GREEDY, priority=[2], use_tqdm=False)
    with pytest.raises(ValueError, match="scheduling_policy must be"):
        LLM(tiny_models["llama"][0], device="cpu", scheduling_policy="lifo")


def test_a_higher_priority_arrival_preempts_the_lowest(tiny_models):
    path, hf = tiny_models["llama"]
    # Room for one 40-token sequence at a time (block 8, 6 blocks).
    llm = LLM(
        path, dtype="float32", device="cpu", block_size=8, num_blocks=6, max_model_len=48, scheduling_policy="priority"
    )
    engine = llm.engine
    low, high = list(range(10, 40)), list(range(50, 80))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine.add_request({"prompt_token_ids": low}, params, request_id="low", priority=5)
    engine.step()
    engine.step()
    engine.add_request({"prompt_token_ids": high}, params, request_id="high", priority=0)
    outputs = {}
    order = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outputs[o.request_id] = o
                order.append(o.request_id)
    assert order == ["high", "low"]
    assert outputs["low"].metrics.num_preemptions == 1 and outputs["high"].metrics.num_preemptions == 0
    assert outputs["low"].outputs[0].token_ids == hf_greedy(hf, low, 10)
    assert outputs["high"].outputs[0].token_ids == hf_greedy(hf, high, 10)


def test_generate_takes_priorities(tiny_models):
    path, hf = tiny_models["llama"]
    llm = LLM(path, dtype="float32", device="cpu", max_num_seqs=2, scheduling_policy="priority")
    prompts = [[5 + i, 6, 7] for i in range(4)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, priority=[3, 2, 1, 0], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
    with pytest.raises(ValueError, match="2 priorities for 4 prompts"):
        llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, priority=[0, 1], use_tqdm=False)
