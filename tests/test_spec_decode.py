"""Speculative decoding (engine/speculator.py): greedy output token-identical to decoding without
it, for both proposers and k = 1, 3, 5, on the trained pair and on tiny HF models, under
preemption, chunked prefill, prefix caching and a small KV budget, with no page leaked after
rejections; sampled output keeps the target's distribution; bad settings are one-line errors."""

import importlib.util
import math

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from pagedbench import LLM, SamplingParams
from pagedbench.engine.proposers import ngram_proposal
from pagedbench.model.trained_pair import corpus, trained_models
from pagedbench.sample.rejection import Position, verify
from pagedbench.sample.sampler import Sampler, SamplingBatch
from tests.conftest import hf_greedy
from tests.helpers import ENGINE_BACKENDS

needs_pair = pytest.mark.skipif(len(trained_models()) < 2, reason="the trained pair is not in this checkout")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
NGRAM = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}
DRAFT = {"method": "draft_model", "model": "py-byte-draft"}
CPU32 = dict(device="cpu", dtype="float32")


def held_out_prompts(count=6, seed=0):
    """Python source the pair never trained on, cut at random places (lengths 20..120 bytes)."""
    text = corpus()[1]
    rng = np.random.default_rng(seed)
    return [
        list(text[s : s + n]) for s, n in zip(rng.integers(0, len(text) - 200, count), rng.integers(20, 120, count))
    ]


def generate(model, prompts, params, **engine):
    llm = LLM(model, **(CPU32 | engine))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine


def assert_no_leak(engine):
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, (bm.num_free_blocks, bm.num_blocks)
    assert all(n == 0 for n in bm.pool.ref_counts)


GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def pair_reference():
    prompts = held_out_prompts()
    return prompts, generate("py-byte-target", prompts, GREEDY, backend="sdpa")[0]


@needs_pair
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", [NGRAM, DRAFT], ids=["ngram", "draft"])
def test_greedy_is_token_identical_on_the_trained_pair(pair_reference, method, k):
    prompts, expected = pair_reference
    outputs, engine = generate(
        "py-byte-target", prompts, GREEDY, backend="sdpa", speculative_config=method | {"num_speculative_tokens": k}
    )
    assert outputs == expected
    spec = engine.stats.spec
    assert spec.num_draft_tokens > 0 and 0 < spec.num_accepted_tokens <= spec.num_draft_tokens
    assert len(spec.accepted_per_position) == k
    assert engine.stats.steps < len(prompts) * 0 + sum(map(len, expected))  # fewer steps than tokens
    assert_no_leak(engine)


@needs_pair
@pytest.mark.parametrize("backend", [*ENGINE_BACKENDS, pytest.param("triton", marks=pytest.mark.slow)])
@pytest.mark.parametrize("method", [NGRAM, DRAFT], ids=["ngram", "draft"])
def test_every_cpu_backend_verifies_multi_token_queries(pair_reference, backend, method):
    pytest.importorskip("triton") if backend == "triton" else None
    prompts, expected = pair_reference
    n = 2 if backend == "triton" else len(prompts)  # the interpreter is slow
    params = SamplingParams(temperature=0, max_tokens=16 if backend == "triton" else 48, ignore_eos=True)
    spec = method | {"num_speculative_tokens": 3}
    outputs, engine = generate("py-byte-target", prompts[:n], params, backend=backend, speculative_config=spec)
    assert outputs == [e[: params.max_tokens] for e in expected[:n]]
    assert engine.stats.spec.num_accepted_tokens > 0
    assert_no_leak(engine)


PRESSURE = {
    "preemption (recompute), chunked prefill, tiny pages": dict(
        block_size=4, num_blocks=60, max_num_batched_tokens=24, max_model_len=200
    ),
    "preemption (swap)": dict(
        block_size=4, num_blocks=60, max_num_batched_tokens=24, max_model_len=200, preemption_mode="swap"
    ),
    "no prefix caching": dict(block_size=8, num_blocks=30, enable_prefix_caching=False, max_model_len=200),
}


METHODS = {"ngram": NGRAM, "draft": DRAFT}
FULL = next(iter(PRESSURE))  # the setup that has it all (preemption, chunks, 4-token pages, cache hits)
PRESSURE_CASES = [
    # swap preemption (~9 s a method) in the full tier; the fast tier keeps recompute, chunks and caching
    *(
        pytest.param(setup, "sdpa", m, id=f"{name}-{setup}-sdpa", marks=[pytest.mark.slow] if "swap" in setup else [])
        for setup in PRESSURE
        for name, m in METHODS.items()
    ),
    # reference under the full setup with both methods, triton (interpreted, ~25 s a run) with n-gram; flex
    # verifies in test_every_cpu_backend_verifies_multi_token_queries (its compiles cost a minute here).
    *(pytest.param(FULL, "reference", m, id=f"{n}-reference", marks=pytest.mark.slow) for n, m in METHODS.items()),
    pytest.param(FULL, "triton", NGRAM, id="ngram-triton", marks=[pytest.mark.slow, needs_triton]),
]


