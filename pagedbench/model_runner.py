"""Owns the model, the paged KV cache and the backend; turns a SchedulerOutput into one
flat token batch plus its AttentionMetadata, built once per step."""

import functools
from dataclasses import dataclass

import numpy as np
import torch

from pagedbench.backends.base import AttentionBackend, AttentionMetadata, to_device
from pagedbench.backends.registry import resolve
from pagedbench.config import ModelConfig
from pagedbench.model import AttentionContext, CausalLM
from pagedbench.parallel import NO_TP, TPShard
from pagedbench.scheduler import SchedulerOutput
from pagedbench.sequence import Sequence


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    logits_indices: torch.Tensor  # [S + P] last scheduled token of each sequence that samples, then prompt rows
    metadata: AttentionMetadata
    plan: "StepPlan"  # the host arrays these were copied from (and the rows' meaning)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, tp: TPShard = NO_TP) -> int:
    """K and V of one page in every layer, on one tensor-parallel rank."""
    return 2 * cfg.num_layers * block_size * tp.local_heads(cfg)[1] * cfg.head_dim * dtype.itemsize


def build_backend(
    name: str, cfg: ModelConfig, block_size: int, device: torch.device, dtype: torch.dtype, tp: TPShard = NO_TP
) -> AttentionBackend:
    """Backend `name` for this rank's heads, or a ValueError saying why it cannot run here."""
    num_heads, num_kv_heads = tp.local_heads(cfg)
    d = cfg.head_dim
    found = resolve(name, device, dtype, d, block_size, num_heads=num_heads, num_kv_heads=num_kv_heads)
    if not found.runnable:
        raise ValueError(f"backend {name!r} is unavailable here: {found.reason}")
    return found.cls(num_heads, num_kv_heads, d, d**-0.5, block_size, device, dtype)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        num_cpu_blocks: int = 0,
    ):
        cfg = model.config
        self.model, self.backend = model, backend
        self.block_size, self.device = block_size, device
        # One allocation; each layer's K and V are views [num_blocks, block_size, H_kv, D] (this rank's KV heads).
        self.kv_cache = torch.zeros(
            cfg.num_layers, 2, num_blocks, block_size, backend.num_kv_heads, cfg.head_dim, device=device, dtype=dtype
        )
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)]
        # Swap space: the same layout in (pinned, on CUDA) CPU memory.
        self.cpu_kv_cache = torch.zeros(
            (*self.kv_cache.shape[:2], num_cpu_blocks, *self.kv_cache.shape[3:]),
            dtype=dtype,
            pin_memory=device.type == "cuda" and num_cpu_blocks > 0,
        )

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: K/V of block src -> block dst in every layer (reads happen before writes)."""
        src, dst = (torch.tensor(c, device=self.device) for c in zip(*copies))
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """K/V of device block -> CPU block, every layer."""
        device_blocks, cpu_blocks = (torch.tensor(c) for c in zip(*pairs))
        self.cpu_kv_cache[:, :, cpu_blocks] = self.kv_cache[:, :, device_blocks.to(self.device)].cpu()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """K/V of CPU block -> device block, every layer."""
        cpu_blocks, device_blocks = (torch.tensor(c) for c in zip(*pairs))
        self.kv_cache[:, :, device_blocks.to(self.device)] = self.cpu_kv_cache[:, :, cpu_blocks].to(self.device)

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        return prepare_step(sched.seqs, sched.num_tokens, self.block_size, self.kv_cache.shape[2], self.device)

    def run_plan(self, plan: "StepPlan") -> torch.Tensor | None:
        """A whole step from its host arrays (what a tensor-parallel worker does)."""
        inputs = plan.to(self.device)
        return self.run(inputs, self.backend.prepare(inputs.metadata))

    def run(self, inputs: StepInputs, backend_state) -> torch.Tensor | None:
        """fp32 logits [len(logits_indices), vocab] (None on tensor-parallel ranks other than 0)."""
        ctx = AttentionContext(self.backend, backend_state, inputs.metadata.slot_mapping, self.kv_caches)
        return self.model(inputs.input_ids, inputs.metadata.positions, ctx, inputs.logits_indices)


@dataclass(slots=True)
class StepPlan:
    """A step's inputs as host arrays: what rank 0 sends to the other tensor-parallel ranks."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [S + 1] int64
    seq_lens: np.ndarray  # [S] int64
    context_lens: np.ndarray  # [S] int64
    block_table: np.ndarray  # [S, max_blocks] int32
    slot_mapping: np.ndarray  # [T] int64
    token_seq_idx: np.ndarray  # [T] int64
    logits_indices: np.ndarray  # [S' + P] int64
    sampling_rows: list[int]  # which scheduled sequences sample this step (their prefill is complete)
    # (scheduled sequence, first position, count): logits rows S'.. that give prompt_logprobs
    prompt_logprob_rows: list[tuple[int, int, int]]
    block_size: int
    num_cache_blocks: int

    def to(self, device: torch.device) -> StepInputs:
        """One host-to-device copy per tensor; no device sync."""
        _to = functools.partial(to_device, device=device)
        q_lens = np.diff(self.query_start_loc)
        num_decodes = int((q_lens == 1).sum())
        num_tokens = len(self.input_ids)
        meta = AttentionMetadata(
            query_start_loc=_to(self.query_start_loc.astype(np.int32)),
            seq_lens=_to(self.seq_lens.astype(np.int32)),
            context_lens=_to(self.context_lens.astype(np.int32)),
            block_table=_to(self.block_table),
            slot_mapping=_to(self.slot_mapping),
            positions=_to(self.positions),
            token_seq_idx=_to(self.token_seq_idx.astype(np.int32)),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(self.seq_lens.max()),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            num_prefills=len(q_lens) - num_decodes,
            num_prefill_tokens=num_tokens - num_decodes,
            block_size=self.block_size,
            num_cache_blocks=self.num_cache_blocks,
            query_start_loc_cpu=self.query_start_loc.tolist(),
            seq_lens_cpu=self.seq_lens.tolist(),
            context_lens_cpu=self.context_lens.tolist(),
        )
        return StepInputs(
            input_ids=_to(self.input_ids),
            logits_indices=_to(self.logits_indices),
            metadata=meta,
            plan=self,
        )


