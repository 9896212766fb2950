"""Multi-head latent attention (DeepSeek-V3): tiny random DeepseekV3ForCausalLM models give greedy
tokens identical to Hugging Face's in fp32 for every backend that claims latent attention (the
others say why), under chunked prefill, preemption and prefix caching; the latent cache holds
one latent per token and layer."""

import importlib.util
import random
from pathlib import Path

import pytest
import torch
from pagedbench.backends.base import AttentionVariant
from pagedbench.backends.registry import get_backend, list_backends, probe

from pagedbench import LLM, SamplingParams
from pagedbench.model.config import ModelConfig
from pagedbench.worker.model_runner import kv_bytes_per_block
from tests.conftest import VOCAB, build_hf_model, hf_greedy
from tests.helpers import DEVICES, assert_swap_and_tp2_keep_the_tokens, backend_id

LATENT = dict(
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    first_k_dense_replace=2,  # every layer dense (test_moe.py has DeepSeek-V3's MoE layers)
    n_routed_experts=4,
)
# DeepSeek's YaRN, with the mscale that also scales the softmax
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
}
# DeepSeek-V3's own choices (a q LoRA, interleaved rotary dims, YaRN with its mscale), and the plain ones.
MLA_MODELS = {
    "deepseek-v3": (
        "DeepseekV3Config",
        LATENT
        | dict(
            q_lora_rank=24,
            rope_interleave=True,
            rope_parameters=YARN,
        ),
    ),
    "deepseek-v3-plain": (
        "DeepseekV3Config",
        LATENT | dict(q_lora_rank=None, rope_interleave=False, rope_parameters={"rope_theta": 10000.0}),
    ),
}
PROMPT_LENS = [1, 7, 16, 17, 33, 58]
MAX_NEW = 12
SETUPS = {
    "roomy": dict(block_size=16),
    "pressure": dict(block_size=8, num_blocks=11, max_model_len=80, max_num_batched_tokens=20),
}


@pytest.fixture(scope="module")
def mla_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla")
    return {name: (str(root / name), build_hf_model(name, root / name, MLA_MODELS)) for name in MLA_MODELS}


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]


def latent_params():
    """Every backend on every device, skipped with its reason where it cannot run latent attention."""
    params = []
    for device in DEVICES:
        for name in list_backends():
            _, reason = probe(
                get_backend(name), torch.device(device), torch.float32, 40, 16,
                num_heads=4, num_kv_heads=1, **AttentionVariant(value_dim=32).settings(),
            )  # fmt: skip
            marks = [pytest.mark.skip(reason=f"{name} on {device}: {reason}")] if reason else []
            params.append(pytest.param(name, device, id=f"{backend_id(name)}-{device}", marks=marks))
    return params


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("model_name", MLA_MODELS)
@pytest.mark.parametrize("backend,device", latent_params())
def test_greedy_matches_hf(mla_models, prompts, backend, device, model_name, setup):
    path, hf = mla_models[model_name]
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    llm = LLM(path, backend=backend, device=device, dtype="float32", **SETUPS[setup])
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    if setup == "pressure":
        assert llm.engine.stats.preemptions > 0


def test_shared_prefix_pages_are_latents_too(mla_models):
    """Prefix caching: a second request sharing a 32-token prefix reads the first one's latent pages."""
    path, hf = mla_models["deepseek-v3"]
    prefix = list(range(3, 35))
    prompts = [prefix + [40, 41, 42], prefix + [50, 51]]
    llm = LLM(path, backend="sdpa", device="cpu", dtype="float32", block_size=16, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0]
    second = llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)[0]
    assert second.num_cached_tokens == 32
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == [hf_greedy(hf, p, 8) for p in prompts]


