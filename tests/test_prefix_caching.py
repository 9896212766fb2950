"""Prefix caching: prompts sharing a prefix share its KV pages, and nothing else changes — greedy
outputs equal Hugging Face's and the uncached run's on every backend, through preemption and
chunked prefill; hits, eviction (LRU) and reset behave as vLLM's do."""

import pytest

from pagedbench import LLM, SamplingParams
from pagedbench.engine.block_manager import BlockManager
from pagedbench.engine.scheduler import Scheduler
from pagedbench.engine.sequence import Sequence
from tests.conftest import hf_greedy

PREFIX = [(7 * i) % 300 + 3 for i in range(45)]  # 2 full pages of 16 and a partial one
PROMPTS = [PREFIX + suffix for suffix in ([5, 6, 7], [8], [9, 10, 11, 12, 13, 14], list(range(20, 45)))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def generate(path, backend, caching, **kwargs):
    llm = LLM(path, backend=backend, dtype="float32", device="cpu", enable_prefix_caching=caching, **kwargs)
    first = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)  # fills the cache
    rest = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:]], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in first + rest], llm.engine.block_manager


@pytest.mark.parametrize("backend", ["reference", "sdpa", "flex"])
@pytest.mark.parametrize("setup", [{}, {"num_blocks": 12, "max_num_batched_tokens": 24}], ids=["roomy", "pressure"])
def test_cached_prefixes_change_nothing_but_the_work(tiny_models, backend, setup):
    path, hf = tiny_models["llama"]
    cached, bm = generate(path, backend, True, **setup)
    uncached, bm_off = generate(path, backend, False, **setup)
    assert cached == uncached == [hf_greedy(hf, p, 10) for p in PROMPTS]
    assert bm.prefix_cache.hits >= 3 * 32 and bm.prefix_cache.queries == sum(
        map(len, PROMPTS)
    )  # 2 pages each, the last 3
    assert bm_off.prefix_cache.hits == 0 and bm_off.prefix_cache.num_cached == 0
    assert bm.num_free_blocks == bm.num_blocks  # everything finished: all blocks free (some evictable)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "flex"])
@pytest.mark.parametrize("setup", [{}, {"num_blocks": 14, "max_num_batched_tokens": 40}], ids=["roomy", "pressure"])
def test_requests_admitted_together_share_the_prefix_in_that_step(tiny_models, backend, setup):
    """As in vLLM v1, an admitted prompt's pages are registered when scheduled: the requests
    admitted after it in the same step read them (written earlier in every layer) — same tokens."""
    path, hf = tiny_models["llama"]
    llm = LLM(path, backend=backend, dtype="float32", device="cpu", **setup)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 10) for p in PROMPTS]
    hits = [o.num_cached_tokens for o in outs]
    assert hits[0] == 0 and sum(hits[1:]) >= 32, hits  # later requests found the first one's pages
    if not setup:
        assert hits == [0, 32, 32, 32] and llm.engine.stats.steps == 10  # all four prefilled in one step


def test_concurrent_requests_read_one_page(tiny_models):
    """Requests admitted after the prefix is computed share its pages while they run."""
    path, _ = tiny_models["llama"]
    llm = LLM(path, backend="sdpa", dtype="float32", device="cpu")
    engine = llm.engine
    engine.add_request({"prompt_token_ids": PROMPTS[0]}, GREEDY)
    engine.step()  # the prefix is computed and registered
    for prompt in PROMPTS[1:]:
        engine.add_request({"prompt_token_ids": prompt}, GREEDY)
    engine.step()
    bm = engine.block_manager
    assert bm.num_shared_blocks == 2 and max(bm.pool.ref_counts) == 4
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats.peak_shared_blocks == 2


def test_full_prompt_hit_still_computes_the_last_token(tiny_models):
    path, hf = tiny_models["llama"]
    llm = LLM(path, backend="sdpa", dtype="float32", device="cpu")
    prompt = PREFIX[:32]  # exactly two pages
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert first == again == hf_greedy(hf, prompt, 4)
    # The second run found page 0 only: page 1 holds the last prompt token, which must run again.
    assert llm.engine.block_manager.prefix_cache.hits == 16


def test_reset_prefix_cache(tiny_models):
    path, _ = tiny_models["llama"]
    llm = LLM(path, backend="sdpa", dtype="float32", device="cpu")
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.prefix_cache.num_cached > 0
    llm.engine.reset_prefix_cache()
    assert bm.prefix_cache.num_cached == 0 and bm.num_free_blocks == bm.num_blocks
    llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False)
    assert bm.prefix_cache.hits == 0


def sequence(i, tokens):
    seq = Sequence(str(i), None, tokens, SamplingParams(max_tokens=1))
    seq.arrival_time = float(i)
    return seq


def run_prefill(sched, seq):
    sched.add(seq)
    out = sched.schedule()
    assert out.seqs == [seq]
    sched.step_update.computed(out)


def test_lru_eviction_takes_the_least_recently_freed_first_and_hits_are_verified_by_tokens():
    bm = BlockManager(num_blocks=6, block_size=2)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = sequence(0, [1, 2, 3, 4, 9]), sequence(1, [5, 6, 7, 8, 9])
    for seq in (a, b):
        run_prefill(sched, seq)
        sched.finish(seq, "length")
    # Each left 2 full pages cached (evictable once free); sequences free their tails first.
    assert bm.prefix_cache.num_cached == 4 and bm.num_free_blocks == 6
    c = sequence(2, [11, 12, 13, 14, 15])
    run_prefill(sched, c)  # 2 never-cached free blocks, then one eviction: a's second page
    assert bm.prefix_cache.num_cached == 3 + 2
    probe = sequence(3, [1, 2, 3, 4, 9])
    assert bm.match_prefix(probe) == 2  # a's first page survived, its second was evicted
    bm.free(probe)
    probe = sequence(4, [5, 6, 7, 8, 9])
    assert bm.match_prefix(probe) == 4 and probe.block_table == [3, 4]  # b's pages, revived
    bm.free(probe)
    assert bm.match_prefix(sequence(5, [5, 7, 9])) == 0  # another token in the page: never a hit


def test_prefix_caching_off_never_registers():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    run_prefill(sched, sequence(0, [1, 2, 3, 4, 5]))
    assert bm.prefix_cache.num_cached == 0 and bm.match_prefix(sequence(1, [1, 2, 3, 4, 5])) == 0


def test_a_step_that_raises_leaves_no_unwritten_page_in_the_cache(tiny_models, monkeypatch):
    """Pages registered for a step that never ran must not be found by later requests."""
    path, hf = tiny_models["llama"]
    llm = LLM(path, backend="sdpa", dtype="float32", device="cpu")
    engine = llm.engine
    engine.add_request({"prompt_token_ids": PROMPTS[0]}, GREEDY, request_id="a")
    run = engine.runner.run

    def interrupted(*args, **kwargs):
        monkeypatch.setattr(engine.runner, "run", run)
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.runner, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert engine.block_manager.prefix_cache.num_cached == 0
    engine.abort_request("a")
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == hf_greedy(hf, PROMPTS[0], 10)
    engine.add_request({"prompt_token_ids": PROMPTS[1]}, GREEDY, request_id="b")  # an interrupted run resumes
    monkeypatch.setattr(engine.runner, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.outputs[0].token_ids for o in finished] == [hf_greedy(hf, PROMPTS[1], 10)]