def plan_step(seqs: list[Sequence], num_new: list[int], block_size: int, num_cache_blocks: int) -> StepPlan:
    """Flat host inputs for running `num_new[i]` more tokens of `seqs[i]` (decodes first)."""
    context = np.array([s.num_computed_tokens for s in seqs], dtype=np.int64)
    q_lens = np.array(num_new, dtype=np.int64)
    seq_lens = context + q_lens
    qsl = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=qsl[1:])
    num_tokens = int(qsl[-1])
    token_seq = np.repeat(np.arange(len(seqs)), q_lens)
    positions = np.arange(num_tokens) - qsl[token_seq] + context[token_seq]
    input_ids = np.fromiter(
        (t for s, c, n in zip(seqs, context, q_lens) for t in s.token_ids[c : c + n]), dtype=np.int64, count=num_tokens
    )
    max_blocks = -(-int(seq_lens.max()) // block_size)
    block_table = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    for i, s in enumerate(seqs):
        block_table[i, : len(s.block_table)] = s.block_table
    slot_mapping = (
        block_table[token_seq, positions // block_size].astype(np.int64) * block_size + positions % block_size
    )
    sampling_rows = [i for i, s in enumerate(seqs) if seq_lens[i] == s.num_tokens]
    logits_indices = [qsl[1:][sampling_rows] - 1]
    prompt_logprob_rows = []
    for i, s in enumerate(seqs):  # positions p < P - 1 predict prompt token p + 1
        if getattr(s.params, "prompt_logprobs", None) is not None:
            first = max(int(context[i]), len(s.prompt_logprobs or ()))  # not again after a preemption
            last = min(int(seq_lens[i]), s.num_prompt_tokens - 1)
            if last > first:
                prompt_logprob_rows.append((i, first, last - first))
                logits_indices.append(qsl[i] + np.arange(first, last) - context[i])
    return StepPlan(
        input_ids=input_ids,
        positions=positions,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        context_lens=context,
        block_table=block_table,
        slot_mapping=slot_mapping,
        token_seq_idx=token_seq,
        logits_indices=np.concatenate(logits_indices).astype(np.int64),
        sampling_rows=sampling_rows,
        prompt_logprob_rows=prompt_logprob_rows,
        block_size=block_size,
        num_cache_blocks=num_cache_blocks,
    )


def prepare_step(
    seqs: list[Sequence], num_new: list[int], block_size: int, num_cache_blocks: int, device: torch.device
) -> StepInputs:
    """Flat inputs and AttentionMetadata for running `num_new[i]` more tokens of `seqs[i]`
    (decodes first). Host-side numpy, then one copy per tensor: no device sync."""
    return plan_step(seqs, num_new, block_size, num_cache_blocks).to(device)
