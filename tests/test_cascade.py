"""Cascade attention (backends/cascade.py): how groups are found, when the heuristic cascades, the
LSE merge, refusals, and the engine's greedy tokens equal to Hugging Face's with cascade on."""

import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from pagedbench.backends import registry
from pagedbench.backends.cascade import (
    CASCADE_MIN_GROUP,
    CASCADE_MIN_PREFIX,
    cascade_setting,
    find_groups,
    merge_states,
    plan_cascade,
    with_cascade,
)
from pagedbench.backends.reference import ReferenceBackend
from pagedbench.backends.registry import get_backend, probe

from pagedbench import LLM, SamplingParams
from pagedbench.bench.problems import attend_dense, place, random_problem
from tests.conftest import VOCAB, hf_greedy

PAGE = 16


def tables(rows: list[list[int]]) -> np.ndarray:
    width = max(map(len, rows))
    return np.array([r + [0] * (width - len(r)) for r in rows], dtype=np.int32)


def decode_plan(rows: list[list[int]], setting, context: list[int] | None = None):
    context = np.array(context or [len(r) * PAGE for r in rows])
    return plan_cascade(setting, tables(rows), context, np.ones(len(rows), dtype=np.int64), PAGE)


def test_groups_follow_shared_page_ids_and_split_where_that_saves_more():
    # Two prompts of 6 pages under a 1-page system prompt, 4 samples each: two groups of 4 over 6 pages
    # save 2 x 3 x 6 = 36 page reads; one group of 8 over the 1 shared page would save 7.
    rows = [[1, 2, 3, 4, 5, 6, 10 + i] for i in range(4)] + [[1, 7, 8, 9, 11, 12, 20 + i] for i in range(4)]
    groups = find_groups(tables(rows), np.full(8, 7 * PAGE), np.ones(8, dtype=np.int64), PAGE)
    assert [(g.prefix_pages, g.members) for g in groups] == [
        ((1, 2, 3, 4, 5, 6), (0, 1, 2, 3)),
        ((1, 7, 8, 9, 11, 12), (4, 5, 6, 7)),
    ]
    # Only pages written before the step count (the current page is not full), and prefill rows never join.
    groups = find_groups(tables([[1, 2, 3], [1, 2, 4], [1, 2, 5]]), np.array([40, 20, 40]), np.array([1, 1, 40]), PAGE)
    assert [(g.prefix_pages, g.members) for g in groups] == [((1,), (0, 1))]  # row 1 has 1 full page


def test_heuristic_is_off_for_a_lone_sequence_or_a_short_prefix_and_on_for_a_long_shared_one():
    pages = CASCADE_MIN_PREFIX // PAGE
    shared = list(range(1, pages + 1))
    assert decode_plan([shared + [100]], None) is None  # a group of one
    assert decode_plan([shared[:2] + [100 + i] for i in range(16)], None) is None  # 32 shared tokens: too short
    few = [shared + [100 + i] for i in range(CASCADE_MIN_GROUP - 1)]
    assert decode_plan(few, None) is None  # too few members
    many = [shared + [100 + i] for i in range(CASCADE_MIN_GROUP)]
    plan = decode_plan(many, None)
    assert plan is not None and [len(g.members) for g in plan.groups] == [CASCADE_MIN_GROUP]
    assert plan.prefix_len(plan.groups[0]) == CASCADE_MIN_PREFIX
    assert decode_plan(many, False) is None
    assert decode_plan([[1, 2, 9], [1, 2, 8]], True).groups[0].prefix_pages == (1, 2)  # forced: any sharing


def test_merge_states_equals_attention_over_both_key_sets_with_sinks_once():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64) for shape in ((5, 3, 8), (3, 20, 8), (3, 20, 8)))
    sinks = torch.randn(3, generator=gen, dtype=torch.float64)
    scores = torch.einsum("thd,hsd->ths", q, k)

    def part(cols):
        s = scores[..., cols]
        return torch.einsum("ths,hsd->thd", s.softmax(-1), v[:, cols]), torch.logsumexp(s, -1)

    merged = merge_states(*part(slice(0, 12)), *part(slice(12, 20)), sinks)
    with_sink = torch.cat([scores, sinks[None, :, None].expand(5, 3, 1)], -1).softmax(-1)[..., :-1]
    torch.testing.assert_close(merged, torch.einsum("ths,hsd->thd", with_sink, v))
    empty = torch.full((5, 3), float("-inf"), dtype=torch.float64)  # a pass that saw no key weighs nothing
    torch.testing.assert_close(merge_states(*part(slice(0, 20)), torch.zeros(5, 3, 8, dtype=torch.float64), empty),
                               part(slice(0, 20))[0])  # fmt: skip


