"""Models whose attention is not plain causal -- Mistral's sliding window, Gemma 2 (soft-caps,
alternating windowed layers), Gemma 3 (q/k norms, local/global layers with their own RoPE
bases) -- generate Hugging Face's greedy tokens in fp32 through every CPU backend that claims
their variants, with prompt + output far beyond the window, also under a small KV budget
(preemption, chunked prefill) with prefix caching."""

import random

import pytest

from pagedbench import LLM, SamplingParams
from pagedbench.engine.block_manager import NO_BLOCK
from pagedbench.model.loader import resolve_model_config
from tests.conftest import VARIANT_MODELS, VOCAB, WINDOW, hf_greedy
from tests.helpers import backend_params

PROMPT_LENS = [64, 23, 40]
MAX_NEW = 64
SETUPS = {
    "roomy": dict(block_size=16),
    # KV for about one sequence, a token budget under the prompts: preemption and chunked prefill.
    "pressure": dict(block_size=8, num_blocks=18, max_num_batched_tokens=24, enable_prefix_caching=True),
}


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    shared = [rng.randrange(3, VOCAB) for _ in range(20)]  # a common prefix: prefix-cache hits
    return [shared + [rng.randrange(3, VOCAB) for _ in range(n - 20)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_outputs(variant_models, prompts):
    return {name: [hf_greedy(model, p, MAX_NEW) for p in prompts] for name, (_, model) in variant_models.items()}


def test_configs_read_the_variants(variant_models):
    """What the engine reads of each config: windows on the right layers, soft-caps, scale, RoPE."""
    mistral, gemma2, gemma3 = (resolve_model_config(variant_models[n][0])[0] for n in ("mistral", "gemma2", "gemma3"))
    assert [v.sliding_window for v in mistral.layer_variants()] == [WINDOW, WINDOW]
    assert [(v.sliding_window, v.softcap) for v in gemma2.layer_variants()] == [(WINDOW, 5.0), (None, 5.0)]
    assert gemma2.final_softcap == 3.0 and gemma2.attention_scale == 24**-0.5 and gemma2.gemma
    assert [v.sliding_window for v in gemma3.layer_variants()] == [WINDOW, None, WINDOW]
    assert gemma3.qk_norm and (gemma3.local_rope_theta, gemma3.rope_theta) == (10000.0, 1000000.0)
    assert mistral.max_position_embeddings > WINDOW  # the window no longer caps the length


def engine_backends():
    """Every backend on every device; beyond sdpa on CPU, the slow tier (minutes in all)."""
    return [
        p if p.values == ("sdpa", "cpu") else pytest.param(*p.values, marks=[*p.marks, pytest.mark.slow], id=p.id)
        for p in backend_params()
    ]


def variant_cases():
    """Every backend x model x setup; triton (interpreted, ~5 s a run) under pressure only, which takes
    its roomy runs' kernel paths (windows, soft-caps) and adds preemption and chunks."""
    return [
        pytest.param(*p.values, model, setup, marks=p.marks, id=f"{p.id}-{model}-{setup}")
        for p in engine_backends()
        for model in VARIANT_MODELS
        for setup in SETUPS
        if not (p.values[0] == "triton" and setup == "roomy")
    ]


@pytest.mark.parametrize("backend,device,model_name,setup", variant_cases())
def test_greedy_matches_hf_past_the_window(variant_models, prompts, hf_outputs, backend, device, model_name, setup):
    llm = LLM(variant_models[model_name][0], backend=backend, device=device, dtype="float32", **SETUPS[setup])
    assert llm.engine.max_model_len >= max(PROMPT_LENS) + MAX_NEW > 4 * WINDOW
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_outputs[model_name]
    if setup == "pressure":
        assert llm.engine.block_manager.prefix_cache.hits > 0
        # Mistral's pages leave with its window, so the same budget needs no preemption there.
        windowed = llm.engine.model_config.window_of_every_layer is not None
        assert (llm.engine.stats.preemptions > 0) != windowed


def test_a_window_releases_the_pages_behind_it(variant_models, prompts, hf_outputs):
    """Every Mistral layer is windowed: between steps each sequence holds only the pages its next
    token's window reaches (plus the step's chunk), however long it grows; Gemma keeps them all."""
    block_size, chunk = 8, 24
    llm = LLM(
        variant_models["mistral"][0], backend="sdpa", device="cpu", dtype="float32", block_size=block_size,
        num_blocks=40, max_num_batched_tokens=chunk,
    )  # fmt: skip
    engine, bound = llm.engine, (WINDOW + chunk) // block_size + 2
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request({"prompt_token_ids": p}, params, request_id=str(i))
    peak, outputs = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
        for seq in engine.scheduler.running:
            peak = max(peak, sum(b != NO_BLOCK for b in seq.block_table))
            assert sum(b != NO_BLOCK for b in seq.block_table) <= bound, (seq.num_computed_tokens, seq.block_table)
    assert [outputs[str(i)] for i in range(len(prompts))] == hf_outputs["mistral"]
    assert peak <= bound < (max(PROMPT_LENS) + MAX_NEW) // block_size  # bounded well below a full sequence
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    gemma = resolve_model_config(variant_models["gemma2"][0])[0]
    assert gemma.window_of_every_layer is None  # global layers read every page: none released


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_windowed_sequences_survive_preemption(variant_models, prompts, hf_outputs, mode):
    """Too few pages even for windowed sequences: preempted by swap (released pages stay released,
    only held ones move) or by recompute, they still generate Hugging Face's tokens."""
    llm = LLM(
        variant_models["mistral"][0], backend="sdpa", device="cpu", dtype="float32", block_size=8, num_blocks=7,
        max_num_batched_tokens=24, preemption_mode=mode, max_model_len=MAX_NEW + max(PROMPT_LENS),
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_outputs["mistral"]
    assert llm.engine.stats.preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and len(bm.swap_space.free) == bm.num_cpu_blocks


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["gemma2", "gemma3"])
def test_compiled_model_matches_hf(variant_models, prompts, hf_outputs, model_name):
    """compile=True: Gemma's 1 + w norms around attention and MLP, GeLU-tanh, soft-caps, Gemma 3's
    q/k norms and local RoPE base, fused — the same greedy tokens as Hugging Face."""
    llm = LLM(variant_models[model_name][0], backend="sdpa", dtype="float32", compile=True, **SETUPS["pressure"])
    assert llm.engine.executor.compiled
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_outputs[model_name]
