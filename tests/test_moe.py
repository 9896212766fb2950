"""Mixture-of-experts models: tiny random Mixtral, Qwen3-MoE, gpt-oss (sinks, alternating windows)
and DeepSeek-V3 (latent attention with its MoE layers) give greedy tokens identical to Hugging
Face's in fp32 — each family's router,
the batched experts (one grouped matmul per projection), DeepSeek's grouped top-k, correction
bias, scaling factor and shared experts — under chunked prefill and preemption, and at
tensor-parallel size 2 (every expert's intermediate dimension sharded)."""

import random

import pytest
import torch

from pagedbench import LLM, SamplingParams
from pagedbench.model.config import ModelConfig
from pagedbench.model.moe import experts_kernel, route
from tests.conftest import VOCAB, build_hf_model, hf_greedy
from tests.test_mla import LATENT, YARN

MOE_MODELS = {
    "mixtral": (
        "MixtralConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            norm_topk_prob=False,
            mlp_only_layers=[1],  # a dense layer between two MoE ones
            decoder_sparse_step=1,
        ),
    ),
    # gpt-oss: sinks, a window (8 here, 128 in gpt-oss) on every other layer, q/k/v/o biases, YaRN,
    # a router with a bias and top-k before its softmax, fused experts with biases and a clamped SwiGLU.
    "gpt-oss": (
        "GptOssConfig",
        dict(
            intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=1.0,  # low enough to clamp with these weights (gpt-oss: 7.0)
        ),
    ),
    "deepseek-v3-moe": (
        "DeepseekV3Config",
        LATENT
        | dict(
            q_lora_rank=None,
            rope_interleave=True,
            rope_parameters={"rope_theta": 10000.0},
            num_hidden_layers=3,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
    ),
    # DeepSeek-V2: a softmax router, groups ranked by their best expert, never renormalized (even
    # with norm_topk_prob), rotary over (even, odd) pairs as complex numbers, YaRN with its mscale.
    "deepseek-v2-moe": (
        "DeepseekV2Config",
        LATENT
        | dict(
            q_lora_rank=24,
            rope_parameters=YARN,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=2,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
            routed_scaling_factor=1.5,
            norm_topk_prob=True,
        ),
    ),
}
PROMPT_LENS = [1, 7, 16, 17, 33, 58]
MAX_NEW = 10
PRESSURE = dict(block_size=8, num_blocks=11, max_model_len=80, max_num_batched_tokens=20)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    models = {}
    for name in MOE_MODELS:
        hf = build_hf_model(name, root / name, MOE_MODELS)
        if name == "deepseek-v3-moe":  # a correction bias that changes the choice (it starts at zero)
            with torch.no_grad():
                for layer in hf.model.layers[1:]:
                    layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.5)
            hf.save_pretrained(str(root / name))
        models[name] = (str(root / name), hf)
    return models


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]


def backend_cases():
    """sdpa on every model in the fast tier; reference, flex and triton in the slow one, each
    skipped with its reason where it cannot run the model's attention (triton: latent attention)."""
    from pagedbench.backends.registry import get_backend, probe

    cases = []
    for name in MOE_MODELS:
        latent = {"value_dim": 32, "head_dim": 40} if name.startswith("deepseek") else {}
        for backend in ("sdpa", "reference", "flex", "triton"):
            settings = {"head_dim": 16, "value_dim": None, "sinks": name == "gpt-oss"} | latent
            head_dim = settings.pop("head_dim")
            reason = probe(get_backend(backend), torch.device("cpu"), torch.float32, head_dim, 8, **settings)[1]
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            marks += [] if backend == "sdpa" else [pytest.mark.slow]
            cases.append(pytest.param(name, backend, id=f"{name}-{backend}", marks=marks))
    return cases