@pytest.mark.parametrize("backend", ["reference", "sdpa", pytest.param("flex", marks=pytest.mark.slow), "triton"])
def test_backends_cascade_equals_flat(backend):
    """64 decodes over an 8-page shared prefix plus a group of 3 multi-token decodes and a prefill: fp32
    cascade output within 1e-5 (relative to the output's scale) of the same backend's flat output."""
    cls = get_backend(backend)
    if probe(cls, torch.device("cpu"), torch.float32, 32, PAGE)[1]:
        pytest.skip(probe(cls, torch.device("cpu"), torch.float32, 32, PAGE)[1])
    seqs = [(8 * PAGE + 1 + (5 * i) % 40, 1) for i in range(64)] + [(3 * PAGE + 2, 3), (3 * PAGE, 2), (0, 9)]
    shared = {b: (0, 8 * PAGE) for b in range(1, 64)} | {65: (64, 3 * PAGE)}
    problem = random_problem(seqs, 8, 2, 32, shared=shared, seed=4)
    batch = place(problem, PAGE)
    cascaded = with_cascade(batch.metadata, True)
    assert sorted(len(g.members) for g in cascaded.cascade.groups) == [2, 64]
    b = cls(8, 2, 32, 32**-0.5, PAGE, torch.device("cpu"), torch.float32)
    flat = b.forward(batch.q, batch.k_cache, batch.v_cache, b.plan(batch.metadata))
    out = b.forward(batch.q, batch.k_cache, batch.v_cache, b.plan(cascaded))
    assert float((out - flat).abs().max()) <= 1e-5 * float(flat.abs().max())
    oracle = attend_dense(problem, 32**-0.5, torch.float64)
    assert float((out.double() - oracle).abs().max()) <= 1e-5 * float(oracle.abs().max())


class NoCascade(ReferenceBackend):
    name = "test-no-cascade"
    cascade_attention = False
    cascade_attention_reason = "a test backend that reads every prefix itself"


def test_a_backend_without_cascade_is_refused_with_its_reason(monkeypatch, tiny_models):
    reason = probe(NoCascade, "cpu", torch.float32, 32, PAGE, cascade_attention=True)[1]
    assert (
        reason
        == "cascade attention (shared prefixes read once per group): a test backend that reads every prefix itself"
    )
    assert probe(NoCascade, "cpu", torch.float32, 32, PAGE, cascade_attention=None)[1] is None
    assert "MultiLevelCascadeAttentionWrapper" in get_backend("flashinfer").cascade_reason(True)
    backend = NoCascade(4, 2, 16, 0.25, PAGE, torch.device("cpu"), torch.float32)
    assert cascade_setting([backend], None) is False  # the heuristic leaves it flat
    monkeypatch.setitem(registry._loaded, NoCascade.name, NoCascade)
    with pytest.raises(ValueError, match="cannot run cascade_attention=True: cascade attention .* a test backend"):
        LLM(tiny_models["llama"][0], backend=NoCascade.name, device="cpu", dtype="float32", cascade_attention=True)


@pytest.mark.parametrize(
    "setup",
    [
        dict(block_size=8),
        # preemption: a cache of 14 pages for 3 x 4 samples of a 5-page prompt; groups split and re-form
        dict(block_size=8, num_blocks=14, max_model_len=64, max_num_batched_tokens=48),
    ],
    ids=["roomy", "preempting"],
)
def test_parallel_sampling_with_prefix_caching_and_cascade_matches_hf(tiny_models, setup):
    path, hf = tiny_models["llama"]
    prompt = [random.Random(1).randrange(3, VOCAB) for _ in range(41)]
    expected = hf_greedy(hf, prompt, 10)
    llm = LLM(path, backend="sdpa", device="cpu", dtype="float32", enable_prefix_caching=True,
              cascade_attention=True, **setup)  # fmt: skip
    params = SamplingParams(n=4, temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 3, params, use_tqdm=False)
    assert [c.token_ids for o in outs for c in o.outputs] == [expected] * 12
    counts = llm.engine.executor.runner.block_tables.cascade_counts
    assert counts.cascade_steps > 0 and counts.shared_kv_tokens > 0
    if "num_blocks" in setup:
        assert llm.engine.stats.preemptions > 0, "the setup must preempt"


