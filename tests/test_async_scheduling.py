"""Async scheduling (EngineConfig.async_scheduling, docs/async-scheduling.md): step N+1 is scheduled
and laid out while N computes on the device lane, N's tokens feed N+1's placeholders there. Every
output equals the synchronous engine's (tokens, text, finish reasons, logprobs), under forced
preemption, chunked prefill and prefix caching, with seeded sampling, stop strings and stop ids,
max_tokens 1 and 2, n > 1 and aborts in flight; nothing leaks; a broken feed is caught (modelled on
vLLM's tests/v1/e2e/test_async_scheduling.py)."""

import pytest

from pagedbench import LLM, SamplingParams
from pagedbench.engine.token_picker import Draw
from tests.helpers import ENGINE_BACKENDS

SHARED = [(11 * j) % 290 + 5 for j in range(24)]  # a prefix the prefix cache shares
PROMPTS = [SHARED + [(7 * i + j) % 290 + 5 for j in range(n)] for i, n in enumerate([3, 17, 30, 9, 26, 40, 1, 12])]
PRESSURE = dict(block_size=4, num_blocks=26, max_model_len=96, max_num_batched_tokens=16)
BACKENDS = [*ENGINE_BACKENDS, pytest.param("triton", marks=pytest.mark.slow)]


def mixed_params() -> list[SamplingParams]:
    """One request of each kind the identity must hold for."""
    return [
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=16, stop=["e", "a"]),  # a stop string
        SamplingParams(temperature=1.0, seed=11, max_tokens=16, stop_token_ids=list(range(40, 140))),  # a stop id
        SamplingParams(temperature=0, max_tokens=10),  # EOS may end it
        SamplingParams(temperature=0.9, seed=5, max_tokens=9, min_tokens=4, ignore_eos=True),
    ]


def outputs(llm: LLM, params) -> list:
    """Per request and sample: (token ids, text, finish reason, stop reason, logprobs: {token: logprob}
    per output token)."""
    results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [
        [
            (
                c.token_ids,
                c.text,
                c.finish_reason,
                c.stop_reason,
                None if c.logprobs is None else [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs],
            )
            for c in o.outputs
        ]
        for o in results
    ]


def assert_same(got: list, expected: list) -> None:
    """Tokens, text and reasons equal; logprobs within 1e-4 (a step's batch may differ: sequences that
    stop by content hold their pages a step longer under async scheduling, and fp32 sums in another order)."""
    assert [[c[:4] for c in o] for o in got] == [[c[:4] for c in o] for o in expected]
    for o, e in zip(got, expected):
        for c, d in zip(o, e):
            assert (c[4] is None) == (d[4] is None)
            for x, y in zip(c[4] or (), d[4] or ()):
                assert x.keys() == y.keys() and all(abs(x[t] - y[t]) <= 1e-4 for t in x)


def engine(path, backend, async_scheduling, **settings) -> LLM:
    return LLM(path, backend=backend, dtype="float32", device="cpu", async_scheduling=async_scheduling, **settings)


def assert_nothing_leaks(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished_requests() and not llm.engine.core.in_flight
    assert bm.num_free_blocks == bm.num_blocks  # every page back (cached ones are evictable)


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_outputs_equal_sync_under_preemption_chunking_and_caching(tiny_models, backend):
    path, _ = tiny_models["llama"]
    sync = engine(path, backend, False, **PRESSURE)
    expected = outputs(sync, mixed_params())
    fast = engine(path, backend, True, **PRESSURE)
    assert_same(outputs(fast, mixed_params()), expected)
    stats = fast.engine.stats
    assert stats.preemptions > 0, "the pressure setup must preempt"
    assert stats.in_flight_steps > stats.steps, "steps must have been launched while another computed"
    assert fast.engine.block_manager.prefix_cache.hits > 0
    assert_nothing_leaks(fast)


def test_n_samples_and_penalties_run_synchronously_and_equal(tiny_models):
    """Requests that read last step's tokens on the host (forks at the first token, penalties) make
    the engine complete each step before the next: same outputs, and no step ran ahead of them."""
    path, _ = tiny_models["llama"]
    params = [
        SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=2, max_tokens=8, ignore_eos=True, presence_penalty=0.5),
    ] * 4
    expected = outputs(engine(path, "sdpa", False, **PRESSURE), params)
    fast = engine(path, "sdpa", True, **PRESSURE)
    assert_same(outputs(fast, params), expected)
    assert fast.engine.stats.in_flight_steps == 0  # no step was run ahead
    assert_nothing_leaks(fast)


def test_aborts_in_flight_lose_nothing(tiny_models):
    """Requests aborted while their step is in flight end there; the others' outputs equal the
    synchronous engine's under the same aborts, and every page comes back."""
    path, _ = tiny_models["llama"]

    def run(async_scheduling: bool) -> dict:
        eng = engine(path, "sdpa", async_scheduling, **PRESSURE).engine
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for i, p in enumerate(PROMPTS):
            eng.add_request({"prompt_token_ids": p}, params, request_id=str(i))
        done, steps = {}, 0
        while eng.has_unfinished_requests():
            for out in eng.step():
                done[out.request_id] = out
            steps += 1
            if steps == 4:
                eng.abort_request(["1", "5"])
        bm = eng.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not eng.core.pending_aborts
        return {rid: out.outputs[0].token_ids for rid, out in done.items() if out.finished}

    expected = run(False)
    assert run(True) == expected and "1" not in expected and "0" in expected


def test_a_wrong_feed_is_caught(tiny_models, monkeypatch):
    """Negative control: feeding the next step's placeholders from the wrong rows changes the tokens."""
    path, _ = tiny_models["llama"]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * len(PROMPTS)
    expected = outputs(engine(path, "sdpa", False, max_num_batched_tokens=512), params)
    feed = Draw.feed

    def shifted(self, batch, seqs):
        found = feed(self, batch, seqs)
        return None if found is None else (found[0], (found[1] + 1) % len(self.seqs))

    monkeypatch.setattr(Draw, "feed", shifted)
    assert outputs(engine(path, "sdpa", True, max_num_batched_tokens=512), params) != expected


def test_unsupported_settings_are_one_line_errors(tiny_models):
    path, _ = tiny_models["llama"]
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="^async_scheduling is not supported here: speculative decoding verifies"):
        LLM(path, dtype="float32", device="cpu", async_scheduling=True, speculative_config=spec)
    llm = LLM(path, dtype="float32", device="cpu", speculative_config=spec)  # unset: synchronous, no error
    assert llm.engine.async_scheduling is False
