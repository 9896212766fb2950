"""Model config (read from a Hugging Face config.json in either of its two forms) and engine config."""

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

# architecture name in config.json -> (q/k/v bias, per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only silu is supported")
        if cfg.get("mlp_bias"):
            raise ValueError("unsupported mlp_bias=true")
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        # transformers 5 nests rope settings under rope_parameters; older checkpoints use
        # top-level rope_theta and rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        legacy = cfg.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type") or rope.get("type") or legacy.get("rope_type") or legacy.get("type")
        scaling = None
        if rope_type not in (None, "default"):
            scaling = {**legacy, **rope, "rope_type": rope_type}
            scaling.pop("rope_theta", None)
            scaling.pop("type", None)
            if rope_type not in ("llama3", "linear"):
                raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, linear, llama3")
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias or bool(cfg.get("attention_bias", False)),
            qk_norm=qk_norm,
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            sliding_window=sliding,
        )

    @classmethod
    def from_dir(cls, path: Path) -> "ModelConfig":
        try:
            raw = json.loads((path / "config.json").read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path / 'config.json'} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path / 'config.json'} is not a JSON object")
        try:
            cfg = cls.from_dict(raw)
        except KeyError as e:
            raise ValueError(
                f"{path / 'config.json'} has no {e.args[0]!r}, which a "
                f"{(raw.get('architectures') or ['model'])[0]} needs"
            ) from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path / 'config.json'}: {e}") from None
        gen = path / "generation_config.json"
        if gen.exists():  # generation_config's eos list wins, as in transformers
            eos = json.loads(gen.read_text()).get("eos_token_id")
            if eos is not None:
                cfg.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
        return cfg


def setting(default, help: str, choices: tuple = (), minimum: float | None = None, maximum: float | None = None):
    """An EngineConfig field with what the CLI and validation need to know about it."""
    return field(default=default, metadata={"help": help, "choices": choices, "minimum": minimum, "maximum": maximum})


@dataclass(slots=True)
class EngineConfig:
    """Every engine setting, once: its type, default, help, allowed values and minimum drive
    LLM(**kwargs), the CLI flags (`add_cli_args`) and `validate()`."""

    model: str = setting(None, "HF model directory or preset")
    tokenizer: str | None = setting(None, "tokenizer directory (default: the model directory's)")
    load_format: str = setting(
        "auto",
        "auto (the directory's safetensors), or dummy: random weights in the model's shapes, as in vLLM",
        ("auto", "safetensors", "dummy"),
    )
    backend: str = setting("sdpa", "attention backend (see `pagedbench backends`)")
    device: str | None = setting(None, "cuda if available, else cpu")
    dtype: str | None = setting(None, "bf16 on cuda, fp32 on cpu")
    block_size: int = setting(16, "tokens per KV page", minimum=1)
    num_blocks: int | None = setting(None, "KV pages (default: from free memory)", minimum=1)
    max_num_seqs: int = setting(256, "sequences running at once", minimum=1)
    max_num_batched_tokens: int = setting(2048, "tokens per engine step", minimum=1)
    max_model_len: int | None = setting(None, "longest sequence (default: the model's, capped by the cache)", minimum=1)
    seed: int | None = setting(
        0, "seed of the sampler and of random weights (None: a fresh one)", minimum=0, maximum=2**63 - 1
    )
    preset_init: str = setting(
        "decisive",
        "a preset's random weights: decisive (one-hot attention heads, so every correct backend's greedy tokens "
        "are identical) or plain (N(0, 0.02) everywhere)",
        ("decisive", "plain"),
    )
    tensor_parallel_size: int = setting(
        1, "ranks the model is sharded over (worker processes; GPUs on cuda)", minimum=1
    )
    enable_prefix_caching: bool = setting(True, "share the KV pages of common prompt prefixes (vLLM v1's default)")
    scheduling_policy: str = setting("fcfs", "fcfs, or priority: lowest value first", ("fcfs", "priority"))
    preemption_mode: str = setting("recompute", "what preemption does with K/V", ("recompute", "swap"))
    swap_space: float = setting(4.0, "GiB of CPU memory for swapped-out pages", minimum=0)
    gpu_memory_utilization: float = setting(
        0.9,
        "share of the GPU's memory this engine may use: weights, activations (profiled), CUDA graphs and "
        "the KV cache, which gets the rest",
        minimum=0,
        maximum=1,
    )
    max_logprobs: int = setting(20, "most logprobs / prompt_logprobs a request may ask for", minimum=0)
    enforce_eager: bool = setting(False, "never capture CUDA graphs: every step runs eagerly")
    cpu_kv_cache_bytes: int = setting(1 << 30, "KV cache bytes on CPU when num_blocks is None", minimum=1)

    def validate(self) -> None:
        """TypeError or ValueError naming the field."""
        for f in fields(self):
            value, kinds = getattr(self, f.name), _kinds(f.type)
            if value is None and type(None) in kinds:
                continue
            if f.name in ("device", "dtype") and type(value).__name__ == f.name:
                continue  # a torch.device / torch.dtype is fine too
            ok = any(isinstance(value, k) and not (k is int and isinstance(value, bool)) for k in kinds)
            ok = ok or (float in kinds and isinstance(value, int) and not isinstance(value, bool))
            if not ok:
                raise TypeError(f"{f.name} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
            choices, minimum = f.metadata.get("choices"), f.metadata.get("minimum")
            if choices and value not in choices:
                raise ValueError(f"{f.name} must be {' or '.join(map(repr, choices))}, got {value!r}")
            if minimum is not None and not value >= minimum:
                raise ValueError(f"{f.name} must be >= {minimum}, got {value}")
            maximum = f.metadata.get("maximum")
            if maximum is not None and not value <= maximum:
                raise ValueError(f"{f.name} must be <= {maximum}, got {value}")

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def add_cli_args(cls, parser, skip: tuple[str, ...] = ("model",)) -> None:
        """One --flag per field (booleans as --x/--no-x), typed, with its help and choices."""
        import argparse

        for f in fields(cls):
            if f.name in skip:
                continue
            flag, kind = "--" + f.name.replace("_", "-"), next(k for k in _kinds(f.type) if k is not type(None))
            extra = {"choices": f.metadata["choices"]} if f.metadata.get("choices") else {}
            if kind is bool:
                parser.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"]
                )
            else:
                parser.add_argument(flag, type=kind, default=f.default, help=f.metadata["help"], **extra)

    @classmethod
    def from_cli_args(cls, args, **overrides) -> "EngineConfig":
        return cls(**{name: getattr(args, name) for name in cls.names() if hasattr(args, name)} | overrides)


def _kinds(annotation) -> tuple:
    """`int | None` -> (int, NoneType); `str` -> (str,). Annotations are strings here at times."""
    if isinstance(annotation, str):
        names = [a.strip() for a in annotation.split("|")]
        table = {"int": int, "float": float, "str": str, "bool": bool, "None": type(None)}
        return tuple(table[n] for n in names)
    return tuple(getattr(annotation, "__args__", (annotation,)))
