"""Code written for vLLM (or nano-vllm) runs unchanged: prompt forms, engine calls, arguments
and output fields with vLLM's names."""

import shutil

import pytest

from pagedbench import LLM, SamplingParams
from tests.conftest import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(chat_model):
    return LLM(str(chat_model), device="cpu", dtype="float32")


def test_every_prompt_form_gives_the_same_tokens(llm, tiny_models):
    text = "the quick brown fox"
    ids = llm.get_tokenizer().encode(text)
    expected = hf_greedy(tiny_models["llama"][1], ids, 5)
    forms = [text, {"prompt": text}, {"prompt_token_ids": ids}, ids]
    for form in forms:  # each alone, as one prompt
        (out,) = llm.generate(form, GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == expected and out.prompt_token_ids == ids
    outs = llm.generate(forms + [list(ids)], GREEDY, use_tqdm=False)  # nano-vllm passes lists of id lists
    assert [o["token_ids"] for o in outs] == [expected] * 5  # nano-vllm's output dict keys
    assert outs[0]["text"] == outs[0].outputs[0].text and outs[0].prompt == text and outs[3].prompt is None
    with pytest.raises(KeyError):
        outs[0]["logprobs"]


def test_output_fields(llm):
    prompt = {"prompt_token_ids": list(range(3, 3 + 40))}
    first, second = (llm.generate(prompt, GREEDY, use_tqdm=False)[0] for _ in range(2))
    assert first.outputs[0].finished() and first.outputs[0].finish_reason == "length"
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 32  # two full 16-token pages from the prefix cache (never the last token)


def test_engine_calls_in_vllm_order(llm):
    engine = llm.llm_engine
    assert engine is llm.engine and engine.get_tokenizer() is llm.get_tokenizer()
    engine.add_request("a", "the lazy dog", GREEDY)  # vLLM: add_request(request_id, prompt, params)
    engine.add_request("b", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    engine.add_request("c", [8, 9], GREEDY)
    assert engine.get_num_unfinished_requests() == 3
    engine.step()
    engine.abort_request(["a", "c"])  # vLLM v1 takes a list
    assert engine.get_num_unfinished_requests() == 1
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["b"]
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        engine.add_request("d", "x", "not params")


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "the quick brown fox"}]
    text = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    expected = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    one = llm.chat(messages, GREEDY, use_tqdm=False)
    two = llm.chat([messages, messages], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in one + two] == [expected] * 3 and one[0].prompt == text


def test_chat_without_a_template_is_a_clear_error(tiny_models):
    llm = LLM(tiny_models["llama"][0], device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_vllm_engine_arguments(tiny_models, tmp_path):
    path = tiny_models["llama"][0]
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    base = LLM(path, device="cpu", dtype="float32").generate(prompt, GREEDY, use_tqdm=False)[0]
    same = LLM(
        path,
        device="cpu",
        dtype="float",
        trust_remote_code=True,
        disable_log_stats=True,
        enable_chunked_prefill=True,
        load_format="auto",
        seed=None,
    )
    assert same.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == base.outputs[0].token_ids
    assert LLM(path, device="cpu", dtype="half").engine.dtype.itemsize == 2
    with pytest.raises(ValueError, match="enable_chunked_prefill may only be True"):
        LLM(path, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="more than the 2 logprobs"):
        LLM(path, device="cpu", max_logprobs=2).generate(prompt, SamplingParams(logprobs=3), use_tqdm=False)

    # load_format="dummy": the directory's shapes and tokenizer with random weights, no weight files needed.
    bare = tmp_path / "bare"
    shutil.copytree(path, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(bare))
    dummy = LLM(str(bare), device="cpu", load_format="dummy")
    out = dummy.generate("the quick brown fox", GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].token_ids != base.outputs[0].token_ids

    # tokenizer=: a tokenizer from another directory
    weights_only = tmp_path / "weights"
    shutil.copytree(path, weights_only, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    assert LLM(str(weights_only), device="cpu").get_tokenizer() is None
    borrowed = LLM(str(weights_only), device="cpu", dtype="float32", tokenizer=path)
    assert borrowed.generate("the quick brown fox", GREEDY, use_tqdm=False)[0].outputs[0].text


def test_a_single_priority_applies_to_every_prompt(tiny_models):
    llm = LLM(tiny_models["llama"][0], device="cpu", scheduling_policy="priority")
    outs = llm.generate([[5, 6], [7, 8]], GREEDY, use_tqdm=False, priority=3)
    assert len(outs) == 2 and all(o.finished for o in outs)


def test_logit_bias_steers_every_step(llm):
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    favoured = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={42: 100})
    assert llm.generate(prompt, favoured, use_tqdm=False)[0].outputs[0].token_ids == [42] * 6
    free = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    banned = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={free[0]: -100})
    assert llm.generate(prompt, banned, use_tqdm=False)[0].outputs[0].token_ids[0] != free[0]
    with pytest.raises(ValueError, match="in \\[-100, 100\\]"):
        SamplingParams(logit_bias={1: 101})
    with pytest.raises(ValueError, match="logit_bias: token id 10000 is outside"):
        llm.generate(prompt, SamplingParams(logit_bias={10000: 1.0}), use_tqdm=False)


