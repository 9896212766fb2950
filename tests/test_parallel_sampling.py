"""n and best_of: one prompt prefilled once, forked into samples that share its pages
(copy-on-write on the partial last page). Each seeded sample equals the same request run alone
with its per-sample seed (seed + index), on every CPU backend, with prefix caching on and off and
under preemption; best_of returns the n samples with the highest cumulative logprob, which are
the model's own (checked against Hugging Face)."""

import pytest
import torch

from pagedbench import LLM, BeamSearchParams, SamplingParams
from tests.helpers import ENGINE_BACKENDS

PROMPTS = [list(range(3, 8)), list(range(40, 56)), list(range(100, 137))]  # partial page, exactly one, 2+ pages
SETUPS = {
    "roomy": dict(block_size=16),
    "pressure": dict(block_size=4, num_blocks=40, max_num_batched_tokens=16, max_model_len=60),
}


def params(**kwargs):
    return SamplingParams(**{"temperature": 0.9, "max_tokens": 12, "ignore_eos": True, **kwargs})


def tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("backend", ENGINE_BACKENDS)
def test_forked_samples_equal_separate_seeded_requests(tiny_models, backend, caching, setup):
    llm = LLM(
        tiny_models["llama"][0],
        backend=backend,
        dtype="float32",
        device="cpu",
        enable_prefix_caching=caching,
        **SETUPS[setup],
    )
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    n = 4
    forked = llm.generate(prompts, [params(n=n, seed=10 * i) for i in range(len(PROMPTS))], use_tqdm=False)
    engine, bm = llm.engine, llm.engine.block_manager
    assert engine.stats.block_copies > 0, "the partial last page was never copied on write"
    assert engine.stats.peak_shared_blocks > 0
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.pool.ref_counts)
    if setup == "pressure":
        assert engine.stats.preemptions > 0
    separate = [
        [llm.generate([prompt], params(seed=10 * i + j), use_tqdm=False)[0].outputs[0].token_ids for j in range(n)]
        for i, prompt in enumerate(prompts)
    ]
    assert tokens(forked) == separate
    assert all([c.index for c in o.outputs] == list(range(n)) for o in forked)
    assert all(len({tuple(t) for t in sample}) > 1 for sample in separate), "samples should differ"


def test_one_prefill_serves_all_samples(tiny_models):
    llm = LLM(tiny_models["llama"][0], dtype="float32", device="cpu", enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request({"prompt_token_ids": PROMPTS[2]}, params(n=5, max_tokens=3))
    first = engine.step()  # the whole prompt in one step, then five samples from its last row
    assert [len(c.token_ids) for c in first[0].outputs] == [1] * 5
    assert engine.block_manager.num_used_blocks == 3  # 37 tokens in pages of 16, shared by all five
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats.steps == 3


def test_best_of_returns_the_n_most_likely_samples(tiny_models):
    path, hf = tiny_models["llama"]
    llm = LLM(path, dtype="float32", device="cpu")
    prompt = {"prompt_token_ids": PROMPTS[0]}
    all_five = llm.generate([prompt], params(n=5, seed=3, temperature=1.5), use_tqdm=False)[0].outputs
    best_two = llm.generate([prompt], params(n=2, best_of=5, seed=3, temperature=1.5), use_tqdm=False)[0].outputs
    ranked = sorted(all_five, key=lambda c: -c.cumulative_logprob)
    assert [c.token_ids for c in best_two] == [c.token_ids for c in ranked[:2]]
    assert best_two[0].cumulative_logprob >= best_two[1].cumulative_logprob
    for c in all_five:  # the model's logprobs of the sampled tokens, as Hugging Face computes them
        ids = torch.tensor([PROMPTS[0] + c.token_ids])
        with torch.no_grad():
            logprobs = hf(ids).logits[0, :-1].log_softmax(-1)
        expected = logprobs[len(PROMPTS[0]) - 1 :].gather(-1, ids[0, len(PROMPTS[0]) :, None]).sum().item()
        assert c.cumulative_logprob == pytest.approx(expected, abs=1e-3)
    assert llm.generate([prompt], params(seed=3), use_tqdm=False)[0].outputs[0].cumulative_logprob is None


def test_samples_stop_on_their_own(tiny_models):
    llm = LLM(tiny_models["llama"][0], dtype="float32", device="cpu")
    out = llm.generate(
        [{"prompt_token_ids": PROMPTS[1]}],
        params(n=6, seed=0, temperature=5.0, max_tokens=30, stop_token_ids=list(range(3, 200))),
        use_tqdm=False,
    )[0]
    assert out.finished and len(out.outputs) == 6
    assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
    assert len({len(c.token_ids) for c in out.outputs}) > 1, "samples should stop at different lengths"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(n=0), "n must be >= 1"),
        (dict(n=3, best_of=2), "best_of must be >= n"),
        (dict(n=1.5), "n must be an int"),
    ],
)
def test_bad_n_and_best_of(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        SamplingParams(**kwargs)


def test_greedy_n_gives_n_identical_samples(tiny_models):
    """As vLLM and OpenAI: greedy with n > 1 is accepted, every sample the one greedy answer."""
    llm = LLM(tiny_models["llama"][0], dtype="float32", device="cpu")
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    one = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    three = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, n=3, ignore_eos=True), use_tqdm=False)
    assert [c.index for c in three[0].outputs] == [0, 1, 2]
    assert [c.token_ids for c in three[0].outputs] == [one[0].outputs[0].token_ids] * 3


def test_bad_requests_are_refused_before_anything_runs(tiny_models):
    llm = LLM(tiny_models["llama"][0], dtype="float32", device="cpu", max_num_seqs=4)
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match="best_of=5 is more than max_num_seqs=4"):
        llm.generate([good, good], [params(), params(n=5)], use_tqdm=False)
    with pytest.raises(ValueError, match="beam_width must be >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="beam_width=8 is more than max_num_seqs=4"):
        llm.beam_search([good], BeamSearchParams(beam_width=8, max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([good], params(n=2, seed=1), use_tqdm=False)[0].finished