@pytest.mark.parametrize("model_name,backend", backend_cases())
def test_greedy_matches_hf_under_pressure(moe_models, prompts, model_name, backend):
    """Chunked prefill, preemption, prefix caching and, for gpt-oss, prompts past its window."""
    path, hf = moe_models[model_name]
    llm = LLM(path, backend=backend, device="cpu", dtype="float32", **PRESSURE)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    assert llm.engine.stats.preemptions > 0


def greedy_tokens(path: str, prompts: list[list[int]], **parallel) -> list[list[int]]:
    """The engine's greedy tokens (sdpa, fp32) for `prompts`, its worker processes stopped after."""
    llm = LLM(path, backend="sdpa", device="cpu", dtype="float32", num_blocks=64, **parallel)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow  # worker processes (the fast tier keeps one tensor-parallel run: test_tensor_parallel.py)
@pytest.mark.parametrize("model_name", ["mixtral", "gpt-oss", "deepseek-v3-moe", "deepseek-v2-moe"])
def test_tensor_parallel_shards_every_expert(moe_models, prompts, model_name):
    path, hf = moe_models[model_name]
    assert greedy_tokens(path, prompts[:4], tensor_parallel_size=2) == [hf_greedy(hf, p, MAX_NEW) for p in prompts[:4]]


