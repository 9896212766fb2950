"""Hybrid models' gated DeltaNet layers (Qwen3.5, Qwen3-Next): linear attention that keeps a
fixed-size state per sequence instead of pages (their gated full attention is llama.Attention with its output gate).

A DeltaNet layer reads and writes each sequence's state in its slot of the step's
`LinearStateCache` (worker/linear_state.py): the conv window (the last conv_kernel - 1 inputs) and
the recurrent state [value heads, key dim, value dim]. A sequence's first chunk starts from zeros;
a later chunk (chunked prefill), a decode, or a prefix hit (its slot restored from a snapshot)
continues from its slot; a chunk is cut where prefix caching snapshots the state. The recurrence is
the engine's linear_attention_kernel (model/delta_rule.py): `torch`, the torch forms transformers
ships (chunked for several tokens, recurrent for one), so the tokens are Hugging Face's, each
sequence of the step on its own (a loop over the batch, host indices); or `fla`,
flash-linear-attention's Triton kernels, every sequence of the step in one varlen call.
"""

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from pagedbench.device.dtypes import resolve_device_dtype
from pagedbench.model.config import ModelConfig
from pagedbench.model.delta_rule import check_linear_attention_kernel, fla_mix, torch_delta_rule
from pagedbench.model.layers import AttentionContext, column_parallel, row_parallel
from pagedbench.model.parallel import NO_TP, TPShard, all_reduce, local_linear, shard_param, shard_param_parts


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head's output, times SiLU of its gate z (weight * norm(x) in x's dtype)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * x.to(dtype)) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention layer, under Hugging Face's parameter names."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPShard = NO_TP):
        super().__init__()
        full = cfg.linear
        lin = local_linear(full, tp)  # this rank's key heads, each with its value heads (all at tp=1)
        self.layer_idx, self.lin, self.tp = layer_idx, lin, tp
        h, dk, dv = cfg.hidden_size, lin.key_head_dim, lin.value_head_dim
        k0, v0 = tp.rank * lin.num_key_heads, tp.rank * lin.num_value_heads  # first key / value head
        # q | k | v rows (the conv's channels): this rank's heads of each part
        qkv_parts = [
            (k0 * dk, lin.key_dim),
            (full.key_dim + k0 * dk, lin.key_dim),
            (2 * full.key_dim + v0 * dv, lin.value_dim),
        ]
        if lin.projection == "grouped":  # Qwen3-Next: two projections laid out per key head
            per_key = lin.conv_dim + lin.value_dim  # rows of one rank's key heads, contiguous
            self.in_proj_qkvz = column_parallel(h, full.conv_dim + full.value_dim, tp.rank * per_key, per_key, False)
            ba = 2 * lin.num_value_heads
            self.in_proj_ba = column_parallel(h, 2 * full.num_value_heads, tp.rank * ba, ba, False)
        else:
            self.in_proj_qkv = nn.Linear(h, lin.conv_dim, bias=False)
            shard_param_parts(self.in_proj_qkv.weight, 0, qkv_parts, full.conv_dim)
            self.in_proj_z = column_parallel(h, full.value_dim, v0 * dv, lin.value_dim, False)
            self.in_proj_b = column_parallel(h, full.num_value_heads, v0, lin.num_value_heads, False)
            self.in_proj_a = column_parallel(h, full.num_value_heads, v0, lin.num_value_heads, False)
        self.conv1d = nn.Conv1d(lin.conv_dim, lin.conv_dim, lin.conv_kernel, groups=lin.conv_dim, bias=False)
        shard_param_parts(self.conv1d.weight, 0, qkv_parts, full.conv_dim)
        self.dt_bias = nn.Parameter(torch.ones(lin.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(lin.num_value_heads))
        for param in (self.dt_bias, self.A_log):
            shard_param(param, 0, v0, lin.num_value_heads, full.num_value_heads)
        self.norm = GatedRMSNorm(dv, cfg.rms_norm_eps)
        self.out_proj = row_parallel(full.value_dim, h, v0 * dv, lin.value_dim, False, tp.rank)

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """x [T, hidden] (the step's flat tokens) -> [T, hidden]; each sequence's slot updated."""
        start = ctx.timer.mark() if ctx.timer is not None else None  # a "linear_attention" span of the step
        out = self._mix(x, ctx.linear)
        if start is not None:
            ctx.timer.span("linear_attention", start)
        return out

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q/k/v [T, conv_dim] as the conv reads them, z [T, Hv, Dv], b and a [T, Hv])."""
        lin = self.lin
        if lin.projection == "grouped":
            per_key = lin.num_value_heads // lin.num_key_heads  # value heads of each key head
            dk, vs = lin.key_head_dim, per_key * lin.value_head_dim
            q, k, v, z = _grouped(self.in_proj_qkvz(x), lin.num_key_heads, [dk, dk, vs, vs])
            b, a = _grouped(self.in_proj_ba(x), lin.num_key_heads, [per_key, per_key])
            mixed = torch.cat((q, k, v), dim=-1)
        else:
            mixed, z, b, a = self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        return mixed, rearrange(z, "t (h d) -> t h d", d=lin.value_head_dim), b, a

    def _mix(self, x: torch.Tensor, step) -> torch.Tensor:
        lin = self.lin
        conv_states, states = step.cache.conv[self.layer_idx], step.cache.recurrent[self.layer_idx]
        mixed, z, b, a = self._project(x)
        beta = b.sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, Hv], log decay
        weight = self.conv1d.weight  # [C, 1, K]
        if step.cache.kernel == "fla":  # every sequence of the step in one varlen call (model/delta_rule.py)
            return self._output(fla_mix(lin, mixed, weight, g, beta, step, conv_states, states), z, x)
        chunked, recurrent = torch_delta_rule()  # transformers' torch forms, never fla's swapped in
        out = x.new_empty(x.shape[0], lin.num_value_heads, lin.value_head_dim)
        for slot, start, end, continues, snapshot in step.segments():
            # The conv over this chunk, its window starting with the previous chunk's last inputs.
            window = conv_states[slot] if continues else mixed.new_zeros(lin.conv_dim, lin.conv_kernel - 1)
            inputs = torch.cat((window, mixed[start:end].T), dim=-1)  # [C, K-1+L]
            conv_states[slot] = inputs[:, inputs.shape[1] - (lin.conv_kernel - 1) :]
            y = F.silu(F.conv1d(inputs[None], weight, groups=lin.conv_dim))[0].T  # [L, C]
            q, k, v = y.split([lin.key_dim, lin.key_dim, lin.value_dim], dim=-1)
            q = rearrange(q, "l (h d) -> 1 l h d", d=lin.key_head_dim)
            k = rearrange(k, "l (h d) -> 1 l h d", d=lin.key_head_dim)
            v = rearrange(v, "l (h d) -> 1 l h d", d=lin.value_head_dim)
            rule = recurrent if end - start == 1 and continues else chunked
            o, final = rule(
                q, k, v, g=g[None, start:end], beta=beta[None, start:end],
                initial_state=states[slot][None] if continues else None,
                output_final_state=True, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
            states[slot] = final[0]
            out[start:end] = o[0]
            if snapshot is not None:  # prefix caching: the state after these rows, kept for a later prompt
                conv_states[snapshot], states[snapshot] = conv_states[slot], states[slot]
        return self._output(out, z, x)

    def _output(self, out: torch.Tensor, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The rule's output [T, Hv, Dv] through the gated RMSNorm and out_proj."""
        lin = self.lin
        out = self.norm(out.reshape(-1, lin.value_head_dim), z.reshape(-1, lin.value_head_dim))
        return all_reduce(self.out_proj(out.reshape(x.shape[0], lin.value_dim)), self.tp)


