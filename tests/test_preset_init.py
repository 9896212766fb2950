"""Decisive preset weights: one-hot attention heads, so every correct backend's greedy tokens
are identical to the last bit, in bf16 too, while a backend that reads the wrong keys diverges."""

import dataclasses
import random

import pytest
import torch

from pagedbench import LLM, SamplingParams
from pagedbench.bench.metrics import identical_token_share
from pagedbench.model.fused import rotate
from pagedbench.model.loader import build_model, resolve_model_config
from pagedbench.model.preset_init import lag_of_head

# Prompts of 1-3 tokens reach the "nearest key" case of a head whose lag is longer.
PROMPTS = [{"prompt_token_ids": random.Random(i).sample(range(3, 30000), n)} for i, n in enumerate([1, 2, 3, 17, 40])]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def generate(backend="sdpa", dtype="bfloat16", patch=None, **kwargs):
    llm = LLM("tiny-llama", backend=backend, dtype=dtype, device="cpu", num_blocks=64, **kwargs)
    if patch is not None:
        patch(llm.engine.runner.backend)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("model", ["tiny-llama", pytest.param("qwen3-0.6b", marks=pytest.mark.slow)])
def test_every_head_attends_one_hot_to_its_lag(model):
    """Layer 0's softmax, in fp32: probability exactly 1.0 on the key `lag` tokens back (the
    first token while fewer precede), 0.0 on every other."""
    cfg, _ = resolve_model_config(model)
    cfg = dataclasses.replace(cfg, num_layers=1)  # layer 0 is initialized as in the whole model
    built = build_model(cfg, None, torch.device("cpu"), torch.float32, 64, seed=0)
    attn, norm = built.model.layers[0].self_attn, built.model.layers[0].input_layernorm
    tokens = torch.randint(3, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    x = norm(built.model.embed_tokens(tokens))
    q = attn.q_proj(x).view(20, cfg.num_heads, cfg.head_dim)
    k = attn.k_proj(x).view(20, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    rope = built.model.rotary_emb(torch.arange(20), torch.float32)
    q, k = rotate(q, *rope), rotate(k, *rope)
    k = k.repeat_interleave(cfg.num_heads // cfg.num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * cfg.head_dim**-0.5
    scores = scores.masked_fill(torch.ones(20, 20, dtype=torch.bool).triu(1), float("-inf"))
    probs = scores.softmax(-1)
    for h in range(cfg.num_heads):
        expected = (torch.arange(20) - lag_of_head(h)).clamp(min=0)
        assert torch.equal(probs[h].argmax(-1), expected)
        assert (probs[h].max(-1).values == 1.0).all()


def test_backends_agree_bit_for_bit_in_bf16():
    reference = generate("reference")
    assert generate("sdpa") == reference
    flat = [t for out in reference for t in out]
    assert len(set(flat)) > 0.9 * len(flat)  # not a model stuck on one token


@pytest.mark.slow
def test_flex_agrees_bit_for_bit_in_bf16():
    assert generate("flex") == generate("reference")


def test_a_backend_reading_a_neighbours_page_diverges():
    def neighbour_pages(backend):
        plan = backend.plan

        def shifted(meta):
            table = (meta.block_table + 1) % (meta.num_cache_blocks - 1)
            return plan(dataclasses.replace(meta, block_table=table))

        backend.plan = shifted

    assert identical_token_share(generate(patch=neighbour_pages), generate()) < 0.5


def test_plain_init_is_still_there():
    """`preset_init="plain"`: N(0, 0.02) everywhere (what `check --engine` uses: soft attention)."""
    cfg, _ = resolve_model_config("tiny-llama")
    plain = build_model(cfg, None, torch.device("cpu"), torch.float32, 64, seed=0, preset_init="plain")
    q = plain.model.layers[0].self_attn.q_proj.weight
    assert abs(q.std().item() - 0.02) < 1e-3 and q[:, 1:].abs().sum() > 0
    assert generate(dtype="float32", preset_init="plain") != generate(dtype="float32")


@pytest.mark.parametrize("model", ["gemma-2-2b", "deepseek-v3", "qwen3-30b-a3b"])
def test_decisive_weights_refuse_the_models_they_cannot_build(model):
    from pagedbench.model.preset_init import decisive_weights

    cfg = resolve_model_config(model)[0]
    with pytest.raises(ValueError, match="decisive weights: .* outside the decisive construction"):
        next(decisive_weights(cfg, [("model.norm.weight", (8,))], seed=0, max_len=64))
