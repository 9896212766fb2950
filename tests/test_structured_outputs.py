"""Structured outputs (xgrammar): every output under a JSON schema validates against it (jsonschema),
regex outputs match, choice outputs are one of the choices, grammars parse; greedy and sampled, with
n > 1, prefix caching, preemption (recompute and swap) and speculative decoding, on a tiny HF model
with a trained tokenizer and on a preset; constrained rows never change unconstrained ones; bad
constraints are one-line ValueErrors that leave other requests running."""

import json
import re

import pytest

from pagedbench import LLM, SamplingParams
from pagedbench.engine.structured_outputs import constraint_key
from pagedbench.sample.sampling_params import GuidedDecodingParams, StructuredOutputsParams

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

# Bounded (every string, array and number has a limit), so a random-weight model finishes it.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "ok"],
}
JSON = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
REGEX = r"(\d{3}-[a-z]{2,5}|none)"
CHOICES = ["positive", "negative", 'say "ok" \\ ü', "😀 emoji"]  # quotes, a backslash, non-ASCII, non-BMP
GRAMMAR = 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [1-9] [0-9]?'  # EBNF
LARK = 'start: "[" NUM ("," NUM)~0..2 "]"\nNUM: /[0-9]/'
PROMPTS = ["the quick brown fox", "paged attention stores keys", "a scheduler batches requests", "hello world"]
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"][0], dtype="float32", device="cpu", seed=0)


def sampled(**kw) -> dict:
    return dict(temperature=1.0, top_p=0.95, max_tokens=MAX_TOKENS) | kw


def check_json(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def texts(outputs) -> list[str]:
    return [c.text for o in outputs for c in o.outputs]


def run(llm, prompts, params) -> list[str]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs), [
        c.finish_reason for o in outs for c in o.outputs
    ]
    return texts(outs)


def test_json_schema_outputs_validate_on_many_seeds(llm):
    params = [SamplingParams(**sampled(seed=s), structured_outputs=JSON) for s in range(24)]
    outs = run(llm, [PROMPTS[s % 4] for s in range(24)], params)
    for text in outs:
        check_json(text)
    assert len(set(outs)) > 8  # sampled, not one constant string
    for text in run(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=JSON)):
        check_json(text)


def test_regex_choice_and_grammars(llm):
    for temperature in (0.0, 1.0):
        kw = dict(temperature=temperature, seed=3, max_tokens=MAX_TOKENS)
        for text in run(llm, PROMPTS, SamplingParams(**kw, structured_outputs=StructuredOutputsParams(regex=REGEX))):
            assert re.fullmatch(REGEX, text), text
        choice = StructuredOutputsParams(choice=CHOICES)
        assert set(run(llm, PROMPTS * 2, SamplingParams(**kw, structured_outputs=choice))) <= set(CHOICES)
        for text in run(
            llm, PROMPTS, SamplingParams(**kw, structured_outputs=StructuredOutputsParams(grammar=GRAMMAR))
        ):
            assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?){0,3}\)", text), text
        for text in run(llm, PROMPTS, SamplingParams(**kw, structured_outputs=StructuredOutputsParams(grammar=LARK))):
            assert re.fullmatch(r"\[[0-9](,[0-9]){0,2}\]", text), text


def test_json_object_and_the_older_names(llm):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, guided_decoding=GuidedDecodingParams(regex="[ab]{4}"))
    assert params.structured_outputs.regex == "[ab]{4}" and params.guided_decoding is None
    assert all(re.fullmatch("[ab]{4}", t) for t in run(llm, PROMPTS, params))
    any_object = {"json_object": True, "disable_any_whitespace": True}
    outs = llm.generate(PROMPTS, SamplingParams(**sampled(seed=1), structured_outputs=any_object), use_tqdm=False)
    for c in (c for o in outs for c in o.outputs):
        if c.finish_reason == "stop":  # any object may nest deeper than max_tokens; a finished one parses
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.text.startswith("{")


