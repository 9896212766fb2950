"""Sampler semantics, seeded reproducibility, and stopping rules."""

import pytest
import torch

from pagedbench import LLM, SamplingParams
from pagedbench.engine.sequence import Sequence
from pagedbench.sample.sampler import Sampler, SamplingBatch
from pagedbench.sample.sampling_params import SamplingParams as SP
from tests.conftest import hf_greedy


def sample_many(logits_row, params, n=400, sort_top_p=False):
    seqs = [Sequence(str(i), None, [1], params) for i in range(n)]
    batch = SamplingBatch.from_seqs(seqs, logits_row.numel(), torch.device("cpu"))
    sampler = Sampler(torch.device("cpu"), seed=0)
    sampler.sort_top_p = sort_top_p  # the GPU's way (a sort) or the CPU's (rejection draws)
    return sampler(logits_row.expand(n, -1).clone(), batch).tokens


LOGITS = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])


def test_greedy_is_argmax():
    assert set(sample_many(LOGITS, SP(temperature=0)).tolist()) == {0}


def test_a_temperature_under_1e_5_is_greedy():
    """As in vLLM: dividing by a tiny temperature would overflow, so it is greedy, top-k/p aside."""
    assert SP(temperature=1e-6, top_p=0.5).greedy and not SP(temperature=1e-5).greedy
    assert set(sample_many(LOGITS * 1e3, SP(temperature=1e-7, top_k=3)).tolist()) == {0}


def test_top_k_top_p_min_p_restrict_support():
    assert set(sample_many(LOGITS, SP(top_k=2)).tolist()) == {0, 1}
    probs = LOGITS.softmax(-1)  # 0.46, 0.28, 0.17, ...: top_p 0.7 keeps tokens 0 and 1 (0.46 < 0.7 <= 0.74)
    assert probs[:1].sum() < 0.7 <= probs[:2].sum()
    assert set(sample_many(LOGITS, SP(top_p=0.7)).tolist()) == {0, 1}
    assert set(sample_many(LOGITS, SP(min_p=0.5)).tolist()) == {0, 1}  # p >= 0.5 * p_max
    assert set(sample_many(LOGITS, SP(temperature=1.0)).tolist()) >= {0, 1, 2, 3}


@pytest.mark.parametrize("sort_top_p", [False, True])
@pytest.mark.parametrize(
    "params", [SP(temperature=1.0), SP(temperature=0.5), SP(top_k=3), SP(top_p=0.8), SP(top_k=4, top_p=0.6)]
)
def test_draws_follow_the_processed_distribution(params, sort_top_p):
    """Inverse-CDF draws: token frequencies match softmax(logits / T) restricted to the kept set."""
    logits = LOGITS / params.temperature
    keep = torch.ones_like(LOGITS, dtype=torch.bool)
    if params.top_k > 0:
        keep[params.top_k :] = False  # LOGITS is sorted
    probs = logits.softmax(-1)
    probs = logits.masked_fill(~keep, float("-inf")).softmax(-1)  # top-p over the top-k renormalised
    if params.top_p < 1:
        keep &= probs.cumsum(-1) - probs < params.top_p
    expected = logits.masked_fill(~keep, float("-inf")).softmax(-1)
    freq = torch.bincount(sample_many(LOGITS, params, n=20000, sort_top_p=sort_top_p), minlength=len(LOGITS)) / 20000
    assert (freq - expected).abs().max() < 0.015
    assert (freq[~keep] == 0).all()


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.95])
def test_nucleus_draws_stay_in_the_nucleus_of_a_flat_distribution(top_p):
    """Rejection draws on a near-uniform row (a random-weight model's): the support is exactly
    the sorted nucleus, and every token in it is drawn about equally often."""
    logits = torch.randn(200, generator=torch.Generator().manual_seed(0)) * 0.3
    probs = logits.softmax(-1)
    sorted_probs, order = probs.sort(descending=True)
    nucleus = set(order[(sorted_probs.cumsum(-1) - sorted_probs) < top_p].tolist())
    drawn = sample_many(logits, SP(top_p=top_p), n=20000)
    assert set(drawn.tolist()) <= nucleus and len(set(drawn.tolist())) > 0.9 * len(nucleus)
    freq = torch.bincount(drawn, minlength=200).float() / 20000
    expected = torch.zeros(200)
    expected[list(nucleus)] = probs[list(nucleus)] / probs[list(nucleus)].sum()
    assert (freq - expected).abs().max() < 0.02


