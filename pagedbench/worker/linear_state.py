"""The linear-attention state of hybrid models, beside the paged KV cache: per linear layer and
state slot, the conv window (the last conv_kernel - 1 inputs of q/k/v, in the model's dtype) and
the recurrent state [value heads, key dim, value dim] (fp32, as the recurrence computes it). A
sequence holds one slot while it holds pages (the block manager hands them out); the step tells
each DeltaNet layer which slot each of its sequences reads and whether it continues a state."""

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedbench.model.config import ModelConfig
from pagedbench.model.parallel import NO_TP, TPShard, local_linear


@dataclass(slots=True)
class LinearStateCache:
    conv: dict[int, torch.Tensor]  # layer -> [slots, conv_dim, conv_kernel - 1]
    recurrent: dict[int, torch.Tensor]  # layer -> [slots, value heads, key dim, value dim] fp32
    kernel: str = "torch"  # the gated delta rule's kernel (EngineConfig.linear_attention_kernel; model/delta_rule.py)
    # Swapped-out sequences' states: the same layout in (pinned, on CUDA) CPU memory, slots numbered
    # after the device's.
    host_conv: dict[int, torch.Tensor] = field(default_factory=dict)
    host_recurrent: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def allocate(
        cls, cfg: ModelConfig, layers: list[int], num_slots: int, device, dtype, tp: TPShard = NO_TP, num_cpu_slots=0
    ) -> "LinearStateCache":
        lin = local_linear(cfg.linear, tp)  # this tensor-parallel rank's heads
        conv = (lin.conv_dim, lin.conv_kernel - 1)
        rec = (lin.num_value_heads, lin.key_head_dim, lin.value_head_dim)
        linear = [i for i in layers if cfg.is_linear_layer(i)]
        pin = torch.device(device).type == "cuda" and num_cpu_slots > 0

        def planes(n, shape, kind, where, pinned=False):
            return {i: torch.zeros((n, *shape), device=where, dtype=kind, pin_memory=pinned) for i in linear}

        return cls(
            planes(num_slots, conv, dtype, device),
            planes(num_slots, rec, torch.float32, device),
            host_conv=planes(num_cpu_slots, conv, dtype, "cpu", pin),
            host_recurrent=planes(num_cpu_slots, rec, torch.float32, "cpu", pin),
        )

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """State of slot src -> slot dst in every layer (a forked sample continues its parent's, a
        prefix hit resumes from a snapshot, a swapped sequence's state moves to a CPU slot and back):
        every source is read before any destination is written."""
        first = next(iter(self.conv.values()))
        num_device, device = first.shape[0], first.device
        src, dst = (torch.tensor(x) for x in zip(*pairs))
        src_on, dst_on = src < num_device, dst < num_device  # device slots, else host slots
        if src_on.all() and dst_on.all():  # forks and restores: one gather and scatter per tensor
            src, dst = src.to(device), dst.to(device)
            for t in (*self.conv.values(), *self.recurrent.values()):
                t[dst] = t[src]
            return
        src_dev, dst_dev = src_on.to(device), dst_on.to(device)
        read_dev, write_dev = src[src_on].to(device), dst[dst_on].to(device)
        read_host, write_host = src[~src_on] - num_device, dst[~dst_on] - num_device
        for states, host in ((self.conv, self.host_conv), (self.recurrent, self.host_recurrent)):
            for layer, t in states.items():
                h = host[layer]
                values = t.new_empty((len(pairs), *t.shape[1:]))  # every source, read first
                values[src_dev] = t[read_dev]
                values[~src_dev] = h[read_host].to(device)
                t[write_dev] = values[dst_dev]
                h[write_host] = values[~dst_dev].cpu()


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
    layout: Any = None  # the fla kernel's index tensors for this step, built by its first DeltaNet layer

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
