"""Owns the model, the paged KV cache and the backend; turns a SchedulerOutput into one
flat token batch plus its AttentionMetadata, built once per step."""

import math
from dataclasses import dataclass

import numpy as np
import torch

from pagedbench.backends.base import AttentionBackend, AttentionMetadata, one_line
from pagedbench.backends.registry import resolve
from pagedbench.config import ModelConfig
from pagedbench.model import AttentionContext, CausalLM
from pagedbench.parallel import NO_TP, TPShard
from pagedbench.scheduler import SchedulerOutput
from pagedbench.sequence import Sequence
from pagedbench.transfer import to_device, to_device_packed, to_host


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    logits_indices: torch.Tensor  # [S + P] last scheduled token of each sequence that samples, then prompt rows
    metadata: AttentionMetadata
    plan: "StepPlan"  # the host arrays these were copied from (and the rows' meaning)
    graph: int | None = None  # the CUDA-graph bucket whose static inputs these are (None: eager)


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
        # One allocation; each layer's K and V are views [num_blocks + 1, block_size, H_kv, D] (this
        # rank's KV heads). The last page is the padding page: CUDA-graph padding rows write there.
        self.pad_block = num_blocks
        self.num_cache_blocks = num_blocks + 1
        self.graphs = None  # DecodeGraphs, once captured
        shape = (cfg.num_layers, 2, self.num_cache_blocks, block_size, backend.num_kv_heads, cfg.head_dim)
        try:
            self.kv_cache = torch.zeros(shape, device=device, dtype=dtype)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            gib = math.prod(shape) * dtype.itemsize / 2**30
            raise ValueError(
                f"cannot allocate a KV cache of {num_blocks} blocks ({gib:.1f} GiB) on {device}: {one_line(e)}"
            ) from None
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)]
        # Swap space: the same layout in (pinned, on CUDA) CPU memory.
        self.cpu_kv_cache = torch.zeros(
            (*self.kv_cache.shape[:2], num_cpu_blocks, *self.kv_cache.shape[3:]),
            dtype=dtype,
            pin_memory=device.type == "cuda" and num_cpu_blocks > 0,
        )

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: K/V of block src -> block dst in every layer (reads happen before writes)."""
        src, dst = to_device(np.array(copies, dtype=np.int64).T.copy(), self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """K/V of device block -> CPU block, every layer."""
        device_blocks, cpu_blocks = np.array(pairs, dtype=np.int64).T
        pages = self.kv_cache[:, :, to_device(device_blocks.copy(), self.device)]
        self.cpu_kv_cache[:, :, torch.from_numpy(cpu_blocks)] = to_host(pages)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """K/V of CPU block -> device block, every layer."""
        cpu_blocks, device_blocks = np.array(pairs, dtype=np.int64).T
        pages = to_device(self.cpu_kv_cache[:, :, torch.from_numpy(cpu_blocks)], self.device)
        self.kv_cache[:, :, to_device(device_blocks.copy(), self.device)] = pages

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        """The step's inputs on the device: a captured graph's static inputs for a decode step
        that fits one, else fresh tensors."""
        plan = plan_step(sched.seqs, sched.num_tokens, self.block_size, self.num_cache_blocks)
        bucket = self.graphs.bucket(plan) if self.graphs is not None else None
        return plan.to(self.device) if bucket is None else self.graphs.inputs(plan, bucket)

    def run_plan(self, plan: "StepPlan") -> torch.Tensor | None:
        """A whole step from its host arrays (what a tensor-parallel worker does)."""
        inputs = plan.to(self.device)
        return self.run(inputs, self.backend.prepare(inputs.metadata))

    def run(self, inputs: StepInputs, backend_state, timer=None) -> torch.Tensor | None:
        """fp32 logits [len(logits_indices), vocab] (None on tensor-parallel ranks other than 0);
        a graph's step returns its bucket's rows, the step's own first. `timer` (a DeviceTimer)
        times each layer's attention in eager steps."""
        if inputs.graph is not None:
            return self.graphs.replay(inputs)
        return self.run_eager(inputs, backend_state, timer)

    def run_eager(self, inputs: StepInputs, backend_state, timer=None) -> torch.Tensor | None:
        ctx = AttentionContext(self.backend, backend_state, inputs.metadata.slot_mapping, self.kv_caches, timer)
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

    def arrays(self) -> list[np.ndarray]:
        """What travels to the device: the int32 metadata, then the int64 token arrays."""
        i32 = (self.query_start_loc, self.seq_lens, self.context_lens, self.token_seq_idx)
        return [
            *(a.astype(np.int32) for a in i32),
            self.block_table,
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.logits_indices,
        ]

    def to(self, device: torch.device) -> StepInputs:
        """Two host-to-device copies (one per dtype); no device sync."""
        return self.inputs(to_device_packed(self.arrays(), device))

    def inputs(self, tensors: list[torch.Tensor]) -> StepInputs:
        """StepInputs from device copies of `arrays()`, in that order."""
        qsl, seq_lens, context_lens, token_seq_idx, block_table, input_ids, positions, slots, logits_indices = tensors
        q_lens = np.diff(self.query_start_loc)
        num_decodes = int((q_lens == 1).sum())
        num_tokens = len(self.input_ids)
        meta = AttentionMetadata(
            query_start_loc=qsl,
            seq_lens=seq_lens,
            context_lens=context_lens,
            block_table=block_table,
            slot_mapping=slots,
            positions=positions,
            token_seq_idx=token_seq_idx,
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
        return StepInputs(input_ids=input_ids, logits_indices=logits_indices, metadata=meta, plan=self)


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


def profile_activation_bytes(
    model: CausalLM,
    backend: AttentionBackend,
    num_tokens: int,
    num_logits: int,
    max_model_len: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> int:
    """Peak CUDA memory, beyond what is allocated before it, of one step of `num_tokens` prompt
    tokens (sequences of at most max_model_len) whose `num_logits` logits rows then go through
    the sampler with top-k and top-p (its sort is the largest temporary). What the KV cache
    must leave free; the small cache the step writes to is not counted."""
    from pagedbench.sampler import Sampler, SamplingBatch
    from pagedbench.sampling_params import SamplingParams

    seq_len = min(num_tokens, max_model_len)
    num_seqs = -(-num_tokens // seq_len)
    pages = -(-seq_len // block_size)
    runner = ModelRunner(model, backend, num_seqs * pages, block_size, device, dtype)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
    seqs = []
    for i in range(num_seqs):
        seq = Sequence(str(i), None, [0] * seq_len, params)
        seq.block_table = list(range(i * pages, (i + 1) * pages))
        seqs.append(seq)
    plan = plan_step(seqs, [seq_len] * num_seqs, block_size, runner.num_cache_blocks)
    plan.logits_indices = np.arange(num_logits, dtype=np.int64) % len(plan.input_ids)  # the sampler's rows
    sampling = SamplingBatch.from_seqs([seqs[i % num_seqs] for i in range(num_logits)], model.config.vocab_size, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    Sampler(device, seed=0)(runner.run_plan(plan), sampling)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del runner
    torch.cuda.empty_cache()
    return peak


def prepare_step(
    seqs: list[Sequence], num_new: list[int], block_size: int, num_cache_blocks: int, device: torch.device
) -> StepInputs:
    """Flat inputs and AttentionMetadata for running `num_new[i]` more tokens of `seqs[i]`
    (decodes first). Host-side numpy, then one copy per tensor: no device sync."""
    return plan_step(seqs, num_new, block_size, num_cache_blocks).to(device)
