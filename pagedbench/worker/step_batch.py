"""A step's inputs: the host arrays of one flat, unpadded token batch (StepBatch, built from
the scheduled sequences with numpy) and their device copies with the step's AttentionMetadata
(StepInputs), built once per step and shared by every layer."""

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from pagedbench.backends.base import AttentionMetadata
from pagedbench.backends.cascade import CascadeCounts, CascadePlan, plan_cascade
from pagedbench.device.transfer import to_device, to_device_packed

# Async scheduling: a token the previous step sampled on the device, not yet known to the host; its
# input position takes that token on the device (StepInputs.fill_placeholders).
PLACEHOLDER = -1


class ScheduledSequence(Protocol):
    """What a step batch reads of a scheduled sequence (the engine's Sequence)."""

    token_ids: list[int]
    spec_token_ids: list[int]  # proposed tokens after token_ids, run this step to verify them
    block_table: list[int]
    num_computed_tokens: int
    prompt_token_ids: list[int]
    prompt_logprobs: list | None
    params: object  # its SamplingParams (prompt_logprobs) or BeamSearchParams

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    logits_indices: torch.Tensor  # [S + D + P] each sampling sequence's last token (and verified ones), prompt rows
    metadata: AttentionMetadata
    batch: "StepBatch"  # the host arrays these were copied from (and the rows' meaning)
    graph: int | None = None  # the CUDA-graph bucket whose static inputs these are (None: eager)

    def fill_placeholders(self, positions: np.ndarray, tokens: torch.Tensor, rows: np.ndarray) -> None:
        """Input `positions` (PLACEHOLDERs) take the previous step's sampled `tokens[rows]`, on the device."""
        device = self.input_ids.device
        self.input_ids[to_device(positions, device)] = tokens[to_device(rows, device)]