def test_n_samples_each_follow_the_schema(llm):
    params = SamplingParams(**sampled(seed=5, n=3, best_of=4), structured_outputs=JSON)
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [3, 3]
    for text in texts(outs):
        check_json(text)
    assert len(set(texts(outs))) > 2


def test_constrained_rows_leave_others_alone(llm):
    """A batch mixing constrained and free requests: the free ones are what they are alone."""
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = texts(llm.generate(PROMPTS, free, use_tqdm=False))
    params = [free, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=JSON)] * 2
    mixed = texts(llm.generate(PROMPTS, params, use_tqdm=False))
    assert mixed[0::2] == alone[0::2]
    for text in mixed[1::2]:
        check_json(text)


def test_a_non_bmp_choice_and_a_grammar_overridden(llm, caplog):
    """An emoji choice comes out as itself (not as surrogate halves); settings that leave the grammar no
    token (allowed_token_ids disjoint from it) end the output with a warning naming the request."""
    emoji = StructuredOutputsParams(choice=["😀 ok"])
    assert run(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16, structured_outputs=emoji)) == ["😀 ok"]
    digits = StructuredOutputsParams(regex="[0-9]+")
    params = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=[5], structured_outputs=digits)
    out = llm.generate({"prompt_token_ids": [7, 8]}, params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1 and "breaks its structured-output constraint" in caplog.text


def test_min_tokens_does_not_strand_a_finished_grammar(llm):
    params = SamplingParams(
        temperature=0, max_tokens=40, min_tokens=30, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    assert set(run(llm, PROMPTS, params)) <= {"yes", "no"}


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_and_prefix_caching_keep_outputs(tiny_models, preemption_mode):
    """Under a KV budget that preempts (the matcher keeps its state, as the sequence keeps its tokens),
    with prefix caching, chunked prefill and 4-token pages: the same seeded outputs as an unpressured
    run, all valid, no page held at the end."""
    path = tiny_models["llama"][0]
    params = [SamplingParams(**sampled(seed=s), structured_outputs=JSON) for s in range(6)]
    prompts = [PROMPTS[0] + " and more words to share a prefix " + str(s) for s in range(6)]
    roomy = texts(LLM(path, dtype="float32", device="cpu", seed=0).generate(prompts, params, use_tqdm=False))
    tight = LLM(path, dtype="float32", device="cpu", seed=0, block_size=4, num_blocks=36, max_num_batched_tokens=16,
                preemption_mode=preemption_mode, swap_space=0.01, enable_prefix_caching=True)  # fmt: skip
    assert texts(tight.generate(prompts, params, use_tqdm=False)) == roomy
    engine = tight.llm_engine
    assert engine.stats.preemptions > 0 and (engine.stats.swap_outs > 0) == (preemption_mode == "swap")
    assert engine.block_manager.num_used_blocks == 0
    for text in roomy:
        check_json(text)


@pytest.mark.parametrize(
    "spec", [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}, {"num_speculative_tokens": 2}]
)
def test_speculative_decoding_under_a_grammar(tiny_models, llm, spec):
    """Greedy: token-identical to decoding without speculation (proposals the grammar refuses are
    rejected); sampled: every output valid."""
    path = tiny_models["llama"][0]
    spec = spec if "method" in spec else spec | {"model": path}  # the tiny llama drafts for itself
    spec_llm = LLM(path, dtype="float32", device="cpu", seed=0, speculative_config=spec)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=JSON)
    assert run(spec_llm, PROMPTS, greedy) == run(llm, PROMPTS, greedy)
    for text in run(spec_llm, PROMPTS * 2, SamplingParams(**sampled(seed=7), structured_outputs=JSON)):
        check_json(text)
    regex = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(regex=REGEX)
    )
    assert run(spec_llm, PROMPTS, regex) == run(llm, PROMPTS, regex)
    assert spec_llm.llm_engine.stats.spec.num_draft_tokens > 0


