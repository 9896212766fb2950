"""The post-step contract (issue 56): Scheduler.update_from_output applies a step's model-runner output
(step_update.py) in one place, and LLMEngine's step is schedule -> execute -> update_from_output ->
outputs (engine_core.py); llm_engine.py stays within the house's 250 lines."""

from pathlib import Path

import pagedbench.engine.llm_engine
from pagedbench import LLM, SamplingParams
from pagedbench.engine.block_manager import BlockManager, blocks_needed
from pagedbench.engine.request import SequenceGroup
from pagedbench.engine.scheduler import Scheduler
from pagedbench.engine.sequence import Sequence
from pagedbench.engine.stats import EngineStats
from pagedbench.engine.step_update import ModelRunnerOutput, Sampled

BLOCK = 4


def request(requests: dict, rid: str, prompt: list[int], params: SamplingParams) -> Sequence:
    seq = Sequence(rid, None, prompt, params, arrival_time=float(len(requests)))
    requests[rid] = SequenceGroup(rid, None, prompt, params, [seq], seq.arrival_time)
    return seq


def test_update_from_output_frees_finished_trims_rejected_registers_computed_and_forks():
    bm = BlockManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    requests, stats = {}, EngineStats()
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, requests=requests, stats=stats)
    done = request(requests, "done", list(range(1, 9)), SamplingParams(max_tokens=1, ignore_eos=True))
    spec = request(requests, "spec", [21, 22, 23], SamplingParams(max_tokens=8, ignore_eos=True))
    pair = request(requests, "pair", [31, 32, 33, 34, 35], SamplingParams(n=2, max_tokens=8, ignore_eos=True))
    for seq in (done, spec, pair):
        sched.add(seq)

    # Step 1: three prompts. `done` stops at its one token; `pair` forks its second sample.
    out = sched.schedule()
    assert out.seqs == [done, spec, pair]
    child = pair.fork(1)  # as TokenPicker draws a request's samples at its first token
    ran = ModelRunnerOutput(
        [Sampled(done, [5]), Sampled(spec, [24]), Sampled(pair, [36]), Sampled(child, [37], parent=pair)]
    )
    progress = sched.update_from_output(out, ran)
    assert [(p.group.request_id, p.num_new_tokens, p.group.finished) for p in progress] == [
        ("done", 1, True),
        ("spec", 1, False),
        ("pair", 1, False),
    ]
    assert done.finished and done.finish_reason == "length" and done.block_table == []  # freed...
    assert bm.prefix_cache.num_cached == 2 + 1  # ...its two full prompt pages kept in the prefix cache, beside pair's
    assert len(pair.block_keys) == 1 and len(spec.block_keys) == 0  # full computed pages are registered
    assert requests["pair"].seqs == [pair, child] and child in sched.running
    assert child.block_table == pair.block_table and bm.pool.ref_counts[pair.block_table[0]] == 2  # pages shared
    assert child.num_computed_tokens == pair.num_computed_tokens == 5 and child.token_ids[-1] == 37
    assert (stats.prompt_tokens, stats.generation_tokens) == (16, 4)

    # Step 2: `spec` verifies 3 proposals in pages taken for them; 1 is accepted, the target adds its own.
    sched.lookahead = lambda seq: 3 if seq is spec else 0
    out = sched.schedule()
    assert dict(zip(map(id, out.seqs), out.num_tokens))[id(spec)] == 4
    assert len(spec.block_table) == 2 and spec.num_computed_tokens == 3
    spec.spec_token_ids = [25, 99, 98]
    ran = ModelRunnerOutput([Sampled(spec, [25, 26], num_proposed=3), Sampled(pair, [38]), Sampled(child, [39])])
    progress = sched.update_from_output(out, ran)
    assert [(p.group.request_id, p.num_new_tokens) for p in progress] == [("spec", 2), ("pair", 1)]
    assert spec.num_computed_tokens == 5 and spec.token_ids[-3:] == [24, 25, 26]  # 1 + 1 accepted computed
    assert len(spec.block_table) == blocks_needed(5, BLOCK) == 2 and spec.spec_token_ids == []
    assert len(spec.block_keys) == 1  # its first page is full and computed: registered
    assert (stats.spec.num_draft_tokens, stats.spec.num_accepted_tokens) == (3, 1)


def test_a_rejected_proposal_page_is_trimmed():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    requests = {}
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, requests=requests)
    seq = request(requests, "a", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    sched.add(seq)
    sched.update_from_output(sched.schedule(), ModelRunnerOutput([Sampled(seq, [4])]))  # 4 tokens, 3 computed
    sched.lookahead = lambda s: 3
    out = sched.schedule()
    assert out.num_tokens == [4] and len(seq.block_table) == 2  # 3 + 4 slots: a second page for proposals
    seq.spec_token_ids = [5, 6, 7]
    free = bm.num_free_blocks
    sched.update_from_output(out, ModelRunnerOutput([Sampled(seq, [8], num_proposed=3)]))  # none accepted
    assert seq.num_computed_tokens == 4 and seq.token_ids[-2:] == [4, 8]
    assert len(seq.block_table) == 1 and bm.num_free_blocks == free + 1  # the proposals' page went back


def test_engine_step_is_schedule_execute_update_outputs():
    llm = LLM("tiny-llama", device="cpu", num_blocks=64, seed=0)
    engine = llm.engine
    calls = []
    update = engine.scheduler.update_from_output

    def recording(sched, output):
        progress = update(sched, output)
        calls.append(([s.request_id for s in sched.seqs], [p.group.request_id for p in progress]))
        return progress

    engine.scheduler.update_from_output = recording
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for rid, prompt in (("a", [5, 6, 7]), ("b", [8, 9])):
        engine.add_request({"prompt_token_ids": prompt}, params, request_id=rid)
    steps = []
    while engine.has_unfinished_requests():
        steps.append([o.request_id for o in engine.step()])
    assert len(calls) == len(steps) == 3  # one update per step, its requests' outputs in its order
    assert [progressed for _, progressed in calls] == steps == [["a", "b"]] * 3
    assert not engine.requests and engine.block_manager.num_used_blocks == 0


def test_llm_engine_is_within_the_house_rule():
    source = Path(pagedbench.engine.llm_engine.__file__).read_text()
    assert len(source.splitlines()) <= 250
