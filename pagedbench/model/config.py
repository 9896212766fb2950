"""ModelConfig: what the engine needs of a Hugging Face config.json (either of its two forms)."""

import json
from dataclasses import dataclass, field
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