def test_preset_json_schema():
    """A preset (random weights, its byte-level tokenizer): sampled and greedy outputs validate."""
    llm = LLM("tiny-llama", device="cpu", dtype="float32", seed=0)
    params = [SamplingParams(**sampled(seed=s, max_tokens=160), structured_outputs=JSON) for s in range(6)]
    for text in run(llm, ["{", "name:", "x"] * 2, params):
        check_json(text)


def test_grammars_compile_once_per_constraint(llm):
    structured = llm.llm_engine.structured_outputs
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"type":"object",\n "properties": {"x": {"type": "integer"}}}')
    assert constraint_key(a) == constraint_key(b)  # a dict and its JSON text, whitespace aside
    before = structured.num_compiled
    assert structured.compile(a) is structured.compile(b)
    assert structured.num_compiled == before + 1
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):  # a pydantic model class, as vLLM takes it
        x: int
        y: int

    point = StructuredOutputsParams(json=Point, disable_any_whitespace=True)
    for text in run(llm, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=point)):
        Point.model_validate_json(text)


NAME_AGE = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
}
AGE_NAME = NAME_AGE | {"properties": dict(reversed(NAME_AGE["properties"].items()))}  # same required list


def test_json_outputs_keep_the_schemas_property_order(llm):
    """Properties come out in the schema's order, not sorted (as OpenAI and vLLM: a "reasoning" before
    an "answer"), for a dict, a JSON string, a pydantic model and a server request body; schemas that
    differ only in property order are compiled apart, never served from one cache entry."""
    from pagedbench.entrypoints.openai.structured import structured_outputs_of

    structured = llm.llm_engine.structured_outputs
    forward = StructuredOutputsParams(json=NAME_AGE, disable_any_whitespace=True)
    reverse = StructuredOutputsParams(json=AGE_NAME, disable_any_whitespace=True)
    assert constraint_key(forward) != constraint_key(reverse)
    before = structured.num_compiled
    assert structured.compile(forward) is not structured.compile(reverse)
    assert structured.num_compiled == before + 2
    greedy = dict(temperature=0, max_tokens=MAX_TOKENS)
    for params, order in ((forward, ["name", "age"]), (reverse, ["age", "name"])):
        for text in run(llm, PROMPTS, SamplingParams(**greedy, structured_outputs=params)):
            assert list(json.loads(text)) == order, text
            jsonschema.validate(json.loads(text), NAME_AGE)

    text_schema = StructuredOutputsParams(json=json.dumps(AGE_NAME, indent=2), disable_any_whitespace=True)
    assert constraint_key(text_schema) == constraint_key(reverse)  # one entry: same schema, same order
    raw = json.dumps({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": AGE_NAME}}})
    body_params, _ = structured_outputs_of(json.loads(raw))  # as the server reads a request body
    assert list(body_params.json["properties"]) == ["age", "name"]
    for params in (text_schema, body_params):
        params = StructuredOutputsParams(json=params.json, disable_any_whitespace=True)
        for text in run(llm, PROMPTS[:2], SamplingParams(**greedy, structured_outputs=params)):
            assert list(json.loads(text)) == ["age", "name"], text

    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):  # fields declared in reverse alphabetical order
        name: str = pydantic.Field(max_length=8)
        age: int = pydantic.Field(ge=0, le=99)

    person = StructuredOutputsParams(json=Person, disable_any_whitespace=True)
    for text in run(llm, PROMPTS[:2], SamplingParams(**greedy, structured_outputs=person)):
        assert list(json.loads(text)) == ["name", "age"], text
        Person.model_validate_json(text)


@pytest.mark.parametrize(
    "constraint, message",
    [
        (dict(json={"type": "nonsense"}), "structured_outputs.json: Unsupported type"),
        (dict(json="{not json"), "structured_outputs.json: not valid JSON"),
        (dict(regex="a("), "structured_outputs.regex: Regex parsing error"),
        (dict(regex=r"[^\s\S]"), "no output the tokenizer can produce satisfies it"),
        (dict(grammar="root ::= "), "structured_outputs.grammar: EBNF parser error"),
        (dict(json="[" * 5000 + "]" * 5000), "structured_outputs.json: nested too deeply to read"),
    ],
)
def test_bad_constraints_are_one_line_errors_and_others_run_on(llm, constraint, message):
    engine = llm.llm_engine
    good = engine.add_request("hello world", SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        engine.add_request("hello", SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)))
    assert "\n" not in str(e.value)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == [good]