@pytest.mark.parametrize(
    "parallel",
    [
        {},
        *(
            pytest.param(p, marks=pytest.mark.slow)
            for p in ({"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2})
        ),
    ],
)
def test_experts_in_transformers_stacked_layout_load(moe_models, prompts, tmp_path, parallel):
    """A checkpoint holding transformers' own stacked experts (gate_up_proj [E, 2I, in], down_proj
    [E, out, I]; what its GGUF reader yields) loads as the per-expert one does: into one process,
    into pipeline stages (each passing over the other's layers) and into tensor-parallel shards."""
    import shutil

    from safetensors.torch import save_file

    source, hf = moe_models["qwen3-moe"]
    stacked = tmp_path / "stacked"
    shutil.copytree(source, stacked, ignore=shutil.ignore_patterns("*.safetensors"))
    state = {name: t.contiguous() for name, t in hf.state_dict().items()}
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    save_file(state, str(stacked / "model.safetensors"))
    assert greedy_tokens(str(stacked), prompts[:3], **parallel) == [hf_greedy(hf, p, MAX_NEW) for p in prompts[:3]]


def test_layers_and_routers_as_each_family_says(moe_models):
    """Which layers are MoE (Qwen3's mlp_only_layers, DeepSeek's first_k_dense_replace) and the
    routers' rules on hand-made logits."""
    from pathlib import Path

    qwen = ModelConfig.from_dir(Path(moe_models["qwen3-moe"][0])).moe
    assert qwen.layers == (True, False, True) and not qwen.norm_topk_prob
    deepseek = ModelConfig.from_dir(Path(moe_models["deepseek-v3-moe"][0])).moe
    assert deepseek.layers == (False, True, True) and deepseek.num_shared_experts == 1
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    mixtral = ModelConfig.from_dir(Path(moe_models["mixtral"][0])).moe
    weights, experts = route(mixtral, logits, None)
    assert experts.tolist() == [[1, 3]] and weights.sum().item() == pytest.approx(1.0)  # renormalized
    weights, _ = route(qwen, torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0, -2.0]]), None)
    assert weights.sum().item() < 1.0  # not renormalized
    # DeepSeek: 8 experts in 4 groups of 2, the best 2 groups by their top-2 sums, then top-2 within them;
    # the bias steers the choice but the weights come from the unbiased scores.
    logits = torch.tensor([[4.0, -4.0, 3.0, 3.0, -1.0, 5.0, 0.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0])
    weights, experts = route(deepseek, logits, bias)
    assert sorted(experts[0].tolist()) == [2, 7]  # groups 1 (2, 3) and 3 (6, 7 biased) win; 5 is in a losing group
    scores = logits.sigmoid()[0]
    expected = scores[[2, 7]] / scores[[2, 7]].sum() * 2.5
    assert sorted(weights[0].tolist()) == pytest.approx(sorted(expected.tolist()))
    # DeepSeek-V2: groups ranked by their best softmax score (groups 0: 4.0 and 2: 5.0 win over group
    # 1's 3 + 3), top-2 within them, times the scaling factor, not renormalized.
    v2 = ModelConfig.from_dir(Path(moe_models["deepseek-v2-moe"][0])).moe
    assert (v2.layers, v2.num_shared_experts, v2.norm_topk_prob) == ((False, True, True), 2, False)
    weights, experts = route(v2, logits, None)
    assert sorted(experts[0].tolist()) == [0, 5]
    expected = logits.softmax(dim=-1)[0, [0, 5]] * 1.5
    assert sorted(weights[0].tolist()) == pytest.approx(sorted(expected.tolist()))


def test_grouped_matmul_equals_one_matmul_per_expert(monkeypatch):
    """The grouped path (torch._grouped_mm) and the per-expert fallback, for a torch without it,
    give the same rows, empty experts included."""
    from pagedbench.model import moe

    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(10, 16, generator=gen), torch.randn(4, 8, 16, generator=gen)
    offsets = torch.tensor([3, 5, 5, 10], dtype=torch.int32)
    expected = torch.cat([x[0:3] @ weight[0].T, x[3:5] @ weight[1].T, x[5:10] @ weight[3].T])
    torch.testing.assert_close(moe.grouped_linear(x, weight.transpose(1, 2), offsets), expected)
    monkeypatch.setattr(moe, "grouped_mm_runs", lambda *_: False)
    torch.testing.assert_close(moe.grouped_linear(x, weight.transpose(1, 2), offsets), expected)


def test_reports_record_experts_and_the_moe_share(moe_models, tmp_path):
    """run's row says how many experts each MoE layer has, how many a token uses, and the MoE
    layers' share of the forward beside attention's; the markdown shows both."""
    import pandas as pd

    from pagedbench.entrypoints.cli.main import main

    path, _ = moe_models["qwen3-moe"]
    args = ["run", "--model", path, "--scenario", "mixed", "--scale", "0.02", "--no-warmup", "--device", "cpu"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    row = pd.read_csv(tmp_path / "run-mixed.csv").iloc[0]
    assert (row["num_experts"], row["experts_per_token"]) == (6, 2)
    assert row["moe_kernel"] == experts_kernel("cpu", torch.float32)  # the grouped matmul, where torch has one
    assert 0 < row["moe_share"] < 1 and 0 < row["attention_share"] < 1 and row["time_moe_s"] > 0
    markdown = (tmp_path / "run-mixed.md").read_text()
    assert "MoE % of forward" in markdown and f"6 top 2 ({row['moe_kernel']})" in markdown


@pytest.mark.parametrize("backend", ["sdpa", pytest.param("triton", marks=pytest.mark.slow)])
def test_gpt_oss_reads_a_shared_prefix_past_its_window(moe_models, backend):
    """A second request sharing a 32-token prefix reads the first one's pages (cached, not
    recomputed) through gpt-oss's windowed and full layers, with their sinks."""
    path, hf = moe_models["gpt-oss"]
    prefix = list(range(5, 37))
    prompts = [prefix + [40, 41, 42], prefix + [50, 51]]
    llm = LLM(path, backend=backend, device="cpu", dtype="float32", block_size=8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0]
    second = llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)[0]
    assert second.num_cached_tokens == 32
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == [hf_greedy(hf, p, 8) for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["deepseek-v3-moe"])
def test_compiled_model_matches_hf(moe_models, prompts, model_name):
    """compile=True: the router's scores and top-k (DeepSeek's grouped sigmoid with its bias) compiled."""
    path, hf = moe_models[model_name]
    llm = LLM(path, backend="sdpa", device="cpu", dtype="float32", compile=True, **PRESSURE)
    assert llm.engine.executor.compiled
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
