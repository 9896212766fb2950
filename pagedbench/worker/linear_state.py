"""The linear-attention state of hybrid models, beside the paged KV cache: per linear layer and
state slot, the conv window (the last conv_kernel - 1 inputs of q/k/v, in the model's dtype) and
the recurrent state [value heads, key dim, value dim] (fp32, as the recurrence computes it). A
sequence holds one slot while it holds pages (the block manager hands them out); the step tells
each DeltaNet layer which slot each of its sequences reads and whether it continues a state."""

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from pagedbench.model.config import ModelConfig
from pagedbench.model.parallel import NO_TP, TPShard, local_linear


@dataclass(slots=True)
class LinearStateCache:
    conv: dict[int, torch.Tensor]  # layer -> [slots, conv_dim, conv_kernel - 1]
    recurrent: dict[int, torch.Tensor]  # layer -> [slots, value heads, key dim, value dim] fp32

    @classmethod
    def allocate(
        cls, cfg: ModelConfig, layers: list[int], num_slots: int, device, dtype, tp: TPShard = NO_TP
    ) -> "LinearStateCache":
        lin = local_linear(cfg.linear, tp)  # this tensor-parallel rank's heads
        conv = (num_slots, lin.conv_dim, lin.conv_kernel - 1)
        rec = (num_slots, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim)
        linear = [i for i in layers if cfg.is_linear_layer(i)]
        return cls(
            {i: torch.zeros(conv, device=device, dtype=dtype) for i in linear},
            {i: torch.zeros(rec, device=device, dtype=torch.float32) for i in linear},
        )

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """State of slot src -> slot dst in every layer (a forked sample continues its parent's)."""
        src, dst = (torch.tensor(x, device=next(iter(self.conv.values())).device) for x in zip(*pairs))
        for tensors in (self.conv, self.recurrent):
            for t in tensors.values():
                t[dst] = t[src]


def state_bytes_per_sequence(cfg: ModelConfig, dtype: torch.dtype, tp: TPShard = NO_TP) -> int:
    """What one sequence's slot holds across the linear layers (conv windows and fp32 recurrent
    states), on one tensor-parallel rank."""
    if cfg.linear is None:
        return 0
    lin = local_linear(cfg.linear, tp)
    per_layer = lin.conv_dim * (lin.conv_kernel - 1) * dtype.itemsize
    per_layer += lin.num_value_heads * lin.key_head_dim * lin.value_head_dim * 4
    return per_layer * sum(lin.layers)


@dataclass(slots=True)
class LinearStep:
    """One step's view of the state cache: each scheduled sequence's slot, its rows in the flat
    batch, whether it continues its state (it has computed tokens) or starts from zeros, and the
    snapshots (prefix caching) its chunk writes on the way."""

    cache: LinearStateCache
    slots: list[int]  # [S]
    query_start_loc: list[int]  # [S + 1]
    context_lens: list[int]  # [S]
    snapshots: list[list[tuple[int, int]]] = field(default_factory=list)  # [S] (rows of its chunk, slot)

    def segments(self) -> Iterator[tuple[int, int, int, bool, int | None]]:
        """(slot, first row, end row, continues, snapshot slot or None) for each run of rows a
        DeltaNet layer computes at once: a sequence's chunk, cut after each row its state is
        snapshotted at (that run's end state is copied to the snapshot slot)."""
        qsl = self.query_start_loc
        for i, slot in enumerate(self.slots):
            first, start = qsl[i], qsl[i]
            cuts = self.snapshots[i] if self.snapshots else []
            for rows, snapshot in [*cuts, (qsl[i + 1] - first, None)]:
                if first + rows > start:  # (the last cut may end the chunk)
                    yield slot, start, first + rows, start > first or self.context_lens[i] > 0, snapshot
                start = first + rows
