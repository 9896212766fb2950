"""ModelConfig: what the engine needs of a Hugging Face config.json (either of its two forms).

The per-layer attention settings (layer types, windows, soft-caps, RoPE bases) are read through
transformers' own config class for the model type, so the defaults a checkpoint leaves out are
the library's (Gemma 2's alternating windows, Gemma 3's 5-local-1-global pattern)."""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from pagedbench.backends.base import AttentionVariant

# architecture name in config.json -> (q/k/v bias, per-head q/k RMSNorm, Gemma style)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": (False, False, False),
    "MistralForCausalLM": (False, False, False),
    "Qwen2ForCausalLM": (True, False, False),
    "Qwen3ForCausalLM": (False, True, False),
    "Gemma2ForCausalLM": (False, False, True),
    "Gemma3ForCausalLM": (False, True, True),
    "DeepseekV2ForCausalLM": (False, False, False),  # latent attention (LatentAttention)
    "DeepseekV3ForCausalLM": (False, False, False),
    "DeepseekV32ForCausalLM": (False, False, False),  # V3 with a lightning indexer: sparse attention (SparseIndexer)
    "MixtralForCausalLM": (False, False, False),  # MoE layers (MoEConfig)
    "Qwen3MoeForCausalLM": (False, True, False),
    "GptOssForCausalLM": (True, False, False),  # sinks, alternating windows, MoE with a clamped SwiGLU
    "Qwen3_5ForCausalLM": (False, True, False),  # hybrid: gated DeltaNet layers beside gated attention (hybrid.py)
    "Qwen3NextForCausalLM": (False, True, False),  # hybrid, with MoE layers (a gated shared expert)
}
# (1 + weight) norms, gated attention, linear-attention layers
HYBRID_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3NextForCausalLM")
LINEAR = "linear_attention"
LATENT_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SLIDING = "sliding_attention"


@dataclass(frozen=True, slots=True)
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2 and V3): each token caches, per layer, one latent shared by
    every head, the normalized kv_lora_rank compression and the rotated qk_rope_head_dim key part
    (kv_lora_rank + qk_rope_head_dim numbers, one "KV head"). Keys and values are up-projected from
    it per head (kv_b_proj), or, absorbed, the key up-projection is folded into the query and the
    values are the latent's first kv_lora_rank dims, up-projected after attention."""

    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the checkpoint's rotary dims come in (even, odd) pairs

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class SparseIndexer:
    """DeepSeek-V3.2's lightning indexer (DSA): each layer scores every cached token for each query with
    n_heads small heads of head_dim (ReLU'd dot products, weighted per head and summed) and attention
    reads only the `topk` best of the query's causal past. Each token caches one index key of head_dim
    per layer beside its latent; RoPE (half-split) rotates the first rope_dim of the index dims."""

    n_heads: int
    head_dim: int
    topk: int
    rope_dim: int


