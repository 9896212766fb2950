"""Layers every decoder here shares: the step's attention context, RoPE, RMSNorm, the MLP, and
tensor-parallel linears and embedding (Hugging Face's module names, so checkpoints load by name)."""

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedbench.backends.base import AttentionBackend, write_kv
from pagedbench.model import fused
from pagedbench.model.config import ModelConfig
from pagedbench.model.parallel import TPShard, all_reduce, shard_param


@dataclass(slots=True)
class AttentionContext:
    """What every layer needs for one step: its backend and that backend's per-step state (layers
    of one attention variant share both), and the cache."""

    backends: list[AttentionBackend]  # per layer
    states: list[Any]  # per layer
    slot_mapping: torch.Tensor  # [T] int64
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer K, V [num_blocks, block_size, H_kv, D]
    timer: Any = None  # a DeviceTimer: each layer's attention call becomes an "attention" span
    kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer, when the pages are quantized
    calibrate_kv: bool = False  # set each layer's fp8 scales from this step's K/V (calculate_kv_scales)
    linear: Any = None  # hybrid models: the step's LinearStep (worker/linear_state.py) for DeltaNet layers
    sparse: Any = None  # DeepSeek-V3.2: the step's SparseStep (model/sparse_index.py), the indexer's pages

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        sinks: torch.Tensor | None = None,
        selected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's k, v [T, H_kv, D] into `layer`'s pages (v None: latent attention, whose
        values are the key pages' first dims) and attend with q [T, H, D] through the layer's
        backend (an "attention" span of the timer) -> [T, H, D_v]; `sinks` [H]: the layer's sink logits;
        `selected` [T, topk]: sparse attention's cache slots per query (-1: none)."""
        k_cache, v_cache = self.kv_caches[layer]
        scales = self.kv_scales[layer] if self.kv_scales is not None else None
        if self.calibrate_kv:  # vLLM's calculate_kv_scales: the first step's absolute maximum fills fp8's range
            for x, scale in zip((k, v), scales):
                if x is not None:
                    scale.copy_((x.abs().amax().float() / torch.finfo(k_cache.dtype).max).clamp(min=1e-8))
        write_kv(k, v, k_cache, v_cache, self.slot_mapping, scales)
        start = self.timer.mark() if self.timer is not None else None
        extra = {} if scales is None else {"kv_scales": scales}
        if sinks is not None:
            extra["sinks"] = sinks.float()
        if selected is not None:
            extra["selected"] = selected
        out = self.backends[layer].forward(q, k_cache, v_cache, self.states[layer], **extra)
        if start is not None:
            self.timer.span("attention", start)
        return out


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [rotary_dim/2], with linear, llama3 or YaRN scaling applied (`local`: a
    Gemma 3 sliding-window layer's own base, unscaled)."""
    d = cfg.rotary_dim
    theta = cfg.local_rope_theta if local else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = {} if local else cfg.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        inv_freq = _yarn(cfg)[0]
    return inv_freq


def _yarn(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies and cos/sin factor, from transformers' own code for it."""
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = PretrainedConfig(
        rope_parameters={**cfg.rope_scaling, "rope_theta": cfg.rope_theta},
        head_dim=cfg.rotary_dim,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
    )
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    return inv_freq.float(), float(factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, local: bool = False):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(cfg, local))
        emb = torch.cat((freqs, freqs), dim=-1)
        yarn = not local and (cfg.rope_scaling or {}).get("rope_type") == "yarn"
        factor = _yarn(cfg)[1] if yarn else 1.0  # YaRN scales cos and sin (its attention factor)
        # [max_positions, 2, rotary_dim] fp32: cos and sin side by side, so a step gathers both at once
        self.register_buffer("cos_sin", torch.stack((emb.cos(), emb.sin()), dim=1) * factor, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rotary_dim] for `positions` [T]; gathered once per step, used by every layer."""
        cos, sin = self.cos_sin[positions].to(dtype).unbind(1)
        return cos.unsqueeze(1), sin.unsqueeze(1)


class RMSNorm(nn.Module):
    """Llama's: weight * norm(x) in x's dtype; Gemma's (`offset`): norm(x) * (1 + weight) in fp32.
    Given the residual stream, it adds first and returns (normed, new residual): one fused kernel
    when the model is compiled."""

    ops: fused.LayerOps = fused.EAGER  # the model's choice (CausalLM.use_ops)

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps, self.offset)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps, self.offset)


def merge_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight [sum of out, in] (and bias) holding the rows of `linears`, whose own parameters
    become views of it: checkpoints still load into q_proj / k_proj / v_proj (or gate_proj /
    up_proj) by name, tensor-parallel shards included, and one GEMM reads them all (vLLM's stacked
    parameters, seen from the other side)."""
    weight = torch.cat([lin.weight.data for lin in linears])
    bias = torch.cat([lin.bias.data for lin in linears]) if linears[0].bias is not None else None
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        _alias(lin, "weight", weight[start : start + rows])
        if bias is not None:
            _alias(lin, "bias", bias[start : start + rows])
        start += rows
    return weight, bias


def _alias(linear: nn.Linear, name: str, view: torch.Tensor) -> None:
    old = getattr(linear, name)
    param = nn.Parameter(view, requires_grad=old.requires_grad)
    param.__dict__.update(old.__dict__)  # tp_slice and other marks
    setattr(linear, name, param)


def column_parallel(in_features: int, out_features: int, start: int, length: int, bias: bool) -> nn.Linear:
    """The output rows [start, start + length) of an in_features -> out_features projection."""
    linear = nn.Linear(in_features, length, bias=bias)
    shard_param(linear.weight, 0, start, length, out_features)
    if bias:
        shard_param(linear.bias, 0, start, length, out_features)
    return linear


class RowParallelLinear(nn.Linear):
    """The input columns [start, start + length) of a projection: its output is a partial sum, to
    which only rank 0 adds the (replicated) bias, so the sum over ranks holds it once."""

    def __init__(self, length: int, out_features: int, bias: bool, rank: int):
        super().__init__(length, out_features, bias=bias)
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias if self.rank == 0 else None)


def row_parallel(
    in_features: int, out_features: int, start: int, length: int, bias: bool = False, rank: int = 0
) -> nn.Linear:
    """The input columns [start, start + length) of a projection; its output is a partial sum."""
    linear = RowParallelLinear(length, out_features, bias, rank)
    shard_param(linear.weight, 1, start, length, in_features)
    return linear


class MLP(nn.Module):
    """A gated MLP of `intermediate_size` (the model's by default; DeepSeek's shared experts' own):
    gate and up as one GEMM (merged weights) unless the model runs them apart."""

    ops: fused.LayerOps = fused.EAGER
    merged = True  # CausalLM.use_ops sets the device's choice

    def __init__(self, cfg: ModelConfig, tp: TPShard, intermediate_size: int | None = None):
        super().__init__()
        self.tp = tp
        h, n = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        start, length = tp.chunk(n)
        self.gate_proj = column_parallel(h, n, start, length, bias=False)
        self.up_proj = column_parallel(h, n, start, length, bias=False)
        self.down_proj = row_parallel(n, h, start, length)
        self.gelu = cfg.hidden_act != "silu"  # Gemma's GeLU-tanh
        self.gate_up_weight, _ = merge_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return all_reduce(self.down_proj(self.ops.act_and_mul(gate, up, self.gelu)), self.tp)


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + length) of the embedding; other ids look up zeros, summed across ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPShard):
        self.tp, (self.start, length) = tp, tp.chunk(vocab_size)
        super().__init__(length, hidden_size)
        shard_param(self.weight, 0, self.start, length, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.start
        here = (local >= 0) & (local < self.num_embeddings)
        x = super().forward(torch.where(here, local, 0)) * here[:, None].to(self.weight.dtype)
        return all_reduce(x, self.tp)
