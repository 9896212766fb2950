"""Greedy generation through the engine is token-identical to Hugging Face's greedy decoding."""

import random

import pytest

from pagedbench import LLM, SamplingParams
from tests.conftest import TINY_MODELS, VOCAB, hf_greedy
from tests.helpers import backend_params

PROMPT_LENS = [1, 7, 16, 17, 33, 58]  # one token up to several 16-token blocks, edges included
MAX_NEW = 12


@pytest.fixture(scope="session")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="session")
def hf_outputs(tiny_models, prompts):
    return {name: [hf_greedy(model, p, MAX_NEW) for p in prompts] for name, (_, model) in tiny_models.items()}


# "pressure": a KV cache barely larger than one max-length sequence and a token budget
# smaller than most prompts, so steps preempt and prefills are chunked.
ENGINE_SETUPS = {
    "roomy": dict(block_size=16),
    "pressure": dict(block_size=8, num_blocks=11, max_model_len=80, max_num_batched_tokens=20),
}


@pytest.mark.parametrize("setup", ENGINE_SETUPS)
@pytest.mark.parametrize("model_name", TINY_MODELS)
@pytest.mark.parametrize("backend,device", backend_params())
def test_greedy_matches_hf(tiny_models, prompts, hf_outputs, backend, device, model_name, setup):
    llm = LLM(tiny_models[model_name][0], backend=backend, device=device, dtype="float32", **ENGINE_SETUPS[setup])
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_outputs[model_name]
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    stats, bm = llm.engine.stats, llm.engine.block_manager
    if setup == "pressure":
        assert stats.preemptions > 0, "the pressure setup must preempt"
        assert max(PROMPT_LENS) > ENGINE_SETUPS[setup]["max_num_batched_tokens"]  # chunked prefill happened
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.pool.ref_counts)


def test_text_prompts_match_hf(tiny_models):
    """Text in, text out: the engine's tokenizer path agrees with HF on the same ids."""
    path, model = tiny_models["llama"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    texts = ["the quick brown fox", "paged attention stores keys and values in fixed size blocks"]
    llm = LLM(path, dtype="float32", device="cpu")
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for text, out in zip(texts, outs):
        ids = tok.encode(text)
        assert out.prompt == text and out.prompt_token_ids == ids
        expected = hf_greedy(model, ids, 10)
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].text == tok.decode(expected, skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("model_name,backend", [("llama", "sdpa"), ("qwen3", "sdpa"), ("llama", "flex")])
def test_compiled_model_matches_hf(tiny_models, prompts, hf_outputs, model_name, backend):
    """compile=True (fused norms, RoPE, activation; merged q/k/v and gate/up) under preemption and
    chunked prefill: the same greedy tokens as Hugging Face."""
    llm = LLM(tiny_models[model_name][0], backend=backend, dtype="float32", compile=True, **ENGINE_SETUPS["pressure"])
    assert llm.engine.executor.compiled
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_outputs[model_name]
    assert llm.engine.stats.preemptions > 0
