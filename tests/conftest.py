"""Tiny random-weight Hugging Face models (saved with save_pretrained) and a trained tokenizer,
built once per test session; Hugging Face's own greedy outputs as the reference."""

import json
import os
import shutil
import sys

import pytest
import torch

from pagedbench import envs
from pagedbench.device.cpu_threads import usable_cores

# Engines built by the hundred, most never shut down: the startup heap stays in the collector (the
# shipped default freezes it per engine; tests/test_host_profile.py checks that path).
os.environ.setdefault("PAGEDBENCH_GC_FREEZE", "0")


def pytest_configure(config):
    """Each xdist worker gets cores / workers torch threads, its subprocesses (CLI, server) too
    through OMP_NUM_THREADS: n workers of all-cores threads each oversubscribe the machine, and a
    descheduled OpenMP thread stalls every parallel region of its worker."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        threads = max(1, len(usable_cores()) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def pytest_runtest_logreport(report):
    """A failure's report printed as it happens (controller side under xdist), not only in the
    summary at the end: a run cut at its time limit (the GPU suite's) still names why each failed."""
    if report.failed and envs.enabled("PAGEDBENCH_EARLY_FAILURES") and not os.environ.get("PYTEST_XDIST_WORKER"):
        print(f"\n=== FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n", flush=True)


CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "paged attention stores keys and values in fixed size blocks",
    "a scheduler batches requests continuously and preempts when memory runs out",
    "flex attention builds a block mask from the page table",
    "hello world, this is a tiny tokenizer trained for tests",
] * 20

# name -> (config class name, config kwargs); initializer_range 0.2 keeps logits far from ties.
TINY_MODELS = {
    "llama": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,  # GQA
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,  # MQA, explicit head_dim != hidden/heads
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,  # MHA with q/k/v bias
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
}
VOCAB = 320
# Models whose attention is not plain causal: a sliding window (16, far shorter than prompt +
# output), Gemma 2's soft-caps and alternating layers, Gemma 3's q/k norms, 5:1 local/global
# pattern (here 2:1) and per-layer-type RoPE bases.
WINDOW = 16
VARIANT_MODELS = {
    "mistral": (
        "MistralConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW),
    ),
    "gemma2": (
        "Gemma2Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            attn_logit_softcapping=5.0,  # low enough to bite with these weights (Gemma 2's is 50)
            final_logit_softcapping=3.0,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
}

# Hybrid models: three gated DeltaNet layers before each gated full-attention layer (Qwen3.5's 3:1),
# grouped value heads (4 over 2 key heads), partial rotary (a quarter of each head).
HYBRID_SHAPE = dict(
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
)
HYBRID_MODELS = {
    "qwen3.5": ("Qwen3_5TextConfig", HYBRID_SHAPE),
    # Qwen3-Next: q/k/v/z and b/a projected per key head, and MoE layers (a gated shared expert
    # beside 4 routed ones, top 2) except layer 1's dense MLP
    "qwen3-next": (
        "Qwen3NextConfig",
        HYBRID_SHAPE
        | dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        ),
    ),
}


def train_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<bos>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    fast.save_pretrained(str(path))
    return fast


def build_hf_model(name, path, specs=TINY_MODELS):
    import transformers

    cls_name, extra = specs[name]
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config = getattr(transformers, cls_name)(**(base | extra))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(str(path))
    train_tokenizer(path)
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """name -> (model directory, HF model in fp32)."""
    root = tmp_path_factory.mktemp("models")
    return {name: (str(root / name), build_hf_model(name, root / name)) for name in TINY_MODELS}


@pytest.fixture(scope="session")
def variant_models(tmp_path_factory):
    """name -> (model directory, HF model in fp32) of VARIANT_MODELS."""
    root = tmp_path_factory.mktemp("variant-models")
    return {name: (str(root / name), build_hf_model(name, root / name, VARIANT_MODELS)) for name in VARIANT_MODELS}


@pytest.fixture
def no_fla(monkeypatch):
    """fla as if not installed (its import fails), the availability cache cleared around it."""
    from pagedbench.model import delta_rule

    delta_rule.fla_unavailable_reason.cache_clear()
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fla", None)  # `import fla` raises ModuleNotFoundError
    yield
    delta_rule.fla_unavailable_reason.cache_clear()


@pytest.fixture(scope="session")
def hybrid_models(tmp_path_factory):
    """name -> (model directory, HF model in fp32) of HYBRID_MODELS, on transformers' torch recurrences
    (with fla installed, transformers would call its GPU kernels)."""
    from pagedbench.model.delta_rule import pin_transformers_torch_delta_rule

    pin_transformers_torch_delta_rule()
    root = tmp_path_factory.mktemp("hybrid-models")
    return {name: (str(root / name), build_hf_model(name, root / name, HYBRID_MODELS)) for name in HYBRID_MODELS}


CHAT_TEMPLATE = "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="session")
def chat_model(tiny_models, tmp_path_factory):
    """The tiny llama with a chat template in its tokenizer config."""
    path = tmp_path_factory.mktemp("chat") / "llama"
    shutil.copytree(tiny_models["llama"][0], path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": CHAT_TEMPLATE}))
    return path


@pytest.fixture(scope="session")
def tokenizerless_model(tiny_models, tmp_path_factory):
    """The tiny llama's directory without its tokenizer files (weights and config only)."""
    path = tmp_path_factory.mktemp("bare") / "llama"
    shutil.copytree(tiny_models["llama"][0], path, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    return str(path)


def hf_greedy(model, prompt_ids, max_new_tokens):
    out = model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt_ids) :].tolist()


def write_legacy_config(src, dst):
    """Rewrite a transformers-5 config.json into the older top-level rope_theta/rope_scaling form."""
    cfg = json.loads((src / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    (dst / "config.json").write_text(json.dumps(cfg))
