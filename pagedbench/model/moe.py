"""Mixture-of-experts layers (Mixtral, Qwen3-MoE, gpt-oss, DeepSeek-V2 and V3), computed as transformers computes
each family, with the experts batched.

A router picks top-k experts per token (each family's scoring and normalization). The (token,
expert) pairs are sorted by expert, so each expert's tokens are contiguous, and every expert
projection is one grouped matmul over all of them (`torch._grouped_mm` with per-expert offsets on
the device: no host sync in the layer loop). Weighted outputs are summed back per token in
expert order, as transformers' loop over experts does. Expert weights are stacked `[E, out, in]`
parameters; the loader fills expert e's slice from the checkpoint's `...experts.{e}.{proj}.weight`.
Tensor parallelism shards every expert's intermediate dimension (and the shared experts' MLP), as
vLLM does: each rank's output is a partial sum.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pagedbench.model.config import ModelConfig, MoEConfig
from pagedbench.model.fused import EAGER, LayerOps, compile_function
from pagedbench.model.layers import MLP
from pagedbench.model.parallel import TPShard, all_reduce, shard_param


def _by_group(moe: MoEConfig, scores: torch.Tensor) -> torch.Tensor:
    """[T, E] -> [T, n_group, E / n_group]."""
    return scores.view(-1, moe.n_group, moe.num_experts // moe.n_group)


def kept_groups(moe: MoEConfig, group_scores: torch.Tensor) -> torch.Tensor:
    """[T, n_group] group scores -> [T, E] bool: the experts of each token's topk_group best groups."""
    kept = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(moe.topk_group, dim=-1, sorted=False)[1], 1)
    return kept.bool().repeat_interleave(moe.num_experts // moe.n_group, dim=1)


def route(moe: MoEConfig, logits: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] fp32, experts [T, k] int64), as each family does it."""
    if moe.scoring == "sigmoid":  # DeepSeek-V3: groups by their best two, then top-k within the kept groups
        scores = logits.float().sigmoid()
        choice = scores + bias
        kept = kept_groups(moe, _by_group(moe, choice).topk(2, dim=-1)[0].sum(dim=-1))
        experts = choice.masked_fill(~kept, float("-inf")).topk(moe.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, experts
    if moe.scoring == "grouped_softmax":  # DeepSeek-V2: groups by their best expert, masked to 0, no renormalizing
        scores = logits.float().softmax(dim=-1)
        kept = kept_groups(moe, _by_group(moe, scores).amax(dim=-1))
        weights, experts = scores.masked_fill(~kept, 0.0).topk(moe.top_k, dim=-1, sorted=False)
        return weights * moe.routed_scaling_factor, experts
    if moe.scoring == "topk_softmax":  # gpt-oss: the top k logits, then a softmax over them
        top, experts = logits.topk(moe.top_k, dim=-1)
        return top.softmax(dim=-1), experts
    weights, experts = logits.float().softmax(dim=-1).topk(moe.top_k, dim=-1)  # Mixtral, Qwen3-MoE
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


@functools.cache
def compiled_route():
    """route() under torch.compile (the model's compiled layers call it): scores, group masks and top-k fused."""
    return compile_function(route)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [N, in] (rows grouped by expert, group e ending at offsets[e]) times each group's weight
    [E, in, out] -> [N, out]: one grouped matmul, or, where this torch has none for the device and
    dtype, one matmul per expert (reading the offsets on the host: a sync)."""
    if grouped_mm_runs(x.device.type, x.dtype):
        return torch._grouped_mm(x, weight, offs=offsets)
    ends = offsets.tolist()
    return torch.cat([x[a:b] @ w for a, b, w in zip([0, *ends[:-1]], ends, weight)])


def experts_kernel(device_type: str, dtype: torch.dtype) -> str:
    """What the experts' matmuls run as on this device type and dtype (the report's moe_kernel)."""
    return "torch._grouped_mm" if grouped_mm_runs(device_type, dtype) else "one matmul per expert"


@functools.cache
def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm exists and runs for this device type and dtype (tried once)."""
    try:
        x = torch.ones(16, 16, device=device_type, dtype=dtype)
        w = torch.ones(2, 16, 16, device=device_type, dtype=dtype)
        torch._grouped_mm(x, w.transpose(1, 2), offs=torch.tensor([8, 16], device=device_type, dtype=torch.int32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError, TypeError):
        return False


class SparseMoE(nn.Module):
    """Router, stacked experts (this rank's part of each one's intermediate dimension) and, for
    DeepSeek, the shared experts: one MLP of n_shared x the expert size, added for every token."""

    ops: LayerOps = EAGER  # the router's scores and top-k compiled with the model (fused.py)

    def __init__(self, cfg: ModelConfig, tp: TPShard):
        super().__init__()
        moe, h = cfg.moe, cfg.hidden_size
        self.moe, self.tp = moe, tp
        router = nn.Linear(h, moe.num_experts, bias=moe.router_bias)
        setattr(self, moe.router_name, router)  # "gate" in most families, gpt-oss's "router"
        if moe.scoring == "sigmoid":
            router.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False)
        self.experts = nn.Module()
        start, length = tp.chunk(moe.intermediate_size)
        if moe.fused_experts:  # gpt-oss's [E, in, out]: gate and up interleaved, so a rank's pairs are contiguous
            self._stacked("gate_up_proj", (h, 2 * length), 2, 2 * start, 2 * moe.intermediate_size)
            self._stacked("gate_up_proj_bias", (2 * length,), 1, 2 * start, 2 * moe.intermediate_size)
            self._stacked("down_proj", (length, h), 1, start, moe.intermediate_size)
            self._stacked("down_proj_bias", (h,))  # replicated: rank 0 adds it
        else:  # stacked from the checkpoint's per-expert Linear weights [out, in]
            gate_name, up_name, down_name = moe.expert_names
            for name, shape, dim in (
                (gate_name, (length, h), 1),
                (up_name, (length, h), 1),
                (down_name, (h, length), 2),
            ):
                self._stacked(name, shape, dim, start, moe.intermediate_size)
        if moe.num_shared_experts:
            self.shared_experts = MLP(cfg, tp, intermediate_size=moe.intermediate_size * moe.num_shared_experts)
        if moe.gated_shared_expert_size:  # Qwen3-Next: a shared expert whose output a per-token gate scales
            self.shared_expert = MLP(cfg, tp, intermediate_size=moe.gated_shared_expert_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def _stacked(self, name: str, shape: tuple, dim: int | None = None, start: int = 0, full: int = 0) -> None:
        """A parameter [E, *shape] of the experts, this rank's part along `dim` when given."""
        param = nn.Parameter(torch.empty(self.moe.num_experts, *shape))
        if dim is not None:
            shard_param(param, dim, start, param.shape[dim], full)
        setattr(self.experts, name, param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        router = getattr(self, moe.router_name)
        if moe.scoring in ("sigmoid", "grouped_softmax"):  # DeepSeek routes in fp32
            logits = F.linear(x.float(), router.weight.float())
        else:
            logits = router(x)
        router_fn = compiled_route() if self.ops.compiled else route
        weights, experts = router_fn(moe, logits, getattr(router, "e_score_correction_bias", None))
        order = experts.flatten().argsort(stable=True)  # (token, choice) pairs grouped by expert
        token, expert = order // moe.top_k, experts.flatten()[order]
        offsets = torch.bincount(experts.flatten(), minlength=moe.num_experts).cumsum(0).to(torch.int32)
        rows = x[token]
        out = self._fused(rows, expert, offsets) if moe.fused_experts else self._gated(rows, offsets)
        out = out * weights.flatten()[order, None].to(x.dtype)
        routed = all_reduce(torch.zeros_like(x).index_add_(0, token, out), self.tp)
        if moe.gated_shared_expert_size:
            routed = routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + self.shared_experts(x) if moe.num_shared_experts else routed

    def _gated(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """SiLU-gated experts from Linear-layout weights [E, out, in]."""
        gate, up, down = (getattr(self.experts, name).transpose(1, 2) for name in self.moe.expert_names)
        hidden = F.silu(grouped_linear(rows, gate, offsets)) * grouped_linear(rows, up, offsets)
        return grouped_linear(hidden, down, offsets)

    def _fused(self, rows: torch.Tensor, expert: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """gpt-oss's experts: biases, interleaved gate/up, the clamped SwiGLU."""
        e, moe = self.experts, self.moe
        gate_up = grouped_linear(rows, e.gate_up_proj, offsets) + e.gate_up_proj_bias[expert]
        gate = gate_up[..., ::2].clamp(max=moe.swiglu_limit)
        up = gate_up[..., 1::2].clamp(-moe.swiglu_limit, moe.swiglu_limit)
        out = grouped_linear((up + 1) * gate * torch.sigmoid(gate * moe.swiglu_alpha), e.down_proj, offsets)
        return out + e.down_proj_bias[expert] if self.tp.rank == 0 else out
