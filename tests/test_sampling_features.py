"""vLLM's SamplingParams features, each against an independent computation: logprobs and
prompt_logprobs equal log_softmax of Hugging Face's logits; penalties equal a direct loop;
greedy with repetition_penalty equals Hugging Face generate(repetition_penalty=...); min_tokens,
allowed_token_ids, bad_words, logits processors and skip_special_tokens do what vLLM documents."""

import random

import pytest
import torch

from pagedbench import LLM, SamplingParams
from pagedbench.sample.sampler import Penalties, apply_penalties
from tests.conftest import VOCAB

PROMPT = list(range(10, 30))


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"][0], dtype="float32", device="cpu", max_num_batched_tokens=8)  # chunked prefill


def hf_logprobs(hf, token_ids):
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].log_softmax(-1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_the_models(llm, tiny_models, temperature):
    hf = tiny_models["llama"][1]
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    c = out.outputs[0]
    ref = hf_logprobs(hf, PROMPT + c.token_ids)
    assert len(c.logprobs) == len(c.token_ids)
    for j, token in enumerate(c.token_ids):
        row = ref[len(PROMPT) - 1 + j]
        entry = c.logprobs[j]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(3)
        for rank, (lp, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
            assert entry[tid].logprob == pytest.approx(lp, abs=1e-4) and entry[tid].rank == rank
        assert set(entry) == set(top.indices.tolist()) | {token}
        assert isinstance(entry[token].decoded_token, str)
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(c.logprobs, c.token_ids)))
    # prompt logprobs: None for the first token, then the model's prediction of each prompt token
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for j in range(1, len(PROMPT)):
        entry = out.prompt_logprobs[j]
        assert entry[PROMPT[j]].logprob == pytest.approx(ref[j - 1, PROMPT[j]].item(), abs=1e-4)
        assert len(entry) in (2, 3)
    plain = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.outputs[0].logprobs is None and plain.prompt_logprobs is None


def test_prompt_logprobs_bypass_the_prefix_cache(tiny_models):
    """A cached prefix is never computed, so it has no logits: prompt_logprobs requests recompute it."""
    llm = LLM(tiny_models["llama"][0], dtype="float32", device="cpu")
    long_prompt = list(range(40, 90))
    llm.generate([{"prompt_token_ids": long_prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    out = llm.generate(
        [{"prompt_token_ids": long_prompt}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    assert len(out[0].prompt_logprobs) == len(long_prompt) and all(out[0].prompt_logprobs[1:])


def direct_penalties(logits, prompt, output, presence, frequency, repetition):
    out = logits.clone()
    for t in range(logits.shape[0]):
        if t in prompt or t in output:
            out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
        out[t] -= frequency * output.count(t) + presence * (t in output)
    return out


def test_penalties_equal_a_direct_computation():
    rng = random.Random(0)
    vocab, rows = 50, 4
    logits = torch.randn(rows, vocab)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 12))] for _ in range(rows)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 15))] for _ in range(rows)]
    settings = [(0.5, 0.2, 1.3), (-1.0, 0.0, 1.0), (0.0, 1.5, 0.7), (2.0, -2.0, 2.0)]
    counts = torch.zeros(rows, vocab)
    for i, out in enumerate(outputs):
        for t in out:
            counts[i, t] += 1
    seen = counts > 0
    for i, prompt in enumerate(prompts):
        seen[i, prompt] = True
    col = lambda k: torch.tensor([[s[k]] for s in settings])  # noqa: E731
    p = Penalties(torch.arange(rows), col(0), col(1), col(2), counts, seen)
    expected = torch.stack([direct_penalties(logits[i], prompts[i], outputs[i], *settings[i]) for i in range(rows)])
    torch.testing.assert_close(apply_penalties(logits, p), expected)


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_greedy_repetition_penalty_matches_hf(llm, tiny_models, penalty):
    hf = tiny_models["llama"][1]
    prompts = [PROMPT, [5, 6, 7, 5, 6, 7], list(range(100, 140))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=penalty)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        expected = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            do_sample=False,
            repetition_penalty=penalty,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == expected


