"""Flex's cascade prefix pass: the group's packed rows over the prefix, dense, with the log-sum-exp.

On CUDA compiled flex returns the log-sum-exp (`return_aux`). Compiled CPU flex cannot (torch 2.13:
"`return_lse` is not supported yet"), so on CPU the same flex call carries it out: one extra key, the
mean prefix key k̄, whose value is zero but for one extra channel, 1. That channel of the output is
a = e^s̄ / (Z + e^s̄) per row (s̄ = the row's scaled, capped score against k̄; Z = the sum of e^s over
the prefix), so lse = s̄ + log(1 - a) - log(a), and the prefix's own output is the other channels
/ (1 - a). Without a cap Z >= P e^s̄ (Jensen: s is linear in k), so a <= 1 / (P + 1) and 1 - a never
cancels; a group with a row where a underflows (its best score ~70 above the mean key's) or tops 1/2
(a cap) takes the exact two-call path instead: flex's output, and the log-sum-exp from one GEMM.
The CPU call's K/V are head-major copies and its BlockMask lists every block as full; without a
score_mod it skips flex's mask and score hooks (SKIP_MASK_SCORE). At 128 rows x 4096 keys, fp32, one
thread, each of the three halves the kernel's time against a plain call over the cache-layout view.
"""

from functools import lru_cache

import torch
from pagedbench.backends.base import cap_scores
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

SHARE_FLOOR = 1e-30  # the extra key's share below which its log-sum-exp loses precision (fp32 normals end ~1e-38)


def prefix_attention(qg, k, v, scale: float, softcap: float | None, score_mod, compiled: bool):
    """qg [1, H_kv, R, D] over k [P, H_kv, D], v [P, H_kv, D_v] (every key seen) -> (out [1, H_kv, R, D_v],
    lse [1, H_kv, R])."""
    keys, values = (x.permute(1, 0, 2)[None] for x in (k, v))
    if not compiled:
        return _with_lse(qg, keys, values, scale, score_mod)
    if qg.device.type == "cuda":
        return _with_lse_compiled(qg, keys, values, scale, score_mod)
    found = lse_from_extra_key(qg, k, v, scale, softcap, score_mod)
    if found is not None:
        return found
    out = _out_compiled(qg, keys, values, scale, score_mod, full_mask(qg.shape[2], k.shape[0], qg.device))
    return out, _lse_compiled(qg, keys, scale, softcap)


def lse_from_extra_key(qg, k, v, scale, softcap, score_mod):
    """(out, lse) from one compiled CPU flex call over the prefix and its mean key (module docstring),
    or None where a row's share of that key leaves its log-sum-exp imprecise."""
    (prefix, heads, _), value_dim = k.shape, v.shape[-1]
    mean_key = k.mean(0, dtype=torch.float32).to(k.dtype)
    # Head-major copies (the gather's one copy, transposed): the CPU kernel runs 2x faster on them.
    keys = k.new_empty(1, heads, prefix + 1, k.shape[-1])
    keys[0, :, :prefix] = k.transpose(0, 1)
    keys[0, :, prefix] = mean_key
    values = v.new_zeros(1, heads, prefix + 1, value_dim + 1)
    values[0, :, :prefix, :value_dim] = v.transpose(0, 1)
    values[0, :, prefix, value_dim] = 1
    out = _out_compiled(qg, keys, values, scale, score_mod, full_mask(qg.shape[2], prefix + 1, qg.device))
    share = out[..., value_dim].float()
    if not bool(((share >= SHARE_FLOOR) & (share <= 0.5)).all()):
        return None
    mean_score = cap_scores(torch.einsum("bhrd,hd->bhr", qg.float(), mean_key.float()) * scale, softcap)
    lse = mean_score + torch.log1p(-share) - torch.log(share)
    return (out[..., :value_dim].float() / (1 - share)[..., None]).to(qg.dtype), lse


@lru_cache(maxsize=64)  # a step's groups repeat their shapes in every layer
def full_mask(rows: int, keys: int, device: torch.device, block: int = 128) -> BlockMask:
    """A BlockMask over `rows` x `keys` whose every block is full: no mask_mod to run anywhere."""
    q_blocks, kv_blocks = -(-rows // block), -(-keys // block)
    none = torch.zeros(1, 1, q_blocks, dtype=torch.int32, device=device)
    every = torch.arange(kv_blocks, dtype=torch.int32, device=device).expand(1, 1, q_blocks, kv_blocks).contiguous()
    return BlockMask.from_kv_blocks(
        none, torch.zeros_like(every), none + kv_blocks, every, BLOCK_SIZE=block, seq_lengths=(rows, keys)
    )


def _with_lse(q, k, v, scale, score_mod):
    out, aux = flex_attention(q, k, v, score_mod, scale=scale, return_aux=AuxRequest(lse=True))
    return out, aux.lse


def _out(q, k, v, scale, score_mod, block_mask):
    # No score_mod: every key seen and nothing to change, so the CPU kernel may skip its hooks.
    options = {"SKIP_MASK_SCORE": True} if score_mod is None else None
    return flex_attention(q, k, v, score_mod, block_mask=block_mask, scale=scale, kernel_options=options)


def _lse(q, k, scale, softcap):
    """The log-sum-exp of q's scores over k [B, H, Q]: the exact fallback's GEMM."""
    return torch.logsumexp(cap_scores((q @ k.transpose(-1, -2)) * scale, softcap), dim=-1)


_with_lse_compiled = torch.compile(_with_lse, dynamic=True)  # CUDA: Triton flex returns the log-sum-exp
_out_compiled = torch.compile(_out, dynamic=True)
_lse_compiled = torch.compile(_lse, dynamic=True)