@dataclass(frozen=True, slots=True)
class LinearAttention:
    """Gated DeltaNet layers (Qwen3.5, Qwen3-Next): per token a causal depthwise conv over q/k/v
    (a window of conv_kernel), then the gated delta rule over a recurrent state [value heads,
    key dim, value dim] per sequence; `layers[i]` says which layers are linear (the others are
    gated full attention)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    layers: tuple[bool, ...]
    # "split": Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a; "grouped": Qwen3-Next's
    # in_proj_qkvz and in_proj_ba, laid out per key head ([q, k, v's, z's] and [b's, a's] of its value heads)
    projection: str = "split"

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """Mixture-of-experts layers: which layers have them, the router and the experts. Mixtral and
    Qwen3-MoE score with a softmax over the experts (renormalizing the top k where norm_topk_prob);
    DeepSeek-V3 with a sigmoid plus a correction bias, top-k within the best topk_group of n_group
    groups, times routed_scaling_factor, and shared experts beside the routed ones; DeepSeek-V2
    with a softmax, top-k within the topk_group groups of the best single scores (its
    "group_limited_greedy"; one group for "greedy"), times routed_scaling_factor, never
    renormalized ("grouped_softmax"), and shared experts; gpt-oss takes the top k of its router's
    biased logits and a softmax over those ("topk_softmax")."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    layers: tuple[bool, ...]  # per layer: an MoE layer (else the dense MLP of the model's intermediate_size)
    scoring: str = "softmax"  # or "sigmoid" (DeepSeek-V3), "grouped_softmax" (DeepSeek-V2), "topk_softmax"
    norm_topk_prob: bool = True
    num_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    block_name: str = "mlp"  # the layer's MoE module (Mixtral: block_sparse_moe)
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # Mixtral: w1, w3, w2
    router_name: str = "gate"  # gpt-oss: router, with a bias
    router_bias: bool = False
    # gpt-oss: experts stored fused as [E, in, out] with biases, gate and up interleaved in
    # gate_up_proj, and a SwiGLU clamped at swiglu_limit: (up + 1) * gate * sigmoid(alpha * gate).
    fused_experts: bool = False
    # Qwen3-Next: one shared expert MLP of this size (0: none) scaled per token by sigmoid(shared_expert_gate(x))
    gated_shared_expert_size: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float | None = None


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
    hidden_act: str = "silu"
    # Gemma: RMSNorm scales by (1 + weight), norms before and after attention and MLP, embeddings
    # scaled by sqrt(hidden_size).
    gemma: bool = False
    layer_types: list[str] | None = None  # per layer "sliding_attention" | "full_attention"; None: all alike
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None  # the softmax scale is its -1/2 power (head_dim's otherwise)
    local_rope_theta: float | None = None  # RoPE base of sliding-window layers, where it differs (Gemma 3)
    # Latent attention: the cache holds one "KV head" of head_dim = latent_dim numbers per token.
    mla: LatentAttention | None = None
    moe: MoEConfig | None = None
    o_proj_bias: bool = False  # attention_bias also on o_proj (Llama-style; Qwen2 biases q/k/v only)
    attention_sinks: bool = False  # a learned sink logit per query head (gpt-oss)
    linear: LinearAttention | None = None  # hybrid models: which layers are gated DeltaNet, and their dims
    attn_output_gate: bool = False  # q_proj also yields a sigmoid gate on the attention output (Qwen3.5)
    partial_rotary_factor: float = 1.0  # RoPE rotates this share of each head's dims (the first ones)
    indexer: SparseIndexer | None = None  # DeepSeek-V3.2: top-k sparse attention chosen by an indexer

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.layers[layer]

    def is_linear_layer(self, layer: int) -> bool:
        return self.linear is not None and self.linear.layers[layer]

    @property
    def num_kv_layers(self) -> int:
        """Layers that cache K/V in pages: every one but a hybrid model's DeltaNet layers."""
        return self.num_layers - (sum(self.linear.layers) if self.linear is not None else 0)

    @property
    def norm_offset(self) -> bool:
        """RMSNorms scale by (1 + weight): Gemma's and the Qwen3.5 hybrids'."""
        return self.gemma or self.architecture in HYBRID_ARCHITECTURES

    @property
    def attention_scale(self) -> float:
        if self.mla is not None:  # YaRN's mscale(factor, mscale_all_dim) squared, as transformers applies it
            scale = self.mla.qk_head_dim**-0.5
            scaling = self.rope_scaling or {}
            if scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim"):
                mscale = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
                scale *= mscale * mscale
            return scale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        """The dims RoPE rotates: every head dim (or the partial share), or latent attention's qk_rope_head_dim."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_planes(self) -> int:
        """Paged planes per layer: K and V, or latent attention's one latent (its values are a view)."""
        return 2 if self.mla is None else 1

    def is_sliding(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == SLIDING

    @property
    def window_of_every_layer(self) -> int | None:
        """The sliding window when every layer has it (its pages can then be released), else None."""
        if self.sliding_window is None or not all(self.is_sliding(i) for i in range(self.num_layers)):
            return None
        return self.sliding_window

    def layer_variants(self) -> list[AttentionVariant]:
        """What each layer's attention computes (its window and soft-cap, sinks, latent values)."""
        value_dim = self.mla.kv_lora_rank if self.mla is not None else None
        topk = self.indexer.topk if self.indexer is not None else None
        return [
            AttentionVariant(
                self.sliding_window if self.is_sliding(i) else None,
                self.attn_softcap,
                self.attention_sinks,
                value_dim,
                topk,
            )
            for i in range(self.num_layers)
        ]

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        get, hf_known = _hf_getter(cfg)
        act = get("hidden_activation") or get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}; supported: {', '.join(ACTIVATIONS)}")
        if cfg.get("mlp_bias"):
            raise ValueError("unsupported mlp_bias=true")
        qkv_bias, qk_norm, gemma = SUPPORTED_ARCHITECTURES[arch]
        layers = _layer_attention(cfg, get, hf_known)
        # transformers 5 nests rope settings under rope_parameters; older checkpoints use
        # top-level rope_theta and rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        legacy = cfg.get("rope_scaling") or {}
        if layers["global_rope"] is not None:  # Gemma 3: the global layers' RoPE settings
            rope = dict(layers["global_rope"])
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type") or rope.get("type") or legacy.get("rope_type") or legacy.get("type")
        scaling = None
        if rope_type not in (None, "default"):
            scaling = {**legacy, **rope, "rope_type": rope_type}
            scaling.pop("rope_theta", None)
            scaling.pop("type", None)
            if rope_type not in ("llama3", "linear", "yarn"):
                raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, linear, llama3, yarn")
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        mla = _latent_attention(arch, cfg, get)
        moe = _experts(arch, cfg, get)
        linear = _linear_attention(arch, cfg, get)
        indexer = None
        if arch == "DeepseekV32ForCausalLM":
            index_dims = get("index_n_heads"), get("index_head_dim"), get("index_topk")
            indexer = SparseIndexer(*index_dims, rope_dim=mla.qk_rope_head_dim)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=1 if mla else cfg.get("num_key_value_heads") or num_heads,
            head_dim=mla.latent_dim if mla else get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=get("rms_norm_eps") or 1e-6,
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            qkv_bias=qkv_bias or bool(cfg.get("attention_bias", False)),
            qk_norm=qk_norm,
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            sliding_window=layers["sliding_window"],
            hidden_act=act,
            gemma=gemma,
            layer_types=layers["layer_types"],
            attn_softcap=get("attn_logit_softcapping"),
            final_softcap=get("final_logit_softcapping"),
            query_pre_attn_scalar=get("query_pre_attn_scalar"),
            local_rope_theta=layers["local_rope_theta"],
            mla=mla,
            moe=moe,
            o_proj_bias=bool(get("attention_bias")) and arch != "Qwen2ForCausalLM",
            attention_sinks=arch == "GptOssForCausalLM",
            linear=linear,
            attn_output_gate=arch in HYBRID_ARCHITECTURES,
            partial_rotary_factor=float(rope.get("partial_rotary_factor", get("partial_rotary_factor") or 1.0)),
            indexer=indexer,
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


