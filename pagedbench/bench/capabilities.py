"""What each backend can run here: one row per backend (and its provider), one column per feature,
each cell ✓ or the short reason it cannot. Every cell comes from the backend's own
`unavailable_reason` (or its CUDA-graph reason), the same answer `check`, `compare` and the
engine act on, so the table cannot promise what they would skip."""

import pandas as pd
import torch

from pagedbench.backends.base import AttentionVariant
from pagedbench.backends.registry import get_backend, list_backends, probe
from pagedbench.device.dtypes import dtype_name

YES = "✓"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_SIZES = (1, 8, 16, 32, 128, 256)
HEAD_DIMS = (64, 80, 96, 128, 256)
# The variant a feature column asks for (check's VARIANTS use the same kinds).
VARIANT_FEATURES = {
    "sliding window": AttentionVariant(sliding_window=4096),
    "soft-cap": AttentionVariant(softcap=50.0),
    "sinks": AttentionVariant(sinks=True),
    "sinks + window": AttentionVariant(sliding_window=128, sinks=True),  # gpt-oss's windowed layers
}
# What the backend contract requires of every backend (check's multi-token decode and shared-prefix
# cases hold each one to it): no backend may opt out, so these cells are the contract's, not a probe's.
CONTRACT_FEATURES = ("multi-token decode", "shared pages")
KV_PAGES = ("fp8_e4m3", "fp8_e5m2", "int8")  # kv_cache_dtype values a backend may read
# Latent attention (MLA) as DeepSeek-V3 decodes it, absorbed: 128 query heads of 512 + 64 against one
# latent "KV head" whose first 512 dims are the values, whatever the row's base head_dim.
LATENT_FEATURE = "latent attention (MLA)"
LATENT_SHAPE = dict(head_dim=576, num_heads=128, num_kv_heads=1, **AttentionVariant(value_dim=512).settings())
# DeepSeek-V3.2's sparse attention: that latent cache, each query reading the 2,048 slots an indexer picked.
SPARSE_FEATURE = "sparse (top-k)"
SPARSE_SHAPE = LATENT_SHAPE | AttentionVariant(value_dim=512, topk=2048).settings()
CASCADE_FEATURE = "cascade"  # cascade_attention=True: a group's shared prefix read once (check's cascade cases)


def variant_columns(variant: AttentionVariant) -> list[str]:
    """The feature columns a variant exercises."""
    asked = variant.settings()
    columns = [f for f, v in VARIANT_FEATURES.items() if all(asked[k] for k, on in v.settings().items() if on)]
    columns += [LATENT_FEATURE] if variant.value_dim is not None else []
    return columns + ([SPARSE_FEATURE] if variant.topk is not None else [])


def short(reason: str) -> str:
    """A reason's first clause, for a table cell."""
    return reason.split(";")[0].strip()


LISTED_COLUMNS = ("dtypes", "KV block sizes", "head dims", "quantized KV")  # the values a backend runs, else why not


def _listed(values, reason_of, label=str) -> str:
    """The values the backend runs, or the first one's reason when it runs none."""
    reasons = {value: reason_of(value) for value in values}
    ok = [label(v) for v, why in reasons.items() if why is None]
    return ", ".join(ok) if ok else short(next(iter(reasons.values())))


def capability_row(name: str, device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int) -> dict:
    """The table's row of backend `name` around one base setting (device, dtype, head_dim, block_size)."""
    cls = get_backend(name)

    def reason(**change) -> str | None:
        settings = dict(device=device, dtype=dtype, head_dim=head_dim, block_size=block_size) | change
        return probe(cls, **settings)[1]

    base = reason()
    row = {"backend": name, "provider": probe(cls, device, dtype, head_dim, block_size)[0]}
    row["dtypes"] = _listed(DTYPES, lambda d: reason(dtype=d), dtype_name)
    row["KV block sizes"] = _listed(BLOCK_SIZES, lambda b: reason(block_size=b))
    row["head dims"] = _listed(HEAD_DIMS, lambda d: reason(head_dim=d))
    for feature, variant in VARIANT_FEATURES.items():
        why = reason(**variant.settings())
        row[feature] = YES if why is None else short(why)
    for feature in CONTRACT_FEATURES:
        row[feature] = YES if base is None else short(base)
    why = reason(**LATENT_SHAPE)
    row[LATENT_FEATURE] = YES if why is None else short(why)
    why = reason(**SPARSE_SHAPE)
    row[SPARSE_FEATURE] = YES if why is None else short(why)
    why = reason(cascade_attention=True)  # shared prefixes read once per group (backends/cascade.py)
    row[CASCADE_FEATURE] = YES if why is None else short(why)
    row["quantized KV"] = _listed(KV_PAGES, lambda kv: reason(kv_cache_dtype=kv))
    # ✓: plan() refills static buffers and forward() has no host work (captured where there is CUDA).
    row["CUDA graphs"] = short(cls.cuda_graph_reason or base or "") or YES
    # ✓: each sequence's output bitwise the same in any batch, on any pages (check --determinism holds it).
    invariance = cls.batch_invariance(device, dtype=dtype, head_dim=head_dim, block_size=block_size)
    with_setting = cls.batch_invariance(device, batch_invariant=True, dtype=dtype, head_dim=head_dim,
                                        block_size=block_size)  # fmt: skip
    row["batch-invariant"] = short(invariance or base or "") or YES
    if invariance and not base and with_setting is None:  # EngineConfig.batch_invariant makes it so
        row["batch-invariant"] = f"{YES} with batch_invariant=True (else: {short(invariance)})"
    return row


def capability_table(device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int) -> pd.DataFrame:
    return pd.DataFrame([capability_row(name, device, dtype, head_dim, block_size) for name in list_backends()])