@pytest.mark.parametrize("presence,frequency,repetition", [(1.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.5, 0.5, 1.2)])
def test_greedy_with_penalties_equals_a_direct_loop_over_hf_logits(llm, tiny_models, presence, frequency, repetition):
    hf = tiny_models["llama"][1]
    prompt = [5, 6, 7, 5, 6, 7, 8]
    params = SamplingParams(
        temperature=0,
        max_tokens=10,
        ignore_eos=True,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
    )
    got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    output = []
    for _ in range(10):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + output])).logits[0, -1]
        output.append(int(direct_penalties(logits, prompt, output, presence, frequency, repetition).argmax()))
    assert got == output


def test_min_tokens_holds_back_stop_tokens(llm):
    everything = list(range(3, VOCAB))  # almost any token stops...
    stop_now = SamplingParams(temperature=1.0, seed=1, max_tokens=20, stop_token_ids=everything)
    held = SamplingParams(temperature=1.0, seed=1, max_tokens=20, stop_token_ids=everything, min_tokens=5)
    first, second = llm.generate([{"prompt_token_ids": PROMPT}] * 2, [stop_now, held], use_tqdm=False)
    assert len(first.outputs[0].token_ids) == 1 and first.outputs[0].finish_reason == "stop"
    tokens = second.outputs[0].token_ids
    assert len(tokens) >= 6 and not set(tokens[:5]) & set(everything)  # ...but not among the first 5
    assert second.outputs[0].finish_reason == "stop" and tokens[-1] in everything


def test_allowed_token_ids_and_bad_words(llm):
    allowed = [40, 41, 42]
    out = llm.generate(
        [{"prompt_token_ids": PROMPT}],
        SamplingParams(temperature=1.0, seed=0, max_tokens=30, ignore_eos=True, allowed_token_ids=allowed),
        use_tqdm=False,
    )[0]
    assert set(out.outputs[0].token_ids) <= set(allowed) and len(set(out.outputs[0].token_ids)) > 1
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    text = "the quick brown fox"
    base = llm.generate([text], greedy, use_tqdm=False)[0].outputs[0]
    tok = llm.engine.tokenizer
    word = tok.decode([base.token_ids[1]]).strip()
    banned = {ids[-1] for ids in (tok.encode(w, add_special_tokens=False) for w in (word, " " + word)) if len(ids) == 1}
    assert banned, "the test needs a single-token word"
    greedy.bad_words = [word]
    out = llm.generate([text], greedy, use_tqdm=False)[0].outputs[0]
    assert not banned & set(out.token_ids) and out.token_ids[:1] == base.token_ids[:1]


def test_logits_processors_follow_vllms_per_request_forms(llm):
    """A plain callable is vLLM's per-request processor: (output_ids, logits[V]) or
    (prompt_ids, output_ids, logits[V]), called with its own request's row."""
    calls = []

    def force_token_9(output_token_ids, logits):
        calls.append(len(output_token_ids))
        forced = torch.full_like(logits, float("-inf"))
        forced[9] = 0
        return forced

    def repeat_the_prompts_first_token(prompt_token_ids, output_token_ids, logits):
        forced = torch.full_like(logits, float("-inf"))
        forced[prompt_token_ids[0]] = 0
        return forced

    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, logits_processors=[force_token_9])
    other = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": [3 + i]} for i in range(4)], [params, params, params, other], use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs[:3]] == [[9] * 4] * 3 and outs[3].outputs[0].token_ids != [9] * 4
    assert sorted(calls) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]  # each row on its own, every step
    copy = SamplingParams(temperature=0, max_tokens=3, logits_processors=[repeat_the_prompts_first_token])
    assert llm.generate({"prompt_token_ids": [17, 6]}, copy, use_tqdm=False)[0].outputs[0].token_ids == [17] * 3


