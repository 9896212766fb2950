from collections import deque
from dataclasses import dataclass, field

from pagedbench.engine.block_manager import BlockManager
from pagedbench.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerOutput:
    """The work of one step: `seqs[i]` runs its next `num_tokens[i]` tokens.
    Decodes (one token) come first, then prefill chunks."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def empty(self) -> bool:
        return not self.seqs


POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")


class Scheduler:
    """Continuous batching under one token budget per step, with chunked prefill and
    preemption by recompute. policy "fcfs": first come, first served; the newest is preempted
    first. policy "priority" (vLLM's): the lowest `priority` value runs first (ties by arrival),
    the highest is preempted first, and a waiting request that outranks a running one and cannot
    be admitted preempts it. preemption_mode "swap" (vLLM v0's) moves a preempted sequence's
    pages to CPU swap space and back before any new request is admitted; it recomputes when the
    swap space is full. A paused sequence (a beam waiting for its siblings'
    candidates) is not scheduled; it keeps its pages unless they are all that stops a waiting
    sequence from running, and waits in the queue without being readmitted until it resumes."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        preemption_mode: str = "recompute",
    ):
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {policy!r}")
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
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def _rank(self, seq: Sequence) -> tuple:
        """Who goes first (smallest) and who is preempted first (largest)."""
        return (seq.priority, seq.arrival_time) if self.policy == "priority" else (seq.arrival_time,)

    def _next_waiting(self) -> Sequence | None:
        ready = (s for s in self.waiting if not s.paused)
        if self.policy == "priority":
            return min(ready, key=self._rank, default=None)
        return next(ready, None)  # queue order: preempted sequences went back to the front

    def _next_swapped(self) -> Sequence | None:
        return min((s for s in self.swapped if not s.paused), key=self._rank, default=None)

    def _waiting_goes_first(self, swapped: Sequence) -> bool:
        """Under "priority", a waiting request that outranks `swapped` is admitted before it
        comes back; under "fcfs" swapped sequences always come back first."""
        waiting = self._next_waiting()
        return self.policy == "priority" and waiting is not None and self._rank(waiting) < self._rank(swapped)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        if self.policy == "priority":
            self._preempt_for_priority(out)
        made_room = out.num_preempted  # for higher-priority waiting requests, which may now be admitted
        # Running decodes first, then running prefill chunks, each in rank order.
        candidates = sorted(self.running, key=lambda s: (s.num_uncomputed_tokens != 1, *self._rank(s)))
        for seq in candidates:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.paused:
                continue  # preempted earlier in this loop, or paused
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, seq.num_computed_tokens + n, scheduled, out):
                continue  # seq itself was preempted
            self.block_manager.allocate(seq, seq.num_computed_tokens + n)
            self._add(out, seq, n, scheduled)
            budget -= n
        reserved = sum(map(self._width, self.running))
        # Swapped-out sequences come back (best first) before anything new is admitted (under
        # "priority", before anything they outrank).
        while budget > 0 and out.num_preempted == made_room:
            seq = self._next_swapped()
            if seq is None or self._waiting_goes_first(seq):
                break
            n = min(seq.num_uncomputed_tokens, budget)
            fits = reserved + self._width(seq) <= self.max_num_seqs
            if not fits or not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n):
                self._free_a_paused(out)
                break
            self.swapped.remove(seq)
            self.block_manager.swap_in(seq)
            self._start(seq, n, out, scheduled)
            budget -= n
            reserved += self._width(seq)
        # Admit waiting requests while budget, blocks and max_num_seqs allow, unless this
        # step already had to preempt (admitting would only preempt again) or a swapped-out
        # sequence goes first. A request that will fork (n/best_of samples, beams) reserves room for all.
        while budget > 0 and out.num_preempted == made_room:
            seq = self._next_waiting()
            swapped = self._next_swapped()
            if seq is None or (swapped is not None and not self._waiting_goes_first(swapped)):
                break
            fits = reserved + self._width(seq) <= self.max_num_seqs
            hit = self.block_manager.match_prefix(seq) if fits else 0  # cached tokens count as computed
            n = min(seq.num_uncomputed_tokens, budget)
            if not fits or not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n):
                self.block_manager.free(seq)  # give the cached blocks back until it fits
                seq.num_computed_tokens = 0
                self._free_a_paused(out)
                break
            self.block_manager.count_lookup(seq, hit)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = hit
            self.waiting.remove(seq)
            self._start(seq, n, out, scheduled)
            # Nothing admitted in this loop is preempted before the step runs, so its pages
            # may be shared at once by the next admissions.
            self.block_manager.cache_computed_blocks(seq, seq.num_computed_tokens + n)
            budget -= n
            reserved += self._width(seq)
        # Decodes first in the batch (a one-token prefill chunk is a decode to attention).
        order = sorted(range(len(out.seqs)), key=lambda i: out.num_tokens[i] != 1)
        out.seqs = [out.seqs[i] for i in order]
        out.num_tokens = [out.num_tokens[i] for i in order]
        return out

    def _start(self, seq: Sequence, n: int, out: SchedulerOutput, scheduled: set[int]) -> None:
        """`seq` (admitted or swapped in) runs its next `n` tokens this step."""
        self.block_manager.allocate(seq, seq.num_computed_tokens + n)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._add(out, seq, n, scheduled)

    def _free_a_paused(self, out: SchedulerOutput) -> None:
        """When only paused beams hold the room (nothing ran this step), preempt one."""
        paused = [s for s in self.running if s.paused]
        if out.empty and paused:
            self.preempt(max(paused, key=self._rank))
            out.num_preempted += 1

    @staticmethod
    def _width(seq: Sequence) -> int:
        """Sequences `seq` will be once its request forks (its samples or beams), 1 once forked."""
        return 1 if seq.forked else seq.params.width

    @staticmethod
    def _add(out: SchedulerOutput, seq: Sequence, n: int, scheduled: set[int]) -> None:
        out.seqs.append(seq)
        out.num_tokens.append(n)
        scheduled.add(id(seq))

    def _make_room(self, seq: Sequence, num_tokens: int, scheduled: set[int], out: SchedulerOutput) -> bool:
        """Preempt the newest unscheduled running sequences until `seq` can hold
        `num_tokens`; False when `seq` itself had to go."""
        while not self.block_manager.can_allocate(seq, num_tokens):
            victims = [s for s in self.running if id(s) not in scheduled and s is not seq]
            victim = max(victims, key=self._rank) if victims else seq
            self.preempt(victim)
            out.num_preempted += 1
            if victim is seq:
                return False
        return True

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """While the best waiting request outranks the worst running one and cannot be admitted
        (no room in blocks or in max_num_seqs), preempt the worst running one."""
        while (seq := self._next_waiting()) is not None and self.running:
            worst = max(self.running, key=self._rank)
            if self._rank(worst) <= self._rank(seq):
                return
            first_chunk = seq.num_computed_tokens + min(seq.num_uncomputed_tokens, self.max_num_batched_tokens)
            room = sum(map(self._width, self.running)) + self._width(seq) <= self.max_num_seqs
            if room and self.block_manager.can_allocate(seq, first_chunk):
                return
            self.preempt(worst)
            out.num_preempted += 1

    def preempt(self, seq: Sequence, swap: bool = True) -> None:
        """Swap `seq` out (swap mode, while swap space lasts, unless `swap` is False), or free its
        blocks: it goes back to the front of the queue and recomputes."""
        self.running.remove(seq)
        if swap and self.preemption_mode == "swap" and self.block_manager.can_swap_out(seq):
            self.block_manager.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            seq.num_preemptions += 1
            self.num_preemptions += 1
            self.num_swap_outs += 1
            self.swapped.append(seq)
            return
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def fork(self, parent: Sequence, index: int) -> Sequence:
        """A new sequence sharing `parent`'s tokens and pages, queued beside it."""
        child = parent.fork(index)
        if parent.status is SequenceStatus.SWAPPED:  # its pages are in swap space: the child recomputes
            child.status, child.num_computed_tokens, child.block_keys = SequenceStatus.WAITING, 0, []
            self.waiting.appendleft(child)
            return child
        self.block_manager.fork(parent, child)
        if parent.status is SequenceStatus.RUNNING:
            self.running.append(child)
        elif parent.status is SequenceStatus.WAITING:
            self.waiting.insert(self.waiting.index(parent) + 1, child)
        return child

    def computed(self, out: SchedulerOutput) -> None:
        """The scheduled tokens of `out` went through the model: their K/V are in the cache."""
        for seq, n in zip(out.seqs, out.num_tokens):
            seq.num_computed_tokens += n
            self.block_manager.cache_computed_blocks(seq)

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