@dataclass(slots=True)
class StepBatch:
    """A step's inputs as host arrays: what rank 0 sends to the other tensor-parallel ranks."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [S + 1] int64
    seq_lens: np.ndarray  # [S] int64
    context_lens: np.ndarray  # [S] int64
    block_table: np.ndarray  # [S, max_blocks] int32
    slot_mapping: np.ndarray  # [T] int64
    token_seq_idx: np.ndarray  # [T] int64
    logits_indices: np.ndarray  # [S' + D + P] int64
    sampling_rows: list[int]  # which scheduled sequences sample this step (their prefill is complete)
    # (scheduled sequence, first position, count): logits rows S'.. that give prompt_logprobs
    prompt_logprob_rows: list[tuple[int, int, int]]
    block_size: int
    num_cache_blocks: int
    # per sampling row: proposed tokens it verifies (its logits rows are 1 + that many, in order)
    num_spec: list[int] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)  # [S] hybrid models: each sequence's state slot
    # [S] hybrid models: (rows of the sequence's chunk after which, snapshot slot) its state is copied to
    state_snapshots: list[list[tuple[int, int]]] = field(default_factory=list)
    cascade: CascadePlan | None = None  # groups sharing leading pages (backends/cascade.py), None: flat

    @property
    def placeholder_positions(self) -> np.ndarray:
        """Input positions whose token the previous step is still sampling (async scheduling)."""
        return np.flatnonzero(self.input_ids == PLACEHOLDER)

    @property
    def num_sampling_logits(self) -> int:
        """Logits rows of the sampling sequences (before the prompt-logprob rows)."""
        return len(self.sampling_rows) + sum(self.num_spec)

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
            cascade=self.cascade,
        )
        return StepInputs(input_ids=input_ids, logits_indices=logits_indices, metadata=meta, batch=self)


def step_batch(
    seqs: list[ScheduledSequence],
    num_new: list[int],
    block_size: int,
    num_cache_blocks: int,
    tables: "BlockTables | None" = None,
) -> StepBatch:
    """Flat host inputs for running `num_new[i]` more tokens of `seqs[i]` (decodes first); `tables`:
    the worker's persistent block table (else each sequence's page list is copied whole)."""
    computed = [s.num_computed_tokens for s in seqs]
    context = np.array(computed, dtype=np.int64)
    q_lens = np.array(num_new, dtype=np.int64)
    seq_lens = context + q_lens
    qsl = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=qsl[1:])
    num_tokens = int(qsl[-1])
    token_seq = np.repeat(np.arange(len(seqs)), q_lens)
    positions = np.arange(num_tokens) - qsl[token_seq] + context[token_seq]
    input_ids = np.fromiter(
        (t for s, c, n in zip(seqs, computed, num_new) for t in _new_tokens(s, c, n)), dtype=np.int64, count=num_tokens
    )
    max_blocks = -(-int(seq_lens.max()) // block_size)
    block_table = copy_block_tables(seqs, max_blocks) if tables is None else tables.gather(seqs, max_blocks)
    # Pages a sliding window released (-1) point at the padding page, the cache's last: no backend
    # reads a key outside the window, and a gather-based one masks what it reads there.
    block_table[block_table < 0] = num_cache_blocks - 1
    # Cascade groups from the persistent table's setting (the engine's cascade_attention; none without it).
    cascade = None if tables is None else tables.plan_cascade(block_table, context, q_lens, block_size)
    slot_mapping = (
        block_table[token_seq, positions // block_size].astype(np.int64) * block_size + positions % block_size
    )
    total = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=len(seqs))
    sampling = np.flatnonzero(seq_lens >= total)  # rows that reach their last token: they sample
    sampling_rows, num_spec = sampling.tolist(), (seq_lens[sampling] - total[sampling]).tolist()
    if any(num_spec):  # a verifying sequence's rows: its last token and each proposed one
        logits_indices = [
            np.concatenate([np.arange(qsl[i + 1] - 1 - m, qsl[i + 1]) for i, m in zip(sampling_rows, num_spec)])
        ]
    else:
        logits_indices = [qsl[1:][sampling_rows] - 1]
    prompt_logprob_rows = []
    for i, s in enumerate(seqs):  # positions p < P - 1 predict prompt token p + 1
        if getattr(s.params, "prompt_logprobs", None) is not None:
            first = max(int(context[i]), len(s.prompt_logprobs or ()))  # not again after a preemption
            last = min(int(seq_lens[i]), s.num_prompt_tokens - 1)
            if last > first:
                prompt_logprob_rows.append((i, first, last - first))
                logits_indices.append(qsl[i] + np.arange(first, last) - context[i])
    return StepBatch(
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
        num_spec=num_spec,
        state_slots=[getattr(s, "state_slot", -1) for s in seqs],
        state_snapshots=[
            [(boundary - int(context[i]), slot) for boundary, slot in getattr(s, "state_snapshots", ())]
            for i, s in enumerate(seqs)
        ],
        prompt_logprob_rows=prompt_logprob_rows,
        block_size=block_size,
        num_cache_blocks=num_cache_blocks,
        cascade=cascade,
    )


def copy_block_tables(seqs: list[ScheduledSequence], max_blocks: int) -> np.ndarray:
    """[S, max_blocks] int32: each sequence's first `max_blocks` pages, 0 after its last."""
    block_table = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    for i, s in enumerate(seqs):  # (a draft's view holds pages beyond what it reads: the proposals')
        pages = s.block_table[:max_blocks]
        block_table[i, : len(pages)] = pages
    return block_table


