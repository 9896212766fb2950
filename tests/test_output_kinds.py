"""RequestOutputKind (vLLM's SamplingParams.output_kind) over real runs of the tiny llama: CUMULATIVE
gives everything so far each step (the default), DELTA only what is new (its pieces add up to the
cumulative outputs), FINAL_ONLY one output per request, the finished one; n > 1 too."""

import dataclasses
from collections import defaultdict

import pytest

from pagedbench import LLM, EngineConfig, LLMEngine, RequestOutputKind, SamplingParams

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
PROMPTS = [list(range(3, 10)), list(range(40, 57)), list(range(100, 120))]


@pytest.fixture(scope="module")
def engine(tiny_models):
    # no prefix cache: each kind's run computes the same batches, so its numbers are the same bits
    config = EngineConfig(model=tiny_models["llama"][0], device="cpu", dtype="float32", enable_prefix_caching=False)
    return LLMEngine(config)


def requests(stop: str | None = None) -> list[SamplingParams]:
    """Greedy with logprobs and prompt logprobs; two seeded samples; greedy with a stop string."""
    return [
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=2, prompt_logprobs=1),
        SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=12, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, stop=stop),
    ]


def run(engine, kind: RequestOutputKind, stop: str | None = None) -> dict[str, list]:
    """Each request's outputs, step by step, with `kind`."""
    for i, (prompt, params) in enumerate(zip(PROMPTS, requests(stop))):
        engine.add_request({"prompt_token_ids": prompt}, dataclasses.replace(params, output_kind=kind), str(i))
    outputs = defaultdict(list)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert not engine.output_processor.sent  # a finished request leaves nothing behind
    return outputs


def samples(out) -> list[tuple]:
    return [
        (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob, c.logprobs)
        for c in out.outputs
    ]


@pytest.fixture(scope="module")
def runs(engine):
    plain = run(engine, CUMULATIVE)
    text = plain["2"][-1].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a stop string the greedy request meets midway
    assert len(stop) == 3 and stop.strip()
    return {kind: run(engine, kind, stop) for kind in RequestOutputKind}


def test_cumulative_is_the_default_and_grows_every_step(runs):
    assert SamplingParams().output_kind is CUMULATIVE
    for outputs in runs[CUMULATIVE].values():
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        for earlier, later in zip(outputs, outputs[1:]):
            for a, b in zip(earlier.outputs, later.outputs):
                assert b.token_ids[: len(a.token_ids)] == a.token_ids and len(b.token_ids) > len(a.token_ids)
    assert len(runs[CUMULATIVE]["1"][-1].outputs) == 2
    assert runs[CUMULATIVE]["2"][-1].outputs[0].finish_reason == "stop"  # the stop string ended it


def test_final_only_gives_one_output_per_request_the_finished_one(runs):
    for rid, outputs in runs[FINAL_ONLY].items():
        (out,) = outputs
        last = runs[CUMULATIVE][rid][-1]
        assert out.finished and samples(out) == samples(last) and out.prompt_logprobs == last.prompt_logprobs
        assert out.metrics.token_times and len(out.metrics.token_times) == len(last.metrics.token_times)


def test_delta_pieces_add_up_to_the_cumulative_outputs(runs):
    for rid, outputs in runs[DELTA].items():
        cumulative = runs[CUMULATIVE][rid]
        assert len(outputs) == len(cumulative) and [o.finished for o in outputs] == [o.finished for o in cumulative]
        assert outputs[0].prompt_logprobs == cumulative[0].prompt_logprobs
        assert all(o.prompt_logprobs is None for o in outputs[1:])  # sent once
        for last in cumulative[-1].outputs:
            pieces = [c for o in outputs for c in o.outputs if c.index == last.index]
            assert "".join(c.text for c in pieces) == last.text
            assert [t for c in pieces for t in c.token_ids] == last.token_ids
            assert (None if last.logprobs is None else [e for c in pieces for e in c.logprobs]) == last.logprobs
            assert pieces[-1].finish_reason == last.finish_reason
            assert pieces[-1].cumulative_logprob == last.cumulative_logprob
        assert all(len(c.token_ids) <= 1 for o in outputs[1:] for c in o.outputs)  # one new token a step