@needs_pair
@pytest.mark.parametrize("setup,backend,method", PRESSURE_CASES)
def test_greedy_is_identical_under_pressure(setup, backend, method):
    """Shared prompt prefixes (prefix cache hits), a KV budget too small for every sequence at
    once (preemption), prompts longer than a step's budget (chunked prefill), pages of 4 tokens (a
    verification crosses page boundaries, rejected ones are trimmed)."""
    shared = list(b"def parse(self, text):\n    ")
    prompts = [shared + p for p in held_out_prompts(6, seed=1)]
    # (triton's interpreter: 24 tokens, 60 steps instead of 96, still preempting four times)
    params = SamplingParams(temperature=0, max_tokens=24 if backend == "triton" else 40, ignore_eos=True)
    expected, _ = generate("py-byte-target", prompts, params, backend="sdpa")
    spec = method | {"num_speculative_tokens": 3}
    outputs, engine = generate(
        "py-byte-target", prompts, params, backend=backend, speculative_config=spec, **PRESSURE[setup]
    )
    assert outputs == expected
    if "preemption" in setup:
        assert engine.stats.preemptions > 0
    if "no prefix" not in setup:
        assert engine.block_manager.prefix_cache.hits > 0
    assert engine.stats.spec.num_accepted_tokens < engine.stats.spec.num_draft_tokens  # some rejected
    assert_no_leak(engine)