def test_top_k_alone_per_row_with_rows_that_disable_it():
    seqs = [Sequence(str(i), None, [1], SP(top_k=k)) for i, k in enumerate([1, -1, 2, 1000] * 100)]
    batch = SamplingBatch.from_seqs(seqs, len(LOGITS), torch.device("cpu"))
    assert batch.max_top_k == len(LOGITS)
    tokens = Sampler(torch.device("cpu"), seed=0)(LOGITS.expand(len(seqs), -1).clone(), batch).tokens.view(-1, 4)
    assert set(tokens[:, 0].tolist()) == {0} and set(tokens[:, 2].tolist()) == {0, 1}
    assert len(set(tokens[:, 1].tolist())) >= 4 and len(set(tokens[:, 3].tolist())) >= 4  # disabled / k >= V


def test_parameter_tensors_are_reused_for_the_same_sequences():
    seqs = [Sequence(str(i), None, [1], SP(temperature=0.5 + i, top_p=0.9, min_tokens=3)) for i in range(3)]
    first = SamplingBatch.from_seqs(seqs, 8, torch.device("cpu"), eos_token_ids=[2])
    again = SamplingBatch.from_seqs(list(seqs), 8, torch.device("cpu"), eos_token_ids=[2], previous=first)
    assert again.temperature is first.temperature and again.top_p is first.top_p
    assert again.banned is not None  # rebuilt every step: it follows the outputs
    reordered = SamplingBatch.from_seqs(seqs[::-1], 8, torch.device("cpu"), previous=first)
    assert reordered.temperature is not first.temperature
    assert reordered.temperature.tolist() == [2.5, 1.5, 0.5]


def test_temperature_sharpens_distribution():
    hot = sample_many(LOGITS, SP(temperature=5.0), n=2000)
    cold = sample_many(LOGITS, SP(temperature=0.2), n=2000)
    assert (cold == 0).float().mean() > 0.9 > (hot == 0).float().mean()


def test_seeded_request_is_identical_alone_and_in_a_batch(tiny_models):
    llm = LLM(tiny_models["llama"][0], dtype="float32", device="cpu")
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (3, 20, 40)]
    batch_params = [
        SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.7, max_tokens=30, seed=7, ignore_eos=True),
    ]
    outs = llm.generate(
        others[:2] + [prompt] + others[2:], batch_params[:2] + [seeded] + batch_params[2:], use_tqdm=False
    )
    assert outs[2].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=16, seed=99, ignore_eos=True)
    assert llm.generate([prompt], different_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


@pytest.fixture(scope="module")
def llama(tiny_models):
    path, hf = tiny_models["llama"]
    return LLM(path, dtype="float32", device="cpu"), hf


PROMPT = [11, 12, 13, 14, 15, 16, 17]


def test_stop_token_id(llama):
    llm, hf = llama
    expected = hf_greedy(hf, PROMPT, 10)
    stop_id = expected[4]
    first = expected.index(stop_id)
    out = llm.generate(
        [{"prompt_token_ids": PROMPT}],
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == expected[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def test_eos_stops_unless_ignored(llama):
    llm, hf = llama
    expected = hf_greedy(hf, PROMPT, 10)
    llm.engine.model_config.eos_token_ids = [expected[3]]
    try:
        stop = llm.generate(
            [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False
        )[0].outputs[0]
        ignore = llm.generate(
            [{"prompt_token_ids": PROMPT}],
            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
            use_tqdm=False,
        )[0].outputs[0]
    finally:
        llm.engine.model_config.eos_token_ids = [2]
    assert stop.token_ids == expected[: expected.index(expected[3]) + 1]
    assert (stop.finish_reason, stop.stop_reason) == ("stop", None)
    assert ignore.token_ids == expected and ignore.finish_reason == "length"


def test_stop_string_cuts_text(llama, tiny_models):
    llm, hf = llama
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models["llama"][0])
    prompt = tok.encode("the quick brown fox jumps")
    expected = hf_greedy(hf, prompt, 12)
    full_text = tok.decode(expected, skip_special_tokens=True)
    # a stop string drawn from the middle of the greedy text, free of partial characters
    stop = next(full_text[i : i + 2] for i in range(3, len(full_text) - 2) if "\ufffd" not in full_text[i : i + 2])
    out = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=12, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.text == full_text[: full_text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == expected[: len(out.token_ids)] and len(out.token_ids) < 12
    assert stop in tok.decode(out.token_ids, skip_special_tokens=True)


def test_stop_string_kept_when_asked(llama, tiny_models):
    llm, hf = llama
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models["llama"][0])
    prompt = tok.encode("the quick brown fox jumps")
    full_text = tok.decode(hf_greedy(hf, prompt, 12), skip_special_tokens=True)
    stop = next(full_text[i : i + 2] for i in range(3, len(full_text) - 2) if "\ufffd" not in full_text[i : i + 2])
    params = SamplingParams(temperature=0, max_tokens=12, stop=[stop], include_stop_str_in_output=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert out.text == full_text[: full_text.index(stop) + len(stop)] and out.text.endswith(stop)