def test_batch_logits_processors_run_once_per_step_over_their_rows(llm):
    from pagedbench import BatchLogitsProcessor

    class ForceToken9(BatchLogitsProcessor):
        def __init__(self):
            self.calls = []

        def __call__(self, output_token_ids, logits):
            self.calls.append(len(output_token_ids))
            forced = torch.full_like(logits, float("-inf"))
            forced[:, 9] = 0
            return forced

    processor = ForceToken9()
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, logits_processors=[processor])
    outs = llm.generate([{"prompt_token_ids": [3 + i]} for i in range(3)], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [[9] * 4] * 3
    assert processor.calls == [3, 3, 3, 3]  # once per step, with the three rows that carry it


def test_engine_wide_logits_processors_see_every_row(tiny_models):
    """LLM(logits_processors=[...]): a BatchLogitsProcessor (class or instance) runs once per step over
    every sampling row, after the request's own processors; anything else is a one-line TypeError."""
    from pagedbench import BatchLogitsProcessor

    class BanToken9(BatchLogitsProcessor):
        seen: list = []

        def __call__(self, output_token_ids, logits):
            BanToken9.seen.append(len(output_token_ids))
            logits[:, 9] = float("-inf")
            return logits

    llm = LLM(tiny_models["llama"][0], dtype="float32", device="cpu", logits_processors=[BanToken9])

    def prefer_9(output_token_ids, logits):  # per request: would pick 9, the engine's processor bans it after
        logits[9] = 1e4
        return logits

    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logits_processors=[prefer_9])] * 2
    params.append(SamplingParams(temperature=1.0, seed=0, max_tokens=3, ignore_eos=True))
    outs = llm.generate([{"prompt_token_ids": [3 + i]} for i in range(3)], params, use_tqdm=False)
    assert all(9 not in o.outputs[0].token_ids and len(o.outputs[0].token_ids) == 3 for o in outs)
    assert BanToken9.seen == [3, 3, 3]
    with pytest.raises(TypeError, match="takes BatchLogitsProcessor instances or subclasses"):
        LLM(tiny_models["llama"][0], device="cpu", logits_processors=[prefer_9])


def test_skip_special_tokens(llm):
    eos_only = dict(temperature=1.0, max_tokens=3, ignore_eos=True, allowed_token_ids=[2])  # 2 is <eos>
    skipped = llm.generate(["hello"], SamplingParams(**eos_only), use_tqdm=False)[0].outputs[0]
    kept = llm.generate(["hello"], SamplingParams(**eos_only, skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert skipped.token_ids == kept.token_ids == [2, 2, 2]
    assert skipped.text == "" and kept.text == "<eos><eos><eos>"


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(logprobs=-1), ValueError, "logprobs must be >= 0"),
        (dict(prompt_logprobs=1.5), TypeError, "prompt_logprobs must be an int"),
        (dict(presence_penalty=3), ValueError, "presence_penalty must be in \\[-2, 2\\]"),
        (dict(frequency_penalty="x"), TypeError, "frequency_penalty must be a number"),
        (dict(repetition_penalty=0), ValueError, "repetition_penalty must be > 0"),
        (dict(min_tokens=20, max_tokens=10), ValueError, "min_tokens must be in \\[0, max_tokens=10\\]"),
        (dict(allowed_token_ids=[]), ValueError, "allowed_token_ids must not be empty"),
        (dict(allowed_token_ids=5), TypeError, "allowed_token_ids must be a list"),
        (dict(bad_words=[""]), TypeError, "bad_words must be non-empty strings"),
        (dict(logits_processors=[1]), TypeError, "logits_processors must be callables"),
        (dict(logits_processors=[lambda logits: logits]), TypeError, "takes 1 arguments; vLLM's forms take"),
        (dict(skip_special_tokens=1), TypeError, "skip_special_tokens must be a bool"),
    ],
)
def test_bad_sampling_features_name_the_field(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def test_engine_level_refusals(llm, tiny_models, tokenizerless_model):
    good = {"prompt_token_ids": [5, 6]}
    for params, message in [
        (SamplingParams(logprobs=21), "logprobs=21 is more than the 20"),
        (SamplingParams(allowed_token_ids=[VOCAB]), f"token id {VOCAB} is outside the vocabulary"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate([good, good], [SamplingParams(), params], use_tqdm=False)
    bare = LLM(tokenizerless_model, device="cpu", num_blocks=8)
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        bare.generate([good], SamplingParams(bad_words=["x"]), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_prompt_logprobs_edge_cases(llm):
    one = llm.generate([{"prompt_token_ids": [7]}], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]  # a one-token prompt: nothing predicts it
    params = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=3, prompt_logprobs=1)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(PROMPT) and len(out.outputs) == 3