def test_bad_params_are_refused_up_front():
    with pytest.raises(ValueError, match="one kind of constraint, got json and regex"):
        StructuredOutputsParams(json=SCHEMA, regex="a+")
    with pytest.raises(ValueError, match="needs one of"):
        StructuredOutputsParams()
    with pytest.raises(TypeError, match="choice must be a list of strings"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(TypeError, match="has no field 'jsn'"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs=JSON, guided_decoding=JSON)
    with pytest.raises(ValueError, match="whitespace_pattern is not supported by xgrammar"):
        StructuredOutputsParams(json=SCHEMA, whitespace_pattern=r"\s?")
    with pytest.raises(ValueError, match="backend 'outlines' is not available"):
        StructuredOutputsParams(json=SCHEMA, backend="outlines")
    vllm_options = StructuredOutputsParams(json=SCHEMA, backend="xgrammar", disable_fallback=True)
    assert vllm_options.kind == "json"  # vLLM's options that apply to xgrammar are taken


def test_a_model_without_a_tokenizer_refuses_structured_outputs(tokenizerless_model):
    llm = LLM(str(tokenizerless_model), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="structured outputs need a tokenizer"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(structured_outputs=JSON), use_tqdm=False)


def test_structured_scenario_flag_and_bench_serve_body():
    """The `structured` scenario's constraint reaches every request; --structured-outputs overrides or
    turns it off; bench-serve sends it as vLLM's structured_outputs field; a bad one names the field."""
    from pagedbench.bench.scenario import load_scenario, parse_scenario
    from pagedbench.bench.serve_client import structured_outputs_body

    scenario = load_scenario("structured")
    params = scenario.sampling_params(8).structured_outputs
    assert scenario.structured_label == "json" and params.disable_any_whitespace and params.json["type"] == "object"
    assert structured_outputs_body(params) == {
        "json": scenario.structured_outputs["json"],
        "disable_any_whitespace": True,
    }
    plain = load_scenario("synthetic")
    assert plain.structured_label == "off" and plain.sampling_params(8).structured_outputs is None
    data = {"description": "x", "num_prompts": 1, "input_len": 4, "output_len": 4, "num_blocks": 8}
    assert (
        parse_scenario(data, "a").content_hash()
        != parse_scenario(data | {"structured_outputs": {"regex": "a"}}, "b").content_hash()
    )
    with pytest.raises(ValueError, match="scenario 'c': structured_outputs .*one kind of constraint"):
        parse_scenario(data | {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "c")


@pytest.mark.slow
def test_compare_reports_the_grammar_cost(tmp_path, capsys):
    import pandas as pd

    from pagedbench.entrypoints.cli.main import main

    args = ["--backends", "sdpa", "--num-prompts", "4", "--input-len", "8", "--output-len", "24", "--no-warmup"]
    so = '{"choice": ["yes", "no"]}'
    assert main(["compare", *args, "--structured-outputs", so, "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert "mask ms/step" in capsys.readouterr().out
    row = pd.read_csv(tmp_path / "compare-synthetic.csv").iloc[0]
    assert row["structured"] == "choice" and row["grammar_rows"] > 0 and row["time_grammar_fill_s"] > 0
    assert row["time_grammar_apply_s"] > 0 and 0 < row["grammar_share"] < 1
    assert row["total_output_tokens"] <= 4 * 4  # "yes" or "no" (a byte a token), then EOS: the grammar's end
