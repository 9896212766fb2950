"""Tensor parallelism (Megatron-style, as vLLM and nano-vllm shard Llama): which slice of each
weight a rank holds, and the two collectives the model needs.

Column-parallel: q/k/v (by heads) and gate/up (by intermediate rows). Row-parallel, followed by
an all-reduce: o_proj and down_proj. A hybrid model's DeltaNet layers split by key heads (each with
its value heads): q/k/v/z/b/a and the conv channels column-parallel, out_proj row-parallel, and
each rank keeps its heads' states. Vocab-parallel: the embedding (masked lookup, all-reduce)
and the LM head (local vocabulary slice, gathered on rank 0). With fewer KV heads than ranks,
each KV head is replicated on tp / num_kv_heads ranks, as in vLLM. Norms are replicated.

Pipeline parallelism (PPStage) gives each stage a contiguous run of layers; the first holds the
embedding, the last the final norm and the LM head. With both, a stage's tensor-parallel ranks
are their own group (`group_ranks`), and world rank = stage x tp + tensor-parallel rank."""

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedbench.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class TPShard:
    """This process's place in the tensor-parallel group (rank 0 of 1: no parallelism)."""

    rank: int = 0
    size: int = 1
    # Every rank gets the full logits and samples (torchrun's external launcher: every rank runs the
    # same engine and returns the same outputs); else rank 0 alone.
    logits_everywhere: bool = False
    # The world ranks of this rank's tensor-parallel group (a pipeline stage's); None: the whole world.
    group_ranks: tuple[int, ...] | None = None

    def chunk(self, n: int) -> tuple[int, int]:
        """(start, length) of this rank's contiguous part of n rows (the last part may be short)."""
        per = -(-n // self.size)
        start = min(self.rank * per, n)
        return start, min(per, n - start)

    def heads(self, num_heads: int) -> tuple[int, int]:
        return self.rank * num_heads // self.size, num_heads // self.size

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """Split when there are at least as many KV heads as ranks, else one replicated head."""
        if num_kv_heads >= self.size:
            return self.heads(num_kv_heads)
        return self.rank * num_kv_heads // self.size, 1

    def local_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(query heads, KV heads) this rank's attention backend sees."""
        return self.heads(cfg.num_heads)[1], self.kv_heads(cfg.num_kv_heads)[1]

    def validate(self, cfg: ModelConfig) -> None:
        n = self.size
        problems = []
        if cfg.num_heads % n:
            problems.append(f"num_attention_heads={cfg.num_heads}")
        if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
            problems.append(f"num_key_value_heads={cfg.num_kv_heads} (and is not a multiple of it)")
        if cfg.intermediate_size % n:
            problems.append(f"intermediate_size={cfg.intermediate_size}")
        if cfg.moe is not None and cfg.moe.intermediate_size % n:
            problems.append(f"each expert's intermediate size {cfg.moe.intermediate_size}")
        if cfg.linear is not None and cfg.linear.num_key_heads % n:
            problems.append(f"linear_num_key_heads={cfg.linear.num_key_heads}")
        if problems:
            raise ValueError(f"tensor_parallel_size={n} does not divide the model's {', '.join(problems)}")


NO_TP = TPShard()  # a single process holding the whole model


@dataclass(frozen=True, slots=True)
class PPStage:
    """Pipeline stage `index` of `size`: layers [start, end) of the model."""

    index: int = 0
    size: int = 1
    start: int = 0
    end: int | None = None  # None: to the last layer

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    def owns(self, layer: int) -> bool:
        return self.start <= layer and (self.end is None or layer < self.end)

    def layers(self, num_layers: int) -> range:
        return range(self.start, num_layers if self.end is None else self.end)


WHOLE_MODEL = PPStage()


def layer_partition(num_layers: int, size: int, partition: str | None = None) -> list[int]:
    """Layers per pipeline stage: `partition` ("4,4,3", vLLM's VLLM_PP_LAYER_PARTITION) or an even
    split, the remainder going to the last stages (the first also embeds, the last samples from
    the LM head: vLLM does the same)."""
    if size > num_layers:
        raise ValueError(f"pipeline_parallel_size={size} exceeds the model's {num_layers} layers")
    if partition is None:
        per, extra = divmod(num_layers, size)
        return [per + (i >= size - extra) for i in range(size)]
    try:
        counts = [int(n) for n in partition.split(",")]
    except ValueError:
        raise ValueError(f"pipeline_layer_partition must be comma-separated layer counts, got {partition!r}") from None
    if len(counts) != size or min(counts) < 1 or sum(counts) != num_layers:
        raise ValueError(
            f"pipeline_layer_partition {partition!r} must give {size} stages at least one layer each, "
            f"{num_layers} layers in all"
        )
    return counts


def pipeline_stage(index: int, counts: list[int]) -> PPStage:
    start = sum(counts[:index])
    return PPStage(index, len(counts), start, start + counts[index])


def placement(rank: int, tp_size: int, pp_size: int, num_layers: int, partition: str | None = None):
    """(TPShard, PPStage) of world rank `rank` = stage x tp_size + tensor-parallel rank."""
    tp_rank, stage = rank % tp_size, rank // tp_size
    group = tuple(range(stage * tp_size, (stage + 1) * tp_size)) if pp_size > 1 and tp_size > 1 else None
    counts = layer_partition(num_layers, pp_size, partition)
    return TPShard(tp_rank, tp_size, group_ranks=group), pipeline_stage(stage, counts)


_GROUPS: dict[tuple, object] = {}  # each stage's tensor-parallel group, and the logits' way back


LOGITS = ("logits",)  # the key of the group the last stage returns logits to rank 0 through


def form_stage_groups(tp_size: int, pp_size: int) -> None:
    """Every rank calls this once after joining the world: one group per stage's tensor-parallel
    ranks, and one that carries the logits back from the last stage to rank 0. On NCCL a group is
    its own communicator and stream, so rank 0's receive of step A's logits never queues behind
    its send of step B's hidden states (which the last stage takes only after sending A's)."""
    if pp_size > 1 and tp_size > 1:
        for stage in range(pp_size):
            ranks = tuple(range(stage * tp_size, (stage + 1) * tp_size))
            _GROUPS[ranks] = dist.new_group(list(ranks))
    if pp_size > 1:
        _GROUPS[LOGITS] = dist.new_group([0, (pp_size - 1) * tp_size])


def logits_group():
    """The group of rank 0 and the last stage's tensor-parallel rank 0 (pipeline parallelism)."""
    return _GROUPS[LOGITS]


def leave_stage_groups() -> None:
    _GROUPS.clear()  # destroyed with the world group


def _group(tp: TPShard):
    return None if tp.group_ranks is None else _GROUPS[tp.group_ranks]


def shard_param(param: torch.nn.Parameter, dim: int, start: int, length: int, full_size: int) -> None:
    """Mark `param` as rows [start, start + length) along `dim` of a full tensor `full_size` long."""
    full_shape = list(param.shape)
    full_shape[dim] = full_size
    param.tp_slice = (dim, start, length, tuple(full_shape))


def shard_param_parts(param: torch.nn.Parameter, dim: int, parts: list[tuple[int, int]], full_size: int) -> None:
    """Mark `param` as the (start, length) row ranges `parts` along `dim` of a full tensor, side by
    side: a rank's share of a merged projection (a DeltaNet layer's q | k | v rows)."""
    shard_param(param, dim, 0, param.shape[dim], full_size)
    param.tp_parts = parts


def full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    """The checkpoint's shape of this (possibly sharded) parameter."""
    return param.tp_slice[3] if hasattr(param, "tp_slice") else tuple(param.shape)


def local_part(param: torch.nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full`, a tensor of the checkpoint's shape."""
    if not hasattr(param, "tp_slice"):
        return full
    dim, start, length, _ = param.tp_slice
    if hasattr(param, "tp_parts"):
        return torch.cat([full.narrow(dim, s, n) for s, n in param.tp_parts], dim)
    return full.narrow(dim, start, length)


def local_linear(lin, tp: TPShard):
    """A hybrid model's LinearAttention as one rank holds it: its share of the key and value heads
    (value head i reads key head i // (value heads per key head), so a rank's are contiguous)."""
    return dataclasses.replace(
        lin, num_key_heads=tp.heads(lin.num_key_heads)[1], num_value_heads=tp.heads(lin.num_value_heads)[1]
    )


def all_reduce(x: torch.Tensor, tp: TPShard) -> torch.Tensor:
    """Sum of the ranks' partial results (in place); the identity without parallelism."""
    if tp.size > 1:
        dist.all_reduce(x, group=_group(tp))
    return x


def gather_vocab(logits: torch.Tensor, vocab_size: int, tp: TPShard) -> torch.Tensor | None:
    """Rank 0 (every rank with logits_everywhere): full logits [N, vocab] from every rank's slice
    [N, <= ceil(vocab / tp)]; others: None."""
    if tp.size == 1:
        return logits
    per = -(-vocab_size // tp.size)
    if logits.shape[-1] < per:  # the last rank's slice is short: pad so every rank sends one shape
        logits = torch.nn.functional.pad(logits, (0, per - logits.shape[-1]))
    if tp.logits_everywhere:
        parts = [torch.empty_like(logits) for _ in range(tp.size)]
        dist.all_gather(parts, logits.contiguous(), group=_group(tp))
        return torch.cat(parts, dim=-1)[..., :vocab_size]
    parts = [torch.empty_like(logits) for _ in range(tp.size)] if tp.rank == 0 else None
    dist.gather(logits.contiguous(), parts, dst=tp.group_ranks[0] if tp.group_ranks else 0, group=_group(tp))
    return torch.cat(parts, dim=-1)[..., :vocab_size] if tp.rank == 0 else None