def test_the_latent_cache_holds_one_latent_per_token(mla_models):
    """One plane of kv_lora_rank + rope numbers per token and layer: the same memory holds
    (qk_nope + rope + v) x heads / (kv_lora_rank + rope) times the blocks of full per-head K/V."""
    path, _ = mla_models["deepseek-v3"]
    cfg = ModelConfig.from_dir(Path(path))
    m = cfg.mla
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.kv_planes) == (1, m.kv_lora_rank + m.qk_rope_head_dim, 1)
    latent = kv_bytes_per_block(cfg, 16, torch.float32)
    assert latent == cfg.num_layers * 16 * (m.kv_lora_rank + m.qk_rope_head_dim) * 4
    per_head_kv = cfg.num_layers * 16 * cfg.num_heads * (m.qk_head_dim + m.v_head_dim) * 4
    assert per_head_kv / latent == pytest.approx(
        (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * cfg.num_heads / (m.kv_lora_rank + m.qk_rope_head_dim)
    )
    llm = LLM(path, backend="sdpa", device="cpu", dtype="float32", num_blocks=20, block_size=16)
    runner = llm.engine.runner
    assert runner.kv_cache.shape == (cfg.num_layers, 1, 21, 16, 1, m.latent_dim)
    k_cache, v_cache = runner.kv_caches[0]
    assert v_cache.data_ptr() == k_cache.data_ptr() and v_cache.shape[-1] == m.kv_lora_rank  # a view


def test_backends_without_latent_values_say_why():
    from pagedbench.backends.reference import ReferenceBackend

    class Unlatent(ReferenceBackend):  # a backend that never declared latent_values
        latent_values = False

    reason = probe(Unlatent, torch.device("cpu"), torch.float32, 40, 16, value_dim=32)[1]
    assert reason == "latent attention (MLA, values the keys' first 32 dims): " + Unlatent.latent_values_reason
    assert probe(get_backend("flash-attn"), torch.device("cpu"), torch.float32, 40, 16, value_dim=32)[1]


@pytest.mark.slow
def test_swap_preemption_and_tensor_parallelism_keep_the_tokens(mla_models, prompts):
    """Preemption by swap moves latent pages out and back; tensor parallelism shards the heads and
    replicates the latent (as vLLM does): both give Hugging Face's greedy tokens."""
    path, hf = mla_models["deepseek-v3"]
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    assert_swap_and_tp2_keep_the_tokens(path, prompts, expected, MAX_NEW, **SETUPS["pressure"])


@pytest.mark.parametrize("kv_cache_dtype,floor", [("int8", 0.97), ("fp8", 0.9)])
def test_quantized_latent_pages(mla_models, kv_cache_dtype, floor):
    """fp8 and int8 latent pages: one scale serves the latent and its value view; every backend that
    reads them agrees with reference on the same pages, and the next-token argmax mostly survives."""
    from pagedbench.bench import kv_quality

    path, _ = mla_models["deepseek-v3"]
    rng = random.Random(2)
    segments = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (40, 57, 23)]
    cpu32 = dict(device="cpu", dtype="float32")
    exact = kv_quality.teacher_forced_logprobs(path, "sdpa", "auto", segments, chunk=16, **cpu32)
    quantized = kv_quality.teacher_forced_logprobs(path, "sdpa", kv_cache_dtype, segments, chunk=16, **cpu32)
    reference = kv_quality.teacher_forced_logprobs(path, "reference", kv_cache_dtype, segments, chunk=16, **cpu32)
    torch.testing.assert_close(quantized, reference, atol=5e-4, rtol=0)
    if importlib.util.find_spec("triton") is not None:  # its latent kernel scales scores and probabilities
        triton = kv_quality.teacher_forced_logprobs(path, "triton", kv_cache_dtype, segments, chunk=16, **cpu32)
        torch.testing.assert_close(triton, reference, atol=5e-4, rtol=0)
    assert not torch.equal(quantized, exact)  # the pages were quantized
    agreement = (quantized.argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert agreement >= floor, agreement


def test_speculative_decoding_keeps_the_tokens(mla_models, prompts):
    """n-gram speculation verifies k + 1 query tokens per sequence against the latent pages."""
    path, hf = mla_models["deepseek-v3"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(path, backend="sdpa", device="cpu", dtype="float32", speculative_config=spec)
    repetitive = [p * 3 for p in prompts[1:4]]  # something for the n-grams to find
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in repetitive], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_NEW) for p in repetitive]


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["deepseek-v3"])
def test_compiled_model_matches_hf(mla_models, prompts, model_name):
    """compile=True: the latent's norms and the interleaved (YaRN) rotary parts fused."""
    path, hf = mla_models[model_name]
    llm = LLM(path, backend="sdpa", dtype="float32", compile=True, **SETUPS["pressure"])
    assert llm.engine.executor.compiled
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
