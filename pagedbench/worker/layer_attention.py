"""The attention backends of a model's layers: one backend instance per distinct AttentionVariant
(e.g. Gemma 2's sliding-window and global layers), each planned once per step and shared by
every layer of its variant."""

from dataclasses import dataclass

import torch

from pagedbench.backends.base import PLAIN, AttentionBackend, AttentionMetadata, AttentionVariant
from pagedbench.backends.registry import resolve
from pagedbench.model.config import ModelConfig
from pagedbench.model.parallel import NO_TP, TPShard


@dataclass(slots=True)
class LayerStates:
    """One step's backend state per layer (layers of one variant share the same object)."""

    backends: list[AttentionBackend]
    states: list


class LayerAttention:
    """Per-layer backends that look, to the rest of the worker, like the one backend of a plain
    model: `plan` plans every distinct backend's step once; `primary` (the first layer's)
    answers for the name, CUDA-graph settings and diagnostics."""

    def __init__(self, layer_backends: list[AttentionBackend]):
        self.layer_backends = layer_backends
        self.distinct = list({id(b): b for b in layer_backends}.values())
        self.primary = layer_backends[0]

    @classmethod
    def uniform(cls, backend: AttentionBackend, num_layers: int) -> "LayerAttention":
        return cls([backend] * num_layers)

    def plan(self, meta: AttentionMetadata) -> LayerStates:
        states = {id(b): b.plan(meta) for b in self.distinct}
        return LayerStates(self.layer_backends, [states[id(b)] for b in self.layer_backends])

    @property
    def compile_seconds(self) -> float:
        return sum(b.compile_seconds for b in self.distinct)

    @property
    def cuda_graph_reason(self) -> str | None:
        return next((b.cuda_graph_reason for b in self.distinct if b.cuda_graph_reason), None)

    def __getattr__(self, name):  # name, num_kv_heads, cuda_graph_powers_of_two, tile_efficiency, ...
        return getattr(self.primary, name)


def build_layer_attention(
    name: str,
    cfg: ModelConfig,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    tp: TPShard = NO_TP,
    kv_cache_dtype: str = "auto",
    batch_invariant: bool = False,
) -> LayerAttention:
    """Backend `name` for this rank's heads and each of the model's layer variants, reading pages
    stored as `kv_cache_dtype` (in its batch-invariant form with `batch_invariant`), or a ValueError
    saying why it cannot run one of them here."""
    num_heads, num_kv_heads = tp.local_heads(cfg)
    d = cfg.head_dim
    built: dict[AttentionVariant, AttentionBackend] = {}
    for variant in cfg.layer_variants():
        if variant in built:
            continue
        found = resolve(
            name, device, dtype, d, block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
            kv_cache_dtype=kv_cache_dtype, **variant.settings(),
        )  # fmt: skip
        if not found.runnable:
            what = "" if variant == PLAIN else f" for the model's {variant} layers"
            raise ValueError(f"backend {name!r} is unavailable here{what}: {found.reason}")
        extra = {} if variant == PLAIN else {"variant": variant}  # backends that predate variants take none
        if batch_invariant:
            why = found.cls.batch_invariance(device, batch_invariant=True, dtype=dtype, head_dim=d,
                                             block_size=block_size, **variant.settings())  # fmt: skip
            if why:
                raise ValueError(f"backend {name!r} cannot run batch_invariant: {why}")
            extra["batch_invariant"] = True
        built[variant] = found.cls(num_heads, num_kv_heads, d, cfg.attention_scale, block_size, device, dtype, **extra)
    return LayerAttention([built[v] for v in cfg.layer_variants()])
