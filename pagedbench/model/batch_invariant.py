"""batch_invariant's GEMMs: every dense projection (F.linear, nn.Linear, the LM head) over the token
rows in fixed tiles of ROW_TILE rows, the last one zero-padded, so that a row's result never depends
on how many rows its step had. Measured on CPU (docs/correctness.md): torch's fp32 matmul gives one
row a different result at M=1 than at M=7, 64 or 256 (a GEMV path, and threads split by shape),
while a fixed M gives each row the same bits whatever row it is and whatever its neighbours are."""

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROW_TILE = 16  # rows per GEMM: small enough that a decode step of one sequence pads little


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over x's rows ([T, in] or [..., in]) in tiles of ROW_TILE rows, bitwise batch-invariant."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    padded = -(-n // ROW_TILE) * ROW_TILE
    if padded != n:
        rows = torch.cat([rows, rows.new_zeros(padded - n, rows.shape[1])])
    out = torch.cat([F.linear(rows[i : i + ROW_TILE], weight, bias) for i in range(0, padded, ROW_TILE)])
    return out[:n].reshape(*x.shape[:-1], weight.shape[0])


class BatchInvariantGemms(TorchFunctionMode):
    """F.linear calls inside it run as tiled_linear (attention backends' own matmuls are untouched)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:  # the mode is off inside its own handler: tiled_linear's calls run plain
            return tiled_linear(*args, **kwargs)
        return func(*args, **kwargs)


def unsupported_reason(cfg) -> str | None:
    """Why batch_invariant cannot hold a model's forward to it (GEMMs it does not tile), or None."""
    parts = {
        "mixture-of-experts layers (grouped expert GEMMs)": cfg.moe is not None,
        "latent attention (its einsum up-projections)": cfg.mla is not None,
        "a sparse-attention indexer": cfg.indexer is not None,
        "gated DeltaNet layers (chunked delta rule)": cfg.linear is not None,
    }
    found = [name for name, present in parts.items() if present]
    return f"batch_invariant tiles dense models' GEMMs only; this model has {', '.join(found)}" if found else None