def test_kernels_cascade_variant_times_each_backend_flat_and_cascaded():
    from pagedbench.bench.kernels import GRID_PRESETS, run_kernels

    grid = replace(GRID_PRESETS["cpu"], variants=["cascade"], batch_sizes=[1, 4], context_lens=[64], phases=["decode"],
                   heads=[(4, 2)], suffix_lens=[16], warmup=0, repeats=1)  # fmt: skip
    rows = run_kernels(["reference", "sdpa"], grid, "cpu", "float32")
    assert [(r["backend"], r["batch_size"], r["cascade"], r["status"]) for r in rows] == [
        (name, group, on, "ok") for group in (1, 4) for name in ("reference", "sdpa") for on in ("off", "on")
    ]
    flat, cascaded = (next(r for r in rows if r["batch_size"] == 4 and r["cascade"] == on) for on in ("off", "on"))
    assert cascaded["kv_bytes"] == flat["kv_bytes"] * (64 + 4 * 2 * 16) // (4 * (64 + 16))  # the prefix read once
    assert cascaded["cascade_share"] == 0.8 and flat["cascade_share"] == 0.0


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("backend", ["reference", "sdpa", "triton"])
def test_cascade_reads_quantized_pages_as_flat_does(backend, kv_cache_dtype):
    from pagedbench.bench.kernels import quantized_pages

    cls = get_backend(backend)
    if probe(cls, torch.device("cpu"), torch.float32, 32, PAGE, kv_cache_dtype=kv_cache_dtype)[1]:
        pytest.skip(probe(cls, torch.device("cpu"), torch.float32, 32, PAGE, kv_cache_dtype=kv_cache_dtype)[1])
    seqs = [(8 * PAGE + 1 + (5 * i) % 40, 1) for i in range(16)]
    batch = place(random_problem(seqs, 8, 2, 32, shared={b: (0, 8 * PAGE) for b in range(1, 16)}, seed=4), PAGE)
    k, v, scales = quantized_pages(batch, kv_cache_dtype)
    b = cls(8, 2, 32, 32**-0.5, PAGE, torch.device("cpu"), torch.float32)
    flat = b.forward(batch.q, k, v, b.plan(batch.metadata), kv_scales=scales)
    out = b.forward(batch.q, k, v, b.plan(with_cascade(batch.metadata, True)), kv_scales=scales)
    assert float((out - flat).abs().max()) <= 1e-5 * float(flat.abs().max())


@pytest.mark.slow  # starts a tensor-parallel worker process
def test_parallel_sampling_with_cascade_at_tp2_matches_hf(tiny_models):
    path, hf = tiny_models["llama"]
    prompt = [random.Random(2).randrange(3, VOCAB) for _ in range(41)]
    expected = hf_greedy(hf, prompt, 8)
    llm = LLM(path, backend="sdpa", device="cpu", dtype="float32", enable_prefix_caching=True, block_size=8,
              cascade_attention=True, tensor_parallel_size=2)  # fmt: skip
    try:
        params = SamplingParams(n=4, temperature=0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": prompt}] * 2, params, use_tqdm=False)
        assert [c.token_ids for o in outs for c in o.outputs] == [expected] * 8
        # rank 0 plans each step; the plan rides in the StepBatch the worker runs (its metadata's cascade)
        counts = llm.engine.executor.runner.local.block_tables.cascade_counts
        assert counts.cascade_steps > 0 and counts.shared_kv_tokens > 0
    finally:
        llm.shutdown()


@pytest.mark.slow  # compiles CPU flex
@pytest.mark.parametrize(
    "softcap,logit_scale", [(None, 1.0), (30.0, 1.0), (None, 40.0)], ids=["plain", "capped", "huge"]
)
def test_flex_cpu_prefix_log_sum_exp_from_its_extra_key_equals_explicit(softcap, logit_scale):
    # "huge": scores ~100 above the mean key's underflow the extra key's share: the exact two-call path takes it.
    from pagedbench.backends.cascade import attention_with_lse
    from pagedbench.backends.flex_cascade import lse_from_extra_key, prefix_attention
    from pagedbench.backends.flex_compile import softcap_score_mod

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 24, 16, generator=gen) * logit_scale
    k, v = torch.randn(300, 2, 16, generator=gen), torch.randn(300, 2, 16, generator=gen)
    score_mod = None if softcap is None else softcap_score_mod(softcap, torch.device("cpu"))
    out, lse = prefix_attention(q, k, v, 0.25, softcap, score_mod, compiled=True)
    assert (lse_from_extra_key(q, k, v, 0.25, softcap, score_mod) is None) == (logit_scale > 1)
    want_out, want_lse = attention_with_lse(q[0], k.transpose(0, 1), v.transpose(0, 1), 0.25, softcap, None)
    assert float((out[0] - want_out).abs().max()) <= 1e-5 * float(want_out.abs().max())
    assert float((lse[0] - want_lse).abs().max()) <= 1e-5 * float(want_lse.abs().max())


def test_the_heuristic_leaves_a_backend_measured_slower_with_cascade_flat():
    make = lambda name: get_backend(name)(4, 2, 16, 0.25, PAGE, torch.device("cpu"), torch.float32)
    flex, sdpa = make("flex"), make("sdpa")
    assert "slower end to end" in flex.cascade_not_by_default and sdpa.cascade_not_by_default is None
    assert cascade_setting([flex], None) is False and cascade_setting([sdpa], None) is None  # None: the heuristic
    assert cascade_setting([flex], True) is True  # asked for, it runs
