"""The elementwise work around a layer's GEMMs and its attention call, as plain functions that
torch.compile fuses: a residual add with the RMSNorm after it, q/k norms with RoPE (and the split
of a merged QKV), the activation times the gate, the latent's RoPE, the logits' soft-cap (and an MoE router, moe.py).

Eager, each is the handful of ATen ops Hugging Face runs; compiled (inductor: Triton on CUDA, C++
on CPU), each is one kernel or two. The attention backend is never inside a compiled function
(vLLM's piecewise compilation keeps it opaque the same way), so every backend runs as it does
eagerly, and the token dimension is dynamic: no recompile per batch size. A model's layers call
these through `LayerOps`: `EAGER` or `compiled_ops()`, chosen once per engine (EngineConfig.compile).
"""

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """Llama's weight * norm(x) in x's dtype; Gemma's (`offset`) norm(x) * (1 + weight) in fp32."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (1.0 + weight.float())).to(dtype)
    return weight * h.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream's add fused with the next norm."""
    x = x + residual
    return rms_norm(x, weight, eps, offset), x


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-split (rotate_half) layout Hugging Face uses: x [T, H, D], cos/sin [T, 1, R]
    (R < D: partial rotary, the first R dims rotate and the rest pass, as Qwen3.5's)."""
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return torch.cat((rotate(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def qkv_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: tuple[int, int, int],
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    offset: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The projections' outputs q [T, H D], k and v [T, H_kv D] (views of one merged GEMM's output,
    or three) -> q [T, H, D], k and v [T, H_kv, D], with Qwen3/Gemma 3's per-head q/k norms
    (weights given) and RoPE applied to q and k."""
    num_heads, num_kv_heads, head_dim = heads
    t = q.shape[0]
    q, k, v = q.reshape(t, num_heads, head_dim), k.reshape(t, num_kv_heads, head_dim), v.reshape(t, -1, head_dim)
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps, offset), rms_norm(k, k_weight, eps, offset)
    return rotate(q, cos, sin), rotate(k, cos, sin), v.contiguous()


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """act(gate) * up [T, I]: SiLU, or Gemma's GeLU-tanh."""
    return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(logits / cap) * cap


def latent_rope(
    q_rope: torch.Tensor, k_rope: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent attention's rotary parts: (even, odd) pairs de-interleaved first where the checkpoint
    stores them so (DeepSeek's rope_interleave), then rotated."""
    if interleaved:
        q_rope = torch.cat((q_rope[..., 0::2], q_rope[..., 1::2]), dim=-1)
        k_rope = torch.cat((k_rope[..., 0::2], k_rope[..., 1::2]), dim=-1)
    return rotate(q_rope, cos, sin), rotate(k_rope, cos, sin)


@dataclass(frozen=True, slots=True)
class LayerOps:
    """The fusable functions a model's layers call, eager or compiled."""

    compiled: bool
    rms_norm: Callable = rms_norm
    add_rms_norm: Callable = add_rms_norm
    qkv_rope: Callable = qkv_rope
    act_and_mul: Callable = act_and_mul
    softcap: Callable = softcap
    latent_rope: Callable = latent_rope


EAGER = LayerOps(compiled=False)
FUSABLE = ("rms_norm", "add_rms_norm", "qkv_rope", "act_and_mul", "softcap", "latent_rope")


def _compile(fn: Callable) -> Callable:
    # dynamic=True: the token dimension varies every step; one graph serves every batch size.
    return torch.compile(fn, dynamic=True, fullgraph=True)


@functools.cache
def compiled_ops() -> LayerOps:
    """Every fusable function under torch.compile (compiled lazily, at its first call; inductor's
    cache on disk, see cache_dir(), makes later processes' compiles a lookup). An MoE layer compiles
    its router alongside (moe.compiled_route)."""
    # A layer calls each function once per step; with 28+ layers and several dtypes/shapes the
    # default of 8 graphs per function is near, and hitting it would silently run eager.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    fns = {name: _compile(globals()[name]) for name in FUSABLE}
    return LayerOps(compiled=True, **fns)


def compile_function(fn: Callable) -> Callable:
    """`fn` compiled as the fused functions are (for a layer's own elementwise work, e.g. a router)."""
    return _compile(fn)


def dynamo_seconds() -> float:
    """Seconds torch.compile has spent compiling in this process so far (every caller's)."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(compilation_time_metrics.get("_compile.compile_inner", ()))


def cache_dir() -> str:
    """Where inductor keeps compiled kernels between processes (TORCHINDUCTOR_CACHE_DIR, else its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or inductor_cache_dir()


def ops_for(compile: bool) -> LayerOps:
    return compiled_ops() if compile else EAGER
