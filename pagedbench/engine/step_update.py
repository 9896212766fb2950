"""The scheduler's post-step half, as vLLM v1's `Scheduler.update_from_output`: what a step's model
call and sampling produced (a ModelRunnerOutput, nothing applied yet) is applied to the step's
sequences in one place. In order: the scheduled tokens count as computed, less the proposals
verification rejected, and their full pages join the prefix cache; prompt logprobs are recorded;
the rejected proposals' pages go back; each sequence's new tokens (verified ones first; a request's
samples fork at its first token) are appended with their logprobs and checked for a stop (a stopped
sequence finishes and frees its pages); beams report their candidates, and a request whose beams
have all reported forks, continues and prunes them. It returns each request that progressed.

The Scheduler owns a StepUpdate and calls it from its update_from_output (scheduler.py). StepUpdate
uses the scheduler through `SchedulerQueues` (its block manager, the queues a fork joins, finish)
and what the Scheduler was given for it: `requests`, `outputs` (text and logprob entries), `stats`,
`model_config` (EOS ids) and `max_model_len`."""

import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pagedbench.engine.block_manager import BlockManager
from pagedbench.engine.output_processor import OutputProcessor
from pagedbench.engine.request import SequenceGroup
from pagedbench.engine.sequence import Sequence, SequenceStatus
from pagedbench.engine.stats import EngineStats
from pagedbench.engine.stopping import stop_check
from pagedbench.engine.structured_outputs import advance
from pagedbench.model.config import ModelConfig
from pagedbench.sample.sampler import SamplerOutput
from pagedbench.worker.step_batch import PLACEHOLDER


@dataclass(slots=True)
class SchedulerOutput:
    """The work of one step: `seqs[i]` runs its next `num_tokens[i]` tokens.
    Decodes (one token) come first, then prefill chunks."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0
    advanced: bool = False  # async scheduling: its tokens already count as computed (StepUpdate.advance)

    @property
    def empty(self) -> bool:
        return not self.seqs


@dataclass(slots=True)
class Sampled:
    """A sequence's new tokens: the one drawn for it, or (speculating) the proposals it accepted and
    then the target's own; with their logprobs where the request wants them (or best_of ranks by
    them), one host row per token (`logprob_row`)."""

    seq: Sequence
    tokens: list[int]
    logprobs: list[SamplerOutput] | None = None
    num_proposed: int = 0  # proposals it verified this step (0: it did not speculate)
    parent: Sequence | None = None  # a sample its request forks at its first token, drawn from parent's row

    @property
    def num_rejected(self) -> int:
        """Proposals verification rejected: computed this step, but not the sequence's tokens."""
        return self.num_proposed + 1 - len(self.tokens) if self.num_proposed else 0


@dataclass(slots=True)
class BeamCandidates:
    """A beam's best next tokens and their logprobs, best first."""

    seq: Sequence
    logprobs: list[float]
    token_ids: list[int]


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one step's model call and sampling produced (vLLM's ModelRunnerOutput): tokens and
    logprobs of the sequences that sample (verifying ones first), beams' candidates, and the logits
    rows of the step's prompt chunks that want prompt logprobs."""

    sampled: list[Sampled] = field(default_factory=list)
    beams: list[BeamCandidates] = field(default_factory=list)
    prompt_logprob_rows: list[tuple[int, int, int]] = field(default_factory=list)  # (scheduled i, first, count)
    prompt_logits: torch.Tensor | None = None


@dataclass(slots=True)
class RequestProgress:
    """A request that got tokens this step, and how many (the most any of its samples got)."""

    group: SequenceGroup
    num_new_tokens: int


def logprob_row(host: SamplerOutput, row: int, k: int) -> SamplerOutput:
    """Batch row `row` of a host SamplerOutput (its logprobs at `k`, the row's place among the rows
    with logprobs) as a one-row one."""
    top = host.top_token_ids is not None
    return SamplerOutput(
        [host.tokens[row]],
        [host.token_logprobs[k]],
        [host.token_ranks[k]],
        [host.top_logprobs[k]] if top else None,
        [host.top_token_ids[k]] if top else None,
    )


class SchedulerQueues(Protocol):
    """The scheduler as StepUpdate uses it: its block manager, the queues a fork joins, and finish."""

    block_manager: BlockManager
    running: list[Sequence]
    waiting: deque[Sequence]

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None: ...


