"""Random preset weights whose greedy tokens every correct backend reproduces bit for bit.

With plain N(0, 0.02) weights a model's logits are nearly flat and its attention is soft, so
the last bits of each backend's summation order flip greedy tokens and everything after them
(71-79 % agreement between sdpa and flex in bf16 on an H100). Scaling weights cannot help:
once an attention output differs by a rounding error, the bf16 residual rounds it to a whole
ulp. This initialisation removes the rounding instead of outshouting it: every attention head
is one-hot. Each head attends to exactly one earlier token — the one `lag` positions back
(lags 1-4 across heads; the nearest one at a prompt's first tokens) — with a score margin of
at least SCORE_MARGIN over every other key, so its output is that token's value vector to the
last bit whatever the kernel, tile order or precision. Every other operation is the same code
on every backend, so the logits agree bitwise, while they still depend on the context through
the copied values: a backend that reads a wrong page, a neighbour's slot or past the causal
edge copies another value and its tokens diverge.

How: hidden dimension 0 carries a constant (ALPHA x an embedding row's norm; no layer writes
to it), so after each RMSNorm it is a token-independent signal that dominates the norm — the
token-dependent rest is scaled down with it, so no layer makes the residual grow much. q and k read
only that dimension: every query of a head is the same vector, rotated by RoPE to its
position; k pairs are (a, 0) and q pairs are k's rotated back by lag x theta, so q.k peaks at
exactly that distance. All other weights are N(0, 0.02) and ignore dimension 0 (values, MLPs,
the LM head read only the token-dependent part). Speed does not depend on weight values.
"""

import math

import numpy as np
import torch

from pagedbench.model.config import ModelConfig
from pagedbench.model.layers import rope_inv_freq

STD = 0.02
ALPHA = 10.0  # the constant dimension, in units of an embedding row's norm
SCORE_MARGIN = 100.0  # softmax-score gap between the chosen key and any other (exp(-100) == 0)
MAX_LAG = 4


def score_margin_per_unit(cfg: ModelConfig, max_len: int) -> float:
    """min over lags and key sets of (chosen score - best other score) / unit amplitude: what the
    RoPE frequencies alone give, before scaling (also at a prompt's first positions)."""
    theta = rope_inv_freq(cfg).double().numpy()
    distance = np.arange(-MAX_LAG, max_len)  # (key distance - lag) over every reachable key
    scores = np.cos(np.outer(distance, theta)).sum(-1)
    peak = scores[MAX_LAG]
    margin = peak - np.delete(scores, MAX_LAG).max()
    for lag in range(1, MAX_LAG + 1):  # a query at position p < lag picks distance p (the first token)
        for p in range(1, lag):
            near = np.cos(np.outer(np.arange(p + 1) - lag, theta)).sum(-1)  # distances 0..p
            margin = min(margin, near[p] - near[:p].max())
    return float(margin)


MIN_MARGIN = 0.1  # below it q/k weights would have to be huge (fp16 overflow)


def decisive_reason(cfg: ModelConfig, max_len: int) -> str | None:
    """Why this model's RoPE cannot single out one lag per head (few frequencies alias over the
    context, as at head_dim 16), or None."""
    if cfg.gemma:
        return "Gemma's (1 + weight) norms, soft-caps and windowed layers are outside the decisive construction"
    if cfg.mla is not None:
        return "latent attention's compressed, absorbed keys are outside the decisive construction"
    if cfg.moe is not None:
        return "mixture-of-experts layers are outside the decisive construction"
    if cfg.linear is not None or cfg.attn_output_gate:
        return "gated DeltaNet layers and gated attention are outside the decisive construction"
    margin = score_margin_per_unit(cfg, max_len)
    if margin < MIN_MARGIN:
        return f"head_dim {cfg.head_dim}'s RoPE frequencies do not separate lags over {max_len} positions"
    return None


def lag_of_head(head: int) -> int:
    return 1 + head % MAX_LAG


def qk_columns(cfg: ModelConfig, max_len: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(q column [num_heads * D], k column [num_kv_heads * D], q/k-norm weight): what q_proj and
    k_proj put in column 0 (unit pair amplitude), and the RMSNorm weight that scales them."""
    d, half = cfg.head_dim, cfg.head_dim // 2
    theta = rope_inv_freq(cfg).double()
    k_head = torch.zeros(d, dtype=torch.float64)
    k_head[:half] = 1.0  # pairs (1, 0)
    q = torch.zeros(cfg.num_heads, d, dtype=torch.float64)
    for h in range(cfg.num_heads):  # k's pairs rotated back by lag x theta: q.k peaks `lag` tokens back
        angle = lag_of_head(h) * theta
        q[h, :half], q[h, half:] = angle.cos(), -angle.sin()
    margin = score_margin_per_unit(cfg, max_len)  # decisive_reason() has refused the models this cannot build
    # score = (pair amplitude)^2 x sum of cosines / sqrt(D); q/k-norm makes each pair's amplitude
    # sqrt(2) x its weight, without it the amplitude is the column entry x the normed dimension 0.
    amplitude_sq = SCORE_MARGIN * math.sqrt(d) / margin
    return q.reshape(-1), k_head.repeat(cfg.num_kv_heads), amplitude_sq


def decisive_weights(cfg: ModelConfig, names_shapes: list[tuple[str, tuple]], seed: int, max_len: int):
    """Yield (name, full tensor in float32) for every parameter, drawn in `names_shapes` order."""
    if why := decisive_reason(cfg, max_len):
        raise ValueError(f"decisive weights: {why}")
    gen = torch.Generator().manual_seed(seed)
    q_col, k_col, amplitude_sq = qk_columns(cfg, max_len)
    hidden = cfg.hidden_size
    constant = ALPHA * STD * math.sqrt(hidden)
    # After an RMSNorm dimension 0 is sqrt(hidden) x ALPHA / sqrt(ALPHA^2 + (residual / embedding norm)^2).
    dim0 = math.sqrt(hidden) * ALPHA / math.sqrt(ALPHA**2 + 1)
    qk_scale = 2 * math.sqrt(amplitude_sq) / dim0  # x2 (x4 on scores): room for the residual to grow
    for name, shape in names_shapes:
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            yield name, torch.full(shape, math.sqrt(amplitude_sq / 2))
        elif name.endswith("norm.weight"):
            yield name, torch.ones(shape)
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            w = torch.zeros(shape)
            w[:, 0] = (q_col if "q_proj" in name else k_col).float() * (1.0 if cfg.qk_norm else qk_scale)
            yield name, w
        elif name.endswith(("q_proj.bias", "k_proj.bias")):
            yield name, torch.zeros(shape)
        else:
            w = torch.empty(shape).normal_(0.0, STD, generator=gen)
            if name.endswith("embed_tokens.weight"):
                w[:, 0] = constant
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                w[0] = 0.0  # nothing writes to the constant dimension
            elif w.dim() == 2 and w.shape[1] == hidden:
                w[:, 0] = 0.0  # values, MLP inputs and the LM head ignore it
            yield name, w