def test_delta_text_never_shows_what_a_stop_string_cuts(runs):
    stopped = runs[CUMULATIVE]["2"][-1].outputs[0]
    streamed = ""
    for out in runs[DELTA]["2"]:
        streamed += out.outputs[0].text
        assert stopped.text.startswith(streamed)  # nothing sent is taken back
    assert stopped.stop_reason not in streamed


def test_an_aborted_delta_request_leaves_nothing_behind(engine):
    engine.add_request({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=50, output_kind=DELTA), "gone")
    engine.step()
    engine.step()
    assert "gone" in engine.output_processor.sent
    engine.abort_request("gone")
    assert not engine.output_processor.sent and not engine.has_unfinished_requests()


def test_output_kind_is_checked():
    with pytest.raises(TypeError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind=1)
    with pytest.raises(ValueError, match="best_of must equal n to use output_kind=DELTA"):
        SamplingParams(n=1, best_of=2, output_kind=DELTA)
    SamplingParams(n=1, best_of=2, output_kind=FINAL_ONLY)


def test_generate_returns_final_outputs_and_leaves_the_callers_params(tiny_models, runs):
    llm = LLM(tiny_models["llama"][0], device="cpu", dtype="float32", enable_prefix_caching=False)
    params = requests()
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params[:2], use_tqdm=False)
    for i, out in enumerate(outs):  # another batch and thread count: the same tokens, logprobs within float error
        last = runs[CUMULATIVE][str(i)][-1]
        assert [(c.text, c.token_ids, c.finish_reason) for c in out.outputs] == [
            (c.text, c.token_ids, c.finish_reason) for c in last.outputs
        ]
        assert [c.cumulative_logprob for c in out.outputs] == pytest.approx(
            [c.cumulative_logprob for c in last.outputs], abs=1e-4
        )
    assert all(p.output_kind is CUMULATIVE for p in params)


def test_a_stream_of_deltas_adds_up_to_the_whole_completion(engine, runs):
    """The server's SSE chunks from DELTA outputs (two samples, logprobs, usage): each choice's text,
    logprob tokens and text offsets run on from chunk to chunk and add up to the cumulative output."""
    import asyncio
    import itertools
    import json

    pytest.importorskip("fastapi")
    from pagedbench.entrypoints.async_llm import AsyncLLM
    from pagedbench.entrypoints.openai.streaming import stream_events

    class Connected:
        async def is_disconnected(self) -> bool:
            return False

    params = dataclasses.replace(requests()[1], output_kind=DELTA)

    async def events() -> list[dict]:
        llm = AsyncLLM(engine)
        stream = ((0, out) async for out in llm.generate({"prompt_token_ids": PROMPTS[1]}, params, "s"))
        first = await anext(stream)
        head = {"id": "s", "created": 0, "model": "m"}
        lines = [e async for e in stream_events(Connected(), first, stream, params, False, head, True)]
        await llm.stop()
        return [json.loads(line[6:]) for line in lines if line != "data: [DONE]\n\n"]

    chunks = asyncio.run(events())
    whole = runs[CUMULATIVE]["1"][-1]
    for c in whole.outputs:
        mine = [choice for chunk in chunks for choice in chunk["choices"] if choice["index"] == c.index]
        assert "".join(choice["text"] for choice in mine) == c.text and mine[-1]["finish_reason"] == "length"
        tokens = [t for choice in mine for t in choice["logprobs"]["tokens"]]
        offsets = [o for choice in mine for o in choice["logprobs"]["text_offset"]]
        assert len(tokens) == len(c.token_ids) and offsets == list(
            itertools.accumulate(map(len, tokens[:-1]), initial=0)
        )
    assert chunks[-1]["usage"] == {"prompt_tokens": len(PROMPTS[1]), "completion_tokens": 24, "total_tokens": 41}