class StepUpdate:
    """A step's output applied to its sequences (apply), and the forks and computed tokens it makes."""

    def __init__(
        self,
        scheduler: SchedulerQueues,
        requests: dict[str, SequenceGroup] | None = None,
        outputs: OutputProcessor | None = None,
        stats: EngineStats | None = None,
        model_config: ModelConfig | None = None,
        max_model_len: int = sys.maxsize,
    ):
        self.scheduler = scheduler
        self.requests = {} if requests is None else requests  # the engine's, by id
        self.outputs = OutputProcessor(None) if outputs is None else outputs
        self.stats = EngineStats() if stats is None else stats
        self.model_config, self.max_model_len = model_config, max_model_len  # its EOS ids, read at each stop check

    def apply(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[RequestProgress]:
        """Apply step `sched`'s output `out` to its sequences (see the module's docstring); returns the
        requests that got tokens, in the order their outputs go out."""
        verified = [s for s in out.sampled if s.num_proposed]
        drawn = [s for s in out.sampled if not s.num_proposed]
        if sched.advanced:  # async: a sequence that stopped at the step before drops this step's token
            drawn = [s for s in drawn if not s.seq.finished]
        else:
            self._count_prompt_tokens(sched)
            self.computed(sched, {id(s.seq): s.num_rejected for s in verified})
        if out.prompt_logprob_rows:
            self.outputs.record_prompt_logprobs(sched.seqs, out.prompt_logprob_rows, out.prompt_logits)
        for s in verified:  # the rejected proposals' pages go back; the draft's cache keeps no rejected token
            self.stats.spec.record(s.num_proposed, len(s.tokens) - 1)
            s.seq.spec_token_ids = []
            if not s.seq.finished:
                self.scheduler.block_manager.trim(s.seq)
                s.seq.draft_computed = min(s.seq.draft_computed, s.seq.num_computed_tokens)
        progressed: dict[int, tuple[SequenceGroup, int]] = {}
        for s in verified:
            count, group = self._append(s), self.requests[s.seq.request_id]
            progressed[id(group)] = (group, max(count, progressed.get(id(group), (group, 0))[1]))
        for s in drawn:
            if s.parent is not None:  # the request's samples appear with its first token, sharing its pages
                self.fork(s.parent, s.seq.index, into=s.seq)
                self.requests[s.seq.request_id].seqs.append(s.seq)
        for s in drawn:
            self._append(s)
            group = self.requests[s.seq.request_id]
            # 1 even where another of its samples verified several this step: the engine always counted so
            # (token_times then gets one time for those tokens); kept, this refactor changes no behaviour
            progressed[id(group)] = (group, 1)
        for group in self._continue_beams(out.beams):
            progressed[id(group)] = (group, 1)
        return [RequestProgress(group, count) for group, count in progressed.values()]

    def advance(self, sched: SchedulerOutput, sampling: list[Sequence]) -> None:
        """Async scheduling, with step `sched` in flight: its tokens count as computed now, and each
        sequence in `sampling` (its sampling rows) gets a PLACEHOLDER for the token it draws, so the
        next step is scheduled and laid out with exact lengths; `apply` puts the token in its place.
        A sequence whose drawn token ends it by length gets none: nothing is scheduled for it."""
        self._count_prompt_tokens(sched)
        live = [(seq, n) for seq, n in zip(sched.seqs, sched.num_tokens) if not seq.finished]  # (stopped at N)
        self.computed(SchedulerOutput([seq for seq, _ in live], [n for _, n in live]))
        for seq in sampling:
            if not seq.finished and not self._ends_by_length(seq, seq.num_tokens + 1):
                seq.token_ids.append(PLACEHOLDER)
                seq.num_placeholders += 1
        sched.advanced = True

    def _ends_by_length(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` stops by length once it holds `num_tokens` tokens (what stop_check says last)."""
        max_tokens = seq.params.max_tokens
        outputs = num_tokens - seq.num_prompt_tokens
        return num_tokens >= self.max_model_len or (max_tokens is not None and outputs >= max_tokens)

    def _count_prompt_tokens(self, sched: SchedulerOutput) -> None:
        for seq, n in zip(sched.seqs, sched.num_tokens):
            self.stats.prompt_tokens += max(0, min(n, seq.num_prompt_tokens - seq.num_computed_tokens))

    def fork(self, parent: Sequence, index: int, into: Sequence | None = None) -> Sequence:
        """A new sequence sharing `parent`'s tokens and pages, queued beside it (`into`: a sample
        that drew its first token from `parent`'s row before the step's bookkeeping, see Sequence.fork)."""
        child, queues = parent.fork(index, into), self.scheduler
        if parent.status is SequenceStatus.SWAPPED:  # its pages are in swap space: the child recomputes
            child.status, child.num_computed_tokens, child.block_keys = SequenceStatus.WAITING, 0, []
            child.draft_computed = 0
            queues.waiting.appendleft(child)
            return child
        queues.block_manager.fork(parent, child)
        if parent.status is SequenceStatus.RUNNING:
            queues.running.append(child)
        elif parent.status is SequenceStatus.WAITING:
            queues.waiting.insert(queues.waiting.index(parent) + 1, child)
        return child

    def computed(self, out: SchedulerOutput, rejected: dict[int, int] | None = None) -> None:
        """The scheduled tokens of `out` went through the model: their K/V are in the cache (but for
        `rejected[id(seq)]` proposals of a verifying sequence), and full pages join the prefix cache."""
        bm = self.scheduler.block_manager
        caching, windowed = bm.enable_prefix_caching, bm.sliding_window is not None
        for seq, n in zip(out.seqs, out.num_tokens):
            seq.num_computed_tokens += n - (rejected.get(id(seq), 0) if rejected else 0)
            if caching:
                bm.cache_computed_blocks(seq)
            if windowed:
                bm.release_out_of_window(seq)

    def _append(self, s: Sampled) -> int:
        """Append `s`'s tokens (and their logprobs) until one stops its sequence; returns how many."""
        count = 0
        for j, token in enumerate(s.tokens):
            self._append_token(s.seq, token)
            count += 1
            if s.logprobs is not None:
                self.outputs.record_logprobs([s.seq], [0], s.logprobs[j])
            if s.seq.finished:
                break
        self.stats.generation_tokens += count
        return count

    def _append_token(self, seq: Sequence, token: int) -> None:
        """`seq`'s next token (in its PLACEHOLDER's place, under async scheduling): its grammar and text
        move on, and a stop finishes `seq` (its pages freed)."""
        if seq.num_placeholders:
            seq.token_ids[len(seq.token_ids) - seq.num_placeholders] = token
            seq.num_placeholders -= 1
        else:
            seq.token_ids.append(token)
        grammar_ended = seq.grammar is not None and not advance(seq, token)
        new_text = self.outputs.new_text(seq, token)
        eos_token_ids = self.model_config.eos_token_ids if self.model_config is not None else ()
        stop = stop_check(seq, token, new_text, eos_token_ids, self.max_model_len)
        if stop is None and grammar_ended:  # the constrained output is complete: nothing may follow
            stop = ("stop", None)
        if stop is not None:
            self.scheduler.finish(seq, *stop)
            self.outputs.flush_text(seq)

    def _continue_beams(self, candidates: list[BeamCandidates]) -> list[SequenceGroup]:
        """Report each beam's candidates to its search; a request whose live beams have all reported
        selects its next beams (fork, continue, free). Returns those requests."""
        reported: dict[int, SequenceGroup] = {}
        for c in candidates:
            group = self.requests[c.seq.request_id]
            group.beam.report(c.seq, c.logprobs, c.token_ids)
            c.seq.paused = True  # until every live beam of its request has reported
            reported[id(group)] = group
        selected = [g for g in reported.values() if g.beam.ready(g.seqs)]
        for group in selected:
            self._select_beams(group)
        return selected

    def _select_beams(self, group: SequenceGroup) -> None:
        chosen = group.beam.select()
        self.stats.generation_tokens += len(chosen)
        kept: set[int] = set()
        beams = []
        for rank, c in enumerate(chosen):  # fork before any parent gets its new token
            if id(c.parent) in kept:
                beams.append(self.fork(c.parent, rank))
            else:
                kept.add(id(c.parent))
                beams.append(c.parent)
        group.note_cached_tokens()
        for seq in group.seqs:
            if id(seq) not in kept:
                self.scheduler.finish(seq, "pruned")
        for rank, (seq, c) in enumerate(zip(beams, chosen)):
            seq.token_ids.append(c.token)
            seq.cumulative_logprob = c.cum_logprob
            seq.index = rank
            seq.paused = False
        group.seqs = beams