@pytest.mark.parametrize("draft", ["llama", "qwen3"], ids=["self-draft", "other-draft"])
def test_tiny_hf_models_match_hugging_face(tiny_models, draft):
    """A random tiny Llama drafted by itself (everything accepted) or by a random tiny Qwen3 of the
    same vocabulary (mostly rejected): Hugging Face's greedy tokens either way, n-gram too."""
    path, hf = tiny_models["llama"]
    prompts = [[(5 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate([6, 19, 33, 11])]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = [hf_greedy(hf, p, 20) for p in prompts]
    for spec in (
        {"method": "draft_model", "model": tiny_models[draft][0]},
        {"method": "ngram", "prompt_lookup_min": 1},
    ):
        outputs, engine = generate(
            path, prompts, params, backend="sdpa", block_size=4, speculative_config=spec | {"num_speculative_tokens": 3}
        )
        assert outputs == expected, spec
        assert_no_leak(engine)
        if spec["method"] == "draft_model" and draft == "llama":
            assert engine.stats.spec.acceptance_rate > 0.9


def test_ngram_proposes_the_latest_match_longest_first():
    assert ngram_proposal([1, 2, 3, 9, 1, 2, 3, 7, 2, 3], 2, 1, 3) == [7, 2]  # "2 3" latest after the 7
    assert ngram_proposal([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3, 2, 3) == [7, 1, 2]  # "1 2 3" longest
    assert ngram_proposal([4, 5, 6], 3, 1, 2) == []
    assert ngram_proposal([5, 5, 5, 5], 3, 1, 3) == [5]  # only one token follows the latest match


def test_verifier_keeps_the_target_distribution():
    """Rejection sampling against a point-mass proposal: 40,000 rows of the same target p over 6
    tokens, each judging one proposed token (likely, unlikely, impossible). The emitted token
    (accepted or redrawn) follows p (chi-square), whatever was proposed."""
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.1, 0.0])
    rows = 40_000
    logits = p.log().expand(rows, -1).contiguous()
    params = SamplingParams(temperature=1.0, seed=None)
    sampler = Sampler(torch.device("cpu"), seed=3)
    for proposal in (0, 3, 5):
        batch = SamplingBatch.from_seqs([Position(params, [], None, [])] * rows, 6, torch.device("cpu"))
        accepted, drawn = verify(sampler, logits, batch, torch.full((rows,), proposal))
        emitted = torch.where(accepted, proposal, drawn)
        counts = torch.bincount(emitted, minlength=6)[:5].numpy()
        assert counts.sum() == rows  # never the impossible token
        assert scipy_stats.chisquare(counts, p[:5].numpy() * rows).pvalue > 1e-3, (proposal, counts)
        assert abs(accepted.float().mean().item() - p[proposal].item()) < 0.01


@needs_pair
def test_sampled_output_keeps_the_target_distribution():
    """End to end: 600 seeded samples of 3 tokens after one prompt (top_k 4, so the joint support
    is small), with and without a draft. Both are compared, token by token, to the exact marginals
    computed from the target's own next-token distributions."""
    prompt = list(b"    def __init__(self")
    params = [SamplingParams(temperature=1.0, top_k=4, max_tokens=3, seed=i, ignore_eos=True) for i in range(600)]
    exact = exact_marginals(prompt, depth=3, top_k=4)
    for spec in (None, DRAFT | {"num_speculative_tokens": 2}):
        llm = LLM("py-byte-target", backend="sdpa", speculative_config=spec, **CPU32)
        outs = llm.generate([{"prompt_token_ids": prompt}] * len(params), params, use_tqdm=False)
        samples = np.array([o.outputs[0].token_ids for o in outs])
        assert spec is None or llm.engine.stats.spec.num_accepted_tokens > 0
        for position in range(1, 3):  # the speculated positions
            tokens, probs = zip(*sorted(exact[position].items()))
            counts = np.array([(samples[:, position] == t).sum() for t in tokens])
            assert counts.sum() == len(samples)
            expected = np.array(probs) / sum(probs) * len(samples)
            assert scipy_stats.chisquare(counts, expected).pvalue > 1e-3, (spec, position, counts, expected)


def exact_marginals(prompt, depth, top_k):
    """Per position, the exact marginal distribution of the token under top-k sampling at
    temperature 1 (enumerating the top-k tree with the HF target in fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(trained_models()["py-byte-target"]), dtype=torch.float32).eval()
    marginals = [dict() for _ in range(depth)]
    frontier = [([], 1.0)]
    for position in range(depth):
        nxt = []
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + path for path, _ in frontier])).logits[:, -1]
        top = logits.topk(top_k, dim=-1)
        for (path, weight), values, ids in zip(frontier, top.values, top.indices):
            probs = values.softmax(-1)
            for t, q in zip(ids.tolist(), probs.tolist()):
                marginals[position][t] = marginals[position].get(t, 0.0) + weight * q
                nxt.append((path + [t], weight * q))
        frontier = nxt
    assert math.isclose(sum(marginals[-1].values()), 1.0, rel_tol=1e-5)
    return marginals


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an int >= 1"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min 4 > prompt_lookup_max 2",
        ),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of draft_model, ngram"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model"'),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key 'lookahead'"),
    ],
)
def test_bad_settings_are_one_line_errors(tiny_models, spec, message):
    with pytest.raises(ValueError, match=message) as e:
        LLM(tiny_models["llama"][0], speculative_config=spec, **CPU32)
    assert "\n" not in str(e.value)


def test_a_draft_of_another_vocabulary_is_refused(tiny_models):
    with pytest.raises(ValueError, match="must share the target's vocabulary"):
        LLM(tiny_models["llama"][0], speculative_config={"model": "tiny-llama", "num_speculative_tokens": 2}, **CPU32)


def test_beam_search_with_speculation_is_refused(tiny_models):
    from pagedbench.sample.sampling_params import BeamSearchParams

    llm = LLM(tiny_models["llama"][0], speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **CPU32)
    with pytest.raises(ValueError, match="beam search does not run with speculative decoding"):
        llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=4))
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # the engine runs on
    assert len(out[0].outputs[0].token_ids) == 4


def test_kernels_time_multi_token_decodes():
    """`kernels --query-lens 1,4`: decoding rows of 4 query tokens (a verify of 3 speculated), each
    backend on the same batch; prefill points only once."""
    from pagedbench.bench.kernels import KernelGrid, batch_spec, run_kernels

    assert batch_spec("decode", 2, 100, 4) == [(96, 4), (96, 4)]
    assert batch_spec("mixed", 1, 100, 3)[0] == (97, 3)
    grid = KernelGrid([2], [64], [16], [(4, 2)], 32, ["decode", "prefill"], 4096, 4096, 0, 1, query_lens=[1, 4])
    assert [(p[1], p[2]) for p in grid.points()] == [("decode", 1), ("decode", 4), ("prefill", 1)]
    rows = [r for r in run_kernels(["sdpa"], grid, "cpu", "float32") if r["backend"] == "sdpa"]
    assert [(r["phase"], r["query_len"], r["num_query_tokens"]) for r in rows] == [
        ("decode", 1, 2),
        ("decode", 4, 8),
        ("prefill", 1, 128),
    ]
    assert all(r["status"] == "ok" for r in rows)


@needs_pair
@pytest.mark.slow
@pytest.mark.parametrize("method", [NGRAM, DRAFT], ids=["ngram", "draft"])
def test_tensor_parallel_target_with_speculation(pair_reference, method):
    """The target sharded over 2 ranks verifies; the draft runs whole on rank 0."""
    prompts, expected = pair_reference
    spec = method | {"num_speculative_tokens": 3}
    llm = LLM("py-byte-target", tensor_parallel_size=2, speculative_config=spec, backend="sdpa", **CPU32)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected[:3]
        assert llm.engine.stats.spec.num_accepted_tokens > 0
    finally:
        llm.shutdown()
