"""Scheduler: continuous batching under one token budget per step, with chunked prefill and
preemption. policy "fcfs": first come, first served; the newest is preempted first. policy
"priority" (vLLM's): the lowest `priority` value runs first (ties by arrival), the highest is
preempted first, and a waiting request that outranks a running one and cannot be admitted
preempts it. preemption_mode "recompute" frees a preempted sequence's pages; "swap" (vLLM v0's)
moves them to CPU swap space and back before any new request is admitted, and recomputes when
the swap space is full. A paused sequence (a beam waiting for its siblings' candidates) is not
scheduled; it keeps its pages unless they are all that stops a waiting sequence from running,
and waits in the queue without being readmitted until it resumes.

Under pipeline parallelism each request runs in one lane, and a step schedules one lane's
sequences (`schedule(lane)`): the other lanes' steps may be in flight, so their sequences are
neither scheduled nor preempted; pages and max_num_seqs are shared by every lane.

After the step, `update_from_output` applies what the model and the sampler produced (computed
tokens, appended tokens, rollback, stops, forks) through the scheduler's StepUpdate (step_update.py)."""

import sys
from collections import deque
from collections.abc import Callable

from pagedbench.engine.block_manager import BlockManager
from pagedbench.engine.output_processor import OutputProcessor
from pagedbench.engine.queue_order import QueueOrder
from pagedbench.engine.request import SequenceGroup
from pagedbench.engine.sequence import Sequence, SequenceStatus
from pagedbench.engine.stats import EngineStats
from pagedbench.engine.step_update import ModelRunnerOutput, RequestProgress, SchedulerOutput, StepUpdate
from pagedbench.model.config import ModelConfig

PREEMPTION_MODES = ("recompute", "swap")