def _grouped(t: torch.Tensor, heads: int, sizes: list[int]) -> list[torch.Tensor]:
    """[T, heads * sum(sizes)] laid out per head -> one [T, heads * size] per part, head-major."""
    parts = t.view(t.shape[0], heads, sum(sizes)).split(sizes, dim=-1)
    return [p.reshape(t.shape[0], -1) for p in parts]


def hybrid_engine_config(config):
    """The engine settings a hybrid model runs with so far: one pipeline stage (tensor parallelism
    splits its DeltaNet layers by key heads) and no speculative decoding (a rejected token would
    have to roll the state back). Prefix caching resumes from DeltaNet state snapshots; with none
    kept (num_state_snapshots 0) it is off. Checked before the model is built and its cache sized:
    mamba_block_size a multiple of block_size, linear_attention_kernel able to run on the device."""
    import dataclasses
    import logging

    if config.mamba_block_size is not None and config.mamba_block_size % config.block_size:
        raise ValueError(
            f"mamba_block_size {config.mamba_block_size} must be a multiple of block_size {config.block_size}"
        )
    check_linear_attention_kernel(config.linear_attention_kernel, resolve_device_dtype(config.device, config.dtype)[0])
    if config.pipeline_parallel_size > 1:
        raise ValueError("hybrid (gated DeltaNet) models run in one pipeline stage (tensor parallelism splits them)")
    if config.speculative_config is not None:
        raise ValueError("speculative decoding on a hybrid model would have to roll its DeltaNet state back: refused")
    if config.enable_prefix_caching and config.num_state_snapshots == 0:
        logging.getLogger(__name__).warning(
            "prefix caching off: num_state_snapshots=0 keeps no DeltaNet state for a cached prefix to resume from"
        )
        config = dataclasses.replace(config, enable_prefix_caching=False)
    return config