def check_model_settings(engine, cfg: ModelConfig) -> None:
    """ValueError, one line, for an engine setting (EngineConfig) `cfg` has nothing to apply to:
    index_cache_dtype without DeepSeek-V3.2's indexer, mamba_block_size without DeltaNet layers."""
    if engine.index_cache_dtype != "auto" and cfg.indexer is None:
        raise ValueError(
            f"index_cache_dtype {engine.index_cache_dtype}: model {engine.model} has no sparse-attention "
            "indexer (DeepSeek-V3.2's) whose index keys it would store"
        )
    if engine.mamba_block_size is not None and cfg.linear is None:
        raise ValueError(
            f"mamba_block_size {engine.mamba_block_size}: model {engine.model} has no DeltaNet layers (the setting "
            "is for hybrid models: Qwen3.5, Qwen3-Next)"
        )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scaling for a context extended `factor` times (DeepSeek's yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _latent_attention(arch: str, cfg: dict, get) -> LatentAttention | None:
    """The latent-attention dims of a DeepSeek-V2 or V3 config."""
    if arch not in LATENT_ARCHITECTURES:
        return None
    if get("attention_bias"):
        raise ValueError("attention_bias with latent attention is not supported")
    return LatentAttention(
        q_lora_rank=get("q_lora_rank"),
        kv_lora_rank=get("kv_lora_rank"),
        qk_nope_head_dim=get("qk_nope_head_dim"),
        qk_rope_head_dim=get("qk_rope_head_dim"),
        v_head_dim=get("v_head_dim"),
        # DeepSeek-V2 rotates (even, odd) pairs as complex numbers: V3's rope_interleave, V3.2's always.
        rope_interleave=arch != "DeepseekV3ForCausalLM" or bool(get("rope_interleave")),
    )


def _linear_attention(arch: str, cfg: dict, get) -> LinearAttention | None:
    """The gated DeltaNet layers of a hybrid config (None: no linear layers)."""
    if arch not in HYBRID_ARCHITECTURES:
        return None
    types = list(get("layer_types") or [])
    if len(types) != cfg["num_hidden_layers"]:
        raise ValueError(f"layer_types names {len(types)} layers, the model has {cfg['num_hidden_layers']}")
    if get("hidden_act") != "silu":
        raise ValueError(f"gated DeltaNet layers with hidden_act {get('hidden_act')!r}: only silu is supported")
    return LinearAttention(
        num_key_heads=get("linear_num_key_heads"),
        num_value_heads=get("linear_num_value_heads"),
        key_head_dim=get("linear_key_head_dim"),
        value_head_dim=get("linear_value_head_dim"),
        conv_kernel=get("linear_conv_kernel_dim"),
        layers=tuple(t == LINEAR for t in types),
        projection="grouped" if arch == "Qwen3NextForCausalLM" else "split",
    )


def _experts(arch: str, cfg: dict, get) -> MoEConfig | None:
    """The MoE layers of a Mixtral, Qwen3-MoE, gpt-oss or DeepSeek config (None: every layer dense)."""
    n = cfg["num_hidden_layers"]
    if arch == "MixtralForCausalLM":
        return MoEConfig(
            num_experts=get("num_local_experts"),
            top_k=get("num_experts_per_tok"),
            intermediate_size=cfg["intermediate_size"],
            layers=(True,) * n,
            block_name="block_sparse_moe",
            expert_names=("w1", "w3", "w2"),
        )
    if arch == "GptOssForCausalLM":
        return MoEConfig(
            num_experts=get("num_local_experts"),
            top_k=get("num_experts_per_tok"),
            intermediate_size=cfg["intermediate_size"],
            layers=(True,) * n,
            scoring="topk_softmax",
            router_name="router",
            router_bias=True,
            fused_experts=True,
            swiglu_alpha=float(get("swiglu_alpha")),
            swiglu_limit=float(get("swiglu_limit")),
        )
    if arch in ("Qwen3MoeForCausalLM", "Qwen3NextForCausalLM"):
        dense, step = set(get("mlp_only_layers") or []), get("decoder_sparse_step") or 1
        return MoEConfig(
            num_experts=get("num_experts"),
            top_k=get("num_experts_per_tok"),
            intermediate_size=get("moe_intermediate_size"),
            layers=tuple(i not in dense and get("num_experts") > 0 and (i + 1) % step == 0 for i in range(n)),
            norm_topk_prob=bool(get("norm_topk_prob")),
            gated_shared_expert_size=(get("shared_expert_intermediate_size") or 0)
            if arch != "Qwen3MoeForCausalLM"
            else 0,
        )
    if arch in LATENT_ARCHITECTURES and get("n_routed_experts"):
        dense, v2 = get("first_k_dense_replace") or 0, arch == "DeepseekV2ForCausalLM"
        grouped = not v2 or get("topk_method") == "group_limited_greedy"  # V2's "greedy": one group
        return MoEConfig(
            num_experts=get("n_routed_experts"),
            top_k=get("num_experts_per_tok"),
            intermediate_size=get("moe_intermediate_size"),
            layers=tuple(i >= dense for i in range(n)),
            scoring="grouped_softmax" if v2 else "sigmoid",
            norm_topk_prob=not v2 and bool(get("norm_topk_prob")),  # transformers' V2 router never renormalizes
            num_shared_experts=get("n_shared_experts") or 0,
            routed_scaling_factor=float(get("routed_scaling_factor") or 1.0),
            n_group=(get("n_group") or 1) if grouped else 1,
            topk_group=(get("topk_group") or 1) if grouped else 1,
        )
    return None


def _hf_getter(cfg: dict):
    """A lookup of config fields as transformers' config class for the model type fills them in: a
    config.json may leave fields to the class defaults (Gemma's tied embeddings, soft-caps, head_dim
    256 and query_pre_attn_scalar), and the engine must compute what transformers computes. Falls
    back to the raw dict for a model type this transformers does not know."""
    from transformers import AutoConfig

    model_type = cfg.get("model_type")
    hf = None
    if model_type:
        try:
            fields = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "transformers_version")}
            hf = AutoConfig.for_model(model_type, **fields)
        except (KeyError, ValueError, TypeError):
            hf = None
    if hf is None:
        return cfg.get, False
    return (lambda key: getattr(hf, key) if hasattr(hf, key) else cfg.get(key)), True


def _layer_attention(cfg: dict, get, hf_known: bool) -> dict:
    """Sliding window, layer types and per-layer-type RoPE (`get` reads the filled-in config)."""
    window = get("sliding_window")
    layer_types = get("layer_types")
    if not hf_known and window is not None and not cfg.get("use_sliding_window", True):
        window = None  # an old Qwen2 config without its model type
    if layer_types is not None and SLIDING not in layer_types:
        window = None  # every layer global (e.g. Qwen2 with use_sliding_window false)
    rope = get("rope_parameters") or {}
    per_type = isinstance(rope, dict) and SLIDING in rope
    local_theta = rope[SLIDING].get("rope_theta") if per_type else get("rope_local_base_freq")
    return {
        "sliding_window": window,
        "layer_types": list(layer_types) if layer_types is not None and window is not None else None,
        "global_rope": rope.get("full_attention") if per_type else None,
        "local_rope_theta": float(local_theta) if local_theta is not None else None,
    }