class Scheduler:
    """Owns the waiting, running and swapped queues; the engine calls its methods, never edits them.
    `requests` (the engine's, by id), `outputs`, `stats`, `model_config` and `max_model_len` are its
    StepUpdate's, for update_from_output."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        preemption_mode: str = "recompute",
        *,
        requests: dict[str, SequenceGroup] | None = None,
        outputs: OutputProcessor | None = None,
        stats: EngineStats | None = None,
        model_config: ModelConfig | None = None,
        max_model_len: int = sys.maxsize,
    ):
        self.order = QueueOrder(policy)
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {preemption_mode!r}")
        self.policy, self.preemption_mode = policy, preemption_mode
        self.swapped: deque[Sequence] = deque()
        self.num_swap_outs = 0
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        # Speculative decoding: tokens a decoding sequence may verify beyond its next one (their
        # pages are allocated with it); None without speculation.
        self.lookahead: Callable[[Sequence], int] | None = None
        self.lane: int | None = None  # the lane being scheduled (None: every sequence)
        self.step_update = StepUpdate(self, requests, outputs, stats, model_config, max_model_len)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self, lane: int | None = None) -> SchedulerOutput:
        """The step's work: running sequences first (decodes, then prefill chunks), then swapped-out
        ones coming back, then new admissions, under the token budget and max_num_seqs; only
        `lane`'s sequences, if given."""
        self.lane = lane
        try:
            return self._schedule()
        finally:
            self.lane = None

    def _mine(self, queue) -> list[Sequence]:
        """The sequences of `queue` in the lane being scheduled."""
        return queue if self.lane is None else [s for s in queue if s.lane == self.lane]

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.policy == "priority":
            self._preempt_for_priority(out)
        made_room = out.num_preempted  # for higher-priority waiting requests, which may now be admitted
        scheduled: set[int] = set()
        budget = self._schedule_running(out, scheduled, self.max_num_batched_tokens)
        reserved = sum(map(_width, self.running))
        # Admitting would only preempt again once this step had to preempt for room.
        if out.num_preempted == made_room:
            budget, reserved = self._schedule_swapped(out, scheduled, budget, reserved)
        if out.num_preempted == made_room:
            self._schedule_waiting(out, scheduled, budget, reserved)
        # Decodes first in the batch (a one-token prefill chunk is a decode to attention).
        if out.num_tokens.count(1) != len(out.num_tokens):
            order = sorted(range(len(out.seqs)), key=lambda i: out.num_tokens[i] != 1)
            out.seqs = [out.seqs[i] for i in order]
            out.num_tokens = [out.num_tokens[i] for i in order]
        return out

    def _schedule_running(self, out: SchedulerOutput, scheduled: set[int], budget: int) -> int:
        """Running decodes first, then running prefill chunks, each in rank order, preempting
        what must go to make room. Returns the budget left."""
        candidates = sorted(self._mine(self.running), key=lambda s: (s.num_uncomputed_tokens != 1, *self.order.rank(s)))
        for seq in candidates:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.paused or seq.num_uncomputed_tokens == 0:
                continue  # preempted earlier in this loop, paused, or (async) finishing with the step in flight
            wanted = seq.num_uncomputed_tokens
            extra = self.lookahead(seq) if wanted == 1 and self.lookahead is not None else 0
            if extra and self.block_manager.can_allocate(seq, seq.num_computed_tokens + 1 + extra):
                wanted += extra  # proposals only in free pages: nothing is preempted to speculate
            n = min(wanted, budget)
            end = seq.num_computed_tokens + n
            if not self.block_manager.fits_in_place(seq, end):
                if not self._make_room(seq, end, scheduled, out):
                    continue  # seq itself was preempted
                self.block_manager.allocate(seq, end)
            _add(out, seq, n, scheduled)
            budget -= n
        return budget

    def _schedule_swapped(self, out: SchedulerOutput, scheduled: set[int], budget: int, reserved: int) -> tuple:
        """Swapped-out sequences come back (best first) before anything new is admitted (under
        "priority", before anything they outrank). Returns (budget, reserved) left."""
        while budget > 0:
            seq = self.order.best(self._mine(self.swapped))
            if seq is None or self.order.outranks(self._mine(self.waiting), seq):
                break
            n = min(seq.num_uncomputed_tokens, budget)
            fits = reserved + _width(seq) <= self.max_num_seqs
            if not fits or not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n):
                self._free_a_paused(out)
                break
            self.swapped.remove(seq)
            self.block_manager.swap_in(seq)
            self._start(seq, n, out, scheduled)
            budget -= n
            reserved += _width(seq)
        return budget, reserved

    def _schedule_waiting(self, out: SchedulerOutput, scheduled: set[int], budget: int, reserved: int) -> None:
        """Admit waiting requests while budget, blocks and max_num_seqs allow, unless a
        swapped-out sequence goes first. A request that will fork (n/best_of samples, beams)
        reserves room for all; its cached prefix counts as computed."""
        waiting = self._mine(self.waiting)  # the lane's view, taken once (nothing joins it in this loop)
        swapped = self.order.best(self._mine(self.swapped))
        while budget > 0:
            seq = self.order.first(waiting)
            if seq is None or (swapped is not None and not self.order.outranks(waiting, swapped)):
                break
            fits = reserved + _width(seq) <= self.max_num_seqs
            hit = self.block_manager.match_prefix(seq) if fits else 0
            n = min(seq.num_uncomputed_tokens, budget)
            # (a hybrid whose prefix's state this step snapshots waits a step to resume there)
            room = fits and not self.block_manager.awaits_snapshot(seq)
            if not room or not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n):
                self.block_manager.free(seq)  # give the cached blocks back until it fits
                seq.num_computed_tokens = 0
                self._free_a_paused(out)
                break
            self.block_manager.count_lookup(seq, hit)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = hit
            self.waiting.remove(seq)
            if waiting is not self.waiting:
                waiting.remove(seq)
            self._start(seq, n, out, scheduled)
            # Nothing admitted in this loop is preempted before the step runs, so its pages
            # may be shared at once by the next admissions.
            self.block_manager.cache_computed_blocks(seq, seq.num_computed_tokens + n)
            budget -= n
            reserved += _width(seq)

    def _start(self, seq: Sequence, n: int, out: SchedulerOutput, scheduled: set[int]) -> None:
        """`seq` (admitted or swapped in) runs its next `n` tokens this step."""
        self.block_manager.allocate(seq, seq.num_computed_tokens + n)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        _add(out, seq, n, scheduled)

    def _free_a_paused(self, out: SchedulerOutput) -> None:
        """When only paused beams hold the room (nothing ran this step), preempt one."""
        paused = [s for s in self._mine(self.running) if s.paused]
        if out.empty and paused:
            self.preempt(max(paused, key=self.order.rank))
            out.num_preempted += 1

    def _make_room(self, seq: Sequence, num_tokens: int, scheduled: set[int], out: SchedulerOutput) -> bool:
        """Preempt the newest unscheduled running sequences until `seq` can hold
        `num_tokens`; False when `seq` itself had to go."""
        while not self.block_manager.can_allocate(seq, num_tokens):
            victims = [s for s in self._mine(self.running) if id(s) not in scheduled and s is not seq]
            victim = max(victims, key=self.order.rank) if victims else seq
            self.preempt(victim)
            out.num_preempted += 1
            if victim is seq:
                return False
        return True

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """While the best waiting request outranks the worst running one and cannot be admitted
        (no room in blocks or in max_num_seqs), preempt the worst running one."""
        while (seq := self.order.first(self._mine(self.waiting))) is not None and self._mine(self.running):
            worst = max(self._mine(self.running), key=self.order.rank)
            if self.order.rank(worst) <= self.order.rank(seq):
                return
            first_chunk = seq.num_computed_tokens + min(seq.num_uncomputed_tokens, self.max_num_batched_tokens)
            room = sum(map(_width, self.running)) + _width(seq) <= self.max_num_seqs
            if room and self.block_manager.can_allocate(seq, first_chunk):
                return
            self.preempt(worst)
            out.num_preempted += 1

    def preempt(self, seq: Sequence, swap: bool = True) -> None:
        """Swap `seq` out (swap mode, while swap space lasts, unless `swap` is False), or free its
        blocks: it goes back to the front of the queue and recomputes. A draft model recomputes its
        K/V either way (its cache is not swapped)."""
        self.running.remove(seq)
        seq.spec_token_ids, seq.draft_computed = [], 0
        if swap and self.preemption_mode == "swap" and self.block_manager.can_swap_out(seq):
            self.block_manager.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            seq.num_preemptions += 1
            self.num_swap_outs += 1
            self.swapped.append(seq)
            return
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[RequestProgress]:
        """Apply step `sched`'s output (StepUpdate.apply); returns the requests that got tokens."""
        return self.step_update.apply(sched, out)

    def abandon(self, out: SchedulerOutput) -> None:
        """A step that raised (an interrupt, out of memory, a worker) left K/V unwritten: forget
        every cached prefix (pages registered for this step among them) and send the step's
        sequences back to recompute, so nothing later reads what was never written."""
        self.block_manager.reset_prefix_cache()
        self.block_manager.take_copies()  # moves planned for the abandoned step, if not yet taken
        self.block_manager.take_swaps()
        for seq in out.seqs:
            if seq.num_placeholders:  # async scheduling: tokens that will never come
                del seq.token_ids[-seq.num_placeholders :]
                seq.num_placeholders = 0
            if seq.status is SequenceStatus.RUNNING:
                self.preempt(seq, swap=False)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Stop `seq` for good (stop, length, abort), wherever it is queued, and free its blocks."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                break
        self.block_manager.free(seq)


def _width(seq: Sequence) -> int:
    """Sequences `seq` will be once its request forks (its samples or beams), 1 once forked."""
    return 1 if seq.forked else seq.params.width


def _add(out: SchedulerOutput, seq: Sequence, n: int, scheduled: set[int]) -> None:
    out.seqs.append(seq)
    out.num_tokens.append(n)
    scheduled.add(id(seq))