def test_detokenize_false_returns_token_ids_only(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, detokenize=False)
    out = llm.generate("the quick brown fox", params, use_tqdm=False)[0].outputs[0]
    assert out.text == "" and len(out.token_ids) == 4
    assert all(lp.decoded_token is None for entry in out.logprobs for lp in entry.values())
    with pytest.raises(ValueError, match="stop strings need detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_clone_is_independent():
    params = SamplingParams(stop=["a"], logit_bias={1: 2.0}, seed=3)
    copy = params.clone()
    copy.stop.append("b")
    copy.logit_bias[5] = 1.0
    assert params.stop == ["a"] and params.logit_bias == {1: 2.0} and copy.seed == 3


def test_engine_from_engine_args(tiny_models):
    from pagedbench import EngineArgs, LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_models["llama"][0], device="cpu"))
    rid = engine.add_request("x", [5, 6, 7], GREEDY)
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[0].request_id == rid == "x" and len(outs[0].outputs[0].token_ids) == 5


def test_min_tokens_holds_against_a_logits_processor(llm):
    def force_eos(output_token_ids, logits):  # vLLM's per-request form: one row
        logits[2] = 1e9
        return logits

    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=3, logits_processors=[force_eos])
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0]
    assert 2 not in out.token_ids[:3] and out.token_ids[3] == 2 and out.finish_reason == "stop"


def test_policy_alias_and_reset_prefix_cache(tiny_models):
    llm = LLM(tiny_models["llama"][0], device="cpu", policy="priority")
    assert llm.engine.config.scheduling_policy == "priority"
    prompt = {"prompt_token_ids": list(range(3, 40))}
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 32
    llm.reset_prefix_cache()
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    with pytest.raises(ValueError, match="disagree"):
        LLM(tiny_models["llama"][0], policy="priority", scheduling_policy="fcfs")


def test_presets_take_text_prompts_through_a_byte_tokenizer():
    llm = LLM("tiny-llama", device="cpu")
    text = "Hello, wörld!"
    out = llm.generate(text, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode(text) and len(out.prompt_token_ids) == len(text.encode())
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == text and llm.get_tokenizer().eos_token_id == 2
    ids = {"prompt_token_ids": out.prompt_token_ids}
    assert llm.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == out.outputs[0].token_ids
    tokens = out.outputs[0].token_ids
    assert out.outputs[0].text == "".join(f"<{t}>" for t in tokens)  # random weights: ids past the bytes
    stopped = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, stop=[f"<{tokens[1]}>"])
    assert llm.generate(text, stopped, use_tqdm=False)[0].outputs[0].token_ids == tokens[:2]


def test_num_cached_tokens_survives_forks(tiny_models):
    from pagedbench import BeamSearchParams

    llm = LLM(tiny_models["llama"][0], device="cpu", dtype="float32")
    prompt = {"prompt_token_ids": list(range(3, 40))}
    llm.generate(prompt, GREEDY, use_tqdm=False)  # caches two full pages
    engine = llm.engine
    sampled = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=3, ignore_eos=True)
    for params in (sampled, BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)):
        engine.add_request(prompt, params, request_id=type(params).__name__)
        finished = []
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
        assert [o.num_cached_tokens for o in finished] == [32], type(params).__name__


def test_presets_chat_with_their_template():
    """A preset (and the trained pair) ships a small chat template: chat works without a model directory."""
    from pagedbench.model.tokenizer import PRESET_CHAT_TEMPLATE

    llm = LLM("tiny-llama", device="cpu", dtype="float32", num_blocks=32)
    assert llm.get_tokenizer().chat_template == PRESET_CHAT_TEMPLATE
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0]
    assert out.prompt == "<|user|>\nhi\n<|assistant|>\n" and out.outputs[0].token_ids


@pytest.mark.parametrize("prompts", [5, None, 2.5, object()])
def test_prompts_of_no_known_form_are_a_clear_error(llm, prompts):
    with pytest.raises(TypeError, match=r"^prompts must be a str, .* got "):
        llm.generate(prompts, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("params", [{"temperature": 0}, "greedy", [GREEDY, {"max_tokens": 3}]])
def test_sampling_params_of_another_type_are_a_clear_error(llm, params):
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them"):
        llm.generate(["a", "b"], params, use_tqdm=False)


def test_warm_up_leaves_no_trace(tiny_models):
    """LLMEngine.warm_up (what `serve` runs before it binds) steps a full prefill chunk and a few
    decodes, then leaves the engine as it found it: no requests, no stats, no cached prefix; the
    first real request gives the tokens it would have given without it."""
    from pagedbench import EngineConfig, LLMEngine

    params = SamplingParams(temperature=0, max_tokens=6)
    config = EngineConfig(model=tiny_models["llama"][0], dtype="fp32", max_num_batched_tokens=64, num_blocks=64)
    cold = LLM(tiny_models["llama"][0], dtype="fp32", num_blocks=64).generate([[5, 6, 7, 8]], params)
    engine = LLMEngine(config)
    seconds, compiling = engine.warm_up()
    assert seconds > 0 and compiling == 0  # sdpa compiles nothing
    assert not engine.requests and engine.stats.steps == 0 and engine.stats.generation_tokens == 0
    assert engine.block_manager.num_used_blocks == 0 and engine.block_manager.prefix_cache.num_cached == 0
    engine.add_request({"prompt_token_ids": [5, 6, 7, 8]}, params, request_id="real")
    with pytest.raises(ValueError, match="warm_up runs on an idle engine"):
        engine.warm_up()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert outputs[0].outputs[0].token_ids == cold[0].outputs[0].token_ids
