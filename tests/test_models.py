"""Model loading: both config.json forms, sharded checkpoints, presets, unsupported models."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagedbench import LLM, SamplingParams
from pagedbench.model.config import ModelConfig
from pagedbench.model.layers import rope_inv_freq
from pagedbench.model.presets import PRESETS
from tests.conftest import build_hf_model, hf_greedy, write_legacy_config

PROMPT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]


def greedy(path, n=8):
    llm = LLM(str(path), dtype="float32", device="cpu")
    return (
        llm.generate(
            [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_legacy_config_form_loads_the_same(tiny_models, tmp_path, name):
    src, hf = tiny_models[name]
    dst = tmp_path / name
    shutil.copytree(src, dst)
    write_legacy_config(Path(src), dst)
    assert "rope_parameters" not in json.loads((dst / "config.json").read_text())
    assert ModelConfig.from_dir(dst) == ModelConfig.from_dir(Path(src))
    assert greedy(dst) == hf_greedy(hf, PROMPT, 8)


def test_sharded_checkpoint(tiny_models, tmp_path):
    _, hf = tiny_models["qwen2"]
    hf.save_pretrained(str(tmp_path), max_shard_size="20KB")
    shutil.copy(f"{tiny_models['qwen2'][0]}/tokenizer.json", tmp_path)
    shutil.copy(f"{tiny_models['qwen2'][0]}/tokenizer_config.json", tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert greedy(tmp_path) == hf_greedy(hf, PROMPT, 8)


def test_llama3_rope_matches_transformers(tiny_models):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = tiny_models["llama"][1]
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    cfg = ModelConfig.from_dir(Path(tiny_models["llama"][0]))
    torch.testing.assert_close(rope_inv_freq(cfg), expected)


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    with pytest.raises(
        ValueError, match="unsupported architecture.*GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"
    ):
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="unsupported rope type 'longrope'"):
        ModelConfig.from_dict({**PRESETS["tiny-llama"], "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_parse_as_transformers_reads_them(name):
    """Each preset's shape as the engine reads it equals what transformers' own config class for
    that model reads from the same fields (layers, widths, heads, head dim, vocabulary, experts)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    fields = dict(PRESETS[name])
    arch = fields.pop("architectures")[0]
    model_type = fields.pop("model_type", None) or {v: k for k, v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}[arch]
    hf = AutoConfig.for_model(model_type, **fields)
    cfg = ModelConfig.from_dict(PRESETS[name])
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.vocab_size, cfg.intermediate_size) == (
        hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.vocab_size, hf.intermediate_size,
    )  # fmt: skip
    if cfg.mla is None:  # latent attention caches one latent "head" of kv_lora_rank + rope dims instead
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        assert (cfg.num_kv_heads, cfg.head_dim) == (hf.num_key_value_heads, head_dim)
    else:
        assert cfg.head_dim == hf.kv_lora_rank + hf.qk_rope_head_dim
    if cfg.moe is not None:
        experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None) or hf.n_routed_experts
        assert (cfg.moe.num_experts, cfg.moe.top_k) == (experts, hf.num_experts_per_tok)
    if cfg.linear is not None:
        assert cfg.linear.layers == tuple(t == "linear_attention" for t in hf.layer_types)
    if cfg.indexer is not None:  # DeepSeek-V3.2's indexer
        ix = cfg.indexer
        assert (ix.n_heads, ix.head_dim, ix.topk) == (hf.index_n_heads, hf.index_head_dim, hf.index_topk)


def test_tiny_preset_generates_from_token_ids():
    llm = LLM("tiny-llama", max_model_len=128)
    out = llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids)  # the byte-level tokenizer


def test_sparse_gemma_config_gets_transformers_defaults():
    """A Gemma 2 config.json that leaves fields to the class defaults computes what transformers
    computes: tied embeddings, soft-caps 50/30, head_dim and query_pre_attn_scalar 256, GELU."""
    from transformers import AutoConfig

    sparse = {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    cfg = ModelConfig.from_dict(sparse)
    hf = AutoConfig.for_model(**{k: v for k, v in sparse.items() if k != "architectures"})
    assert cfg.tie_word_embeddings is hf.tie_word_embeddings is True
    assert (cfg.attn_softcap, cfg.final_softcap) == (hf.attn_logit_softcapping, hf.final_logit_softcapping) == (50, 30)
    assert cfg.head_dim == hf.head_dim == 256 and cfg.attention_scale == 256**-0.5
    assert cfg.hidden_act == hf.hidden_activation == "gelu_pytorch_tanh"


def test_yarn_rope_matches_hugging_face(tmp_path):
    """YaRN (Qwen's long-context RoPE, DeepSeek's) from transformers' own formula: its frequencies
    and the cos/sin factor give greedy tokens equal to Hugging Face's."""
    spec = {
        "qwen2-yarn": (
            "Qwen2Config",
            dict(
                num_attention_heads=4,
                num_key_value_heads=2,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 8.0,
                    "original_max_position_embeddings": 64,
                },
            ),
        )
    }
    hf = build_hf_model("qwen2-yarn", tmp_path / "m", spec)
    prompt = list(range(5, 90))  # past original_max_position_embeddings
    llm = LLM(str(tmp_path / "m"), device="cpu", dtype="float32")
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 10)