class BlockTables:
    """The worker's persistent block table (as vLLM's v1 worker keeps one): a row per sequence laid
    out, kept across steps. A step writes only what changed in a sequence's page list: the pages
    appended since its last step, or the whole row when the block manager changed the list in place
    or replaced it (`Sequence.block_table_version`, or another list object); then it gathers its
    sequences' rows into a fresh array (async scheduling reads a step's arrays later). When rows run
    out, those of the sequences the step does not run are freed (and, if that frees a quarter or fewer
    of them, the rows double)."""

    def __init__(self, rows: int = 64, width: int = 16):
        self.table = np.zeros((rows, width), dtype=np.int32)  # row r: 0 after its first length[r] entries
        self.row_of: dict[int, int] = {}  # id(sequence) -> its row
        self.owner: list = [None] * rows  # the row's sequence (held, so that its id names no other)
        self.pages: list = [None] * rows  # the page list written there
        self.version: list = [None] * rows  # that list's block_table_version when written
        self.length = [0] * rows
        self.free = list(range(rows - 1, -1, -1))
        self.cascade: bool | None = None  # EngineConfig.cascade_attention as the engine resolved it (cascade_setting)
        self.cascade_counts = CascadeCounts()

    def plan_cascade(self, table: np.ndarray, context: np.ndarray, q_lens: np.ndarray, block_size: int):
        """The step's cascade plan from its gathered rows (None: flat), counted for the reports."""
        plan = plan_cascade(self.cascade, table, context, q_lens, block_size)
        self.cascade_counts.add(plan, context + q_lens, q_lens)
        return plan

    def gather(self, seqs: list[ScheduledSequence], max_blocks: int) -> np.ndarray:
        """[S, max_blocks] int32, as copy_block_tables, from rows brought up to date."""
        rows = [self._update(s, seqs) for s in seqs]
        if max_blocks > self.table.shape[1]:
            self._widen(max_blocks)
        return self.table[rows, :max_blocks]  # fancy indexing: a copy, never a view

    def _update(self, seq: ScheduledSequence, step: list[ScheduledSequence]) -> int:
        row = self.row_of.get(id(seq))
        if row is None:
            row = self._take(seq, step)
        pages, written = seq.block_table, self.length[row]
        version = getattr(seq, "block_table_version", None)  # None (a draft's view): rewritten every step
        if pages is self.pages[row] and version is not None and version == self.version[row] and len(pages) >= written:
            if len(pages) > written:  # the common case: pages appended
                self._write(row, written, pages[written:])
        else:
            self._write(row, 0, pages)
            self.table[row, len(pages) : written] = 0
            self.pages[row], self.version[row] = pages, version
        self.length[row] = len(pages)
        return row

    def _write(self, row: int, start: int, pages: list[int]) -> None:
        end = start + len(pages)
        if end > self.table.shape[1]:
            self._widen(end)
        self.table[row, start:end] = pages

    def _take(self, seq: ScheduledSequence, step: list[ScheduledSequence]) -> int:
        if not self.free:
            self._sweep({id(s) for s in step})
            if 4 * len(self.free) <= len(self.owner):  # sweeps stay rare: one per quarter of the rows taken
                self._add_rows()
        row = self.free.pop()
        self.row_of[id(seq)], self.owner[row] = row, seq
        return row

    def _sweep(self, running: set[int]) -> None:
        """Free the rows of sequences not in the step (`running`: their ids): finished or preempted ones."""
        for row, seq in enumerate(self.owner):
            if seq is not None and id(seq) not in running:
                self.table[row, : self.length[row]] = 0
                del self.row_of[id(seq)]
                self.owner[row] = self.pages[row] = self.version[row] = None
                self.length[row] = 0
                self.free.append(row)

    def _add_rows(self) -> None:
        rows = len(self.owner)
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        for column in (self.owner, self.pages, self.version):
            column.extend([None] * rows)
        self.length.extend([0] * rows)
        self.free.extend(range(2 * rows - 1, rows - 1, -1))

    def _widen(self, width: int) -> None:
        rows, current = self.table.shape
        self.table = np.pad(self.table, ((0, 0), (0, max(width, 2 * current) - current)))


def _new_tokens(seq: ScheduledSequence, computed: int, n: int):
    """The `n` tokens of `seq` the step runs after its first `computed` (a decode's one read in place)."""
    ids = seq.token_ids
    if n == 1 and computed < len(ids):
        return (ids[computed],)
    return _tokens(seq, computed + n)[computed : computed + n]


def _tokens(seq: ScheduledSequence, end: int) -> list[int]:
    """`seq`'s tokens up to `end`, its proposed ones included when the step verifies them."""
    return seq.token_ids if end <= len(seq.token_ids) else seq.token_ids + seq.spec_token_ids


def build_step_inputs(
    seqs: list[ScheduledSequence], num_new: list[int], block_size: int, num_cache_blocks: int, device: torch.device
) -> StepInputs:
    """Flat inputs and AttentionMetadata for running `num_new[i]` more tokens of `seqs[i]`
    (decodes first). Host-side numpy, then one copy per tensor: no device sync."""
    return step_batch(seqs, num_new, block_size, num_cache_blocks).to(device)
