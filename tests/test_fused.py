"""The fused model: a compiled decode step's operation count, merged projections that hold Hugging
Face's separate weights (whole and per tensor-parallel shard), and the compile setting's meaning."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagedbench import LLM
from pagedbench.bench.step_profile import profile_decode
from pagedbench.config import EngineConfig
from pagedbench.model.fused import EAGER, add_rms_norm, compiled_ops, qkv_rope, rms_norm
from pagedbench.model.loader import build_model, resolve_model_config
from pagedbench.model.parallel import TPShard
from tests.conftest import TINY_MODELS, build_hf_model

OPS_PER_LAYER_LIMIT = 12  # the goal, outside the attention backend's own calls


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-llama", "qwen3"])
def test_a_compiled_decode_step_dispatches_at_most_12_ops_per_layer(tmp_path, model):
    """Counted as the profiler sees a CPU step: top-level ATen ops that compute plus every C++ kernel
    inductor emits, over the model's layers (the step's embedding, RoPE gather, final norm and LM
    head included, as the issue counts them); the eager model's count shows what fusion removed.
    tiny-llama has 4 layers; the Qwen3 (q/k norms) has 6, a fifth of qwen3-0.6b's 28."""
    path = model
    if model == "qwen3":
        cls, kwargs = TINY_MODELS["qwen3"]
        build_hf_model("qwen3", tmp_path, {"qwen3": (cls, kwargs | {"num_hidden_layers": 6})})
        path = str(tmp_path)
    counts = {}
    for compile in (False, True):
        llm = LLM(path, backend="sdpa", num_blocks=256, max_model_len=128, compile=compile)
        profile = profile_decode(llm.engine, batch=8, context=24, steps=2)
        counts[compile] = profile.outside_attention_per_layer
        assert profile.attention > 0 and profile.unit == "ops"
    assert counts[True] <= OPS_PER_LAYER_LIMIT, counts
    assert counts[False] >= 2.5 * counts[True], counts


def test_merged_projections_hold_hugging_faces_weights(tiny_models):
    """One q/k/v and one gate/up weight per layer whose rows are the checkpoint's separate ones, and
    the separate parameters are views of them (no second copy)."""
    path, _ = tiny_models["qwen2"]  # q/k/v biases too
    hf = load_file(f"{path}/model.safetensors")
    cfg, _ = resolve_model_config(path)
    model = build_model(cfg, Path(path), torch.device("cpu"), torch.float32, 64, 0)
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        qkv = torch.cat([hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(attn.qkv_weight, qkv)
        assert torch.equal(attn.qkv_bias, torch.cat([hf[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]))
        assert torch.equal(
            mlp.gate_up_weight, torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        )
        assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
        assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_up_weight.untyped_storage().data_ptr()


def test_merged_projections_per_tensor_parallel_shard(tiny_models):
    """At TP 2 each rank's merged weight is its heads' q, k, v rows (and its half of gate/up)."""
    path, _ = tiny_models["llama"]  # 4 query heads, 2 KV heads of 16
    hf = load_file(f"{path}/model.safetensors")
    cfg, _ = resolve_model_config(path)
    d = cfg.head_dim
    for rank in (0, 1):
        model = build_model(cfg, Path(path), torch.device("cpu"), torch.float32, 64, 0, TPShard(rank, 2))
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        q = hf["model.layers.0.self_attn.q_proj.weight"][rank * 2 * d : (rank + 1) * 2 * d]
        k = hf["model.layers.0.self_attn.k_proj.weight"][rank * d : (rank + 1) * d]
        v = hf["model.layers.0.self_attn.v_proj.weight"][rank * d : (rank + 1) * d]
        assert torch.equal(attn.qkv_weight, torch.cat([q, k, v]))
        n = cfg.intermediate_size // 2
        gate = hf["model.layers.0.mlp.gate_proj.weight"][rank * n : (rank + 1) * n]
        up = hf["model.layers.0.mlp.up_proj.weight"][rank * n : (rank + 1) * n]
        assert torch.equal(mlp.gate_up_weight, torch.cat([gate, up]))


def test_the_fused_functions_are_hugging_faces_arithmetic():
    """Eager fused functions reproduce transformers' RMSNorm and rotate_half RoPE bit for bit."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    torch.manual_seed(0)
    x, residual = torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(5, 64, dtype=torch.bfloat16)
    norm = LlamaRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    norm.weight.data.normal_()
    assert torch.equal(rms_norm(x, norm.weight, 1e-6, False), norm(x))
    normed, summed = add_rms_norm(x, residual, norm.weight, 1e-6, False)
    assert torch.equal(summed, x + residual) and torch.equal(normed, norm(x + residual))
    q, k, v = torch.randn(5, 4 * 8), torch.randn(5, 2 * 8), torch.randn(5, 2 * 8)
    cos, sin = torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    rq, rk, rv = qkv_rope(q, k, v, cos, sin, (4, 2, 8), None, None, 1e-6, False)
    hq, hk = apply_rotary_pos_emb(q.view(5, 4, 8), k.view(5, 2, 8), cos[:, 0], sin[:, 0], unsqueeze_dim=1)
    assert torch.equal(rq, hq) and torch.equal(rk, hk) and torch.equal(rv, v.view(5, 2, 8))


def test_compile_setting_follows_the_device_and_enforce_eager():
    assert EngineConfig(model="m").compiles("cuda") and not EngineConfig(model="m").compiles("cpu")
    assert EngineConfig(model="m", compile=True).compiles("cpu")
    assert not EngineConfig(model="m", compile=True, enforce_eager=True).compiles("cuda")
    assert not EngineConfig(model="m", compile=False).compiles("cuda")
    with pytest.raises(TypeError, match="compile must be bool"):
        EngineConfig(model="m", compile="yes").validate()


def test_an_eager_model_calls_no_compiled_function():
    cfg, _ = resolve_model_config("tiny-llama")
    model = build_model(cfg, None, torch.device("cpu"), torch.float32, 64, 0)
    assert all(getattr(m, "ops", EAGER) is EAGER for m in model.modules())
    compiled = build_model(cfg, None, torch.device("cpu"), torch.float32, 64, 0, compile=True)
    assert compiled.model.layers[0].input_layernorm.ops is compiled_ops()
