"""Tensor parallelism (Megatron-style, as vLLM and nano-vllm shard Llama): which slice of each
weight a rank holds, and the two collectives the model needs.

Column-parallel: q/k/v (by heads) and gate/up (by intermediate rows). Row-parallel, followed by
an all-reduce: o_proj and down_proj. Vocab-parallel: the embedding (masked lookup, all-reduce)
and the LM head (local vocabulary slice, gathered on rank 0). With fewer KV heads than ranks,
each KV head is replicated on tp / num_kv_heads ranks, as in vLLM. Norms are replicated."""

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
        if problems:
            raise ValueError(f"tensor_parallel_size={n} does not divide the model's {', '.join(problems)}")


NO_TP = TPShard()  # a single process holding the whole model


def shard_param(param: torch.nn.Parameter, dim: int, start: int, length: int, full_size: int) -> None:
    """Mark `param` as rows [start, start + length) along `dim` of a full tensor `full_size` long."""
    full_shape = list(param.shape)
    full_shape[dim] = full_size
    param.tp_slice = (dim, start, length, tuple(full_shape))


def full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    """The checkpoint's shape of this (possibly sharded) parameter."""
    return param.tp_slice[3] if hasattr(param, "tp_slice") else tuple(param.shape)


def local_part(param: torch.nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full`, a tensor of the checkpoint's shape."""
    if not hasattr(param, "tp_slice"):
        return full
    dim, start, length, _ = param.tp_slice
    return full.narrow(dim, start, length)


def all_reduce(x: torch.Tensor, tp: TPShard) -> torch.Tensor:
    """Sum of the ranks' partial results (in place); the identity without parallelism."""
    if tp.size > 1:
        dist.all_reduce(x)
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
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[..., :vocab_size]
    parts = [torch.empty_like(logits) for _ in range(tp.size)] if tp.rank == 0 else None
    dist.gather(logits.contiguous(), parts, dst=0)
    return torch.cat(parts, dim=-1)[..., :vocab_size] if tp.rank == 0 else None
