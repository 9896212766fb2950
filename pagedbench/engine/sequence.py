"""Sequence: one sample (or beam) of a request, its tokens, its progress and its pages."""

import enum
import time
from dataclasses import dataclass, field

import torch

from pagedbench.sample.sampling_params import BeamSearchParams, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its K/V copied to CPU swap space
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's tokens and progress.

    The KV cache holds the first `num_computed_tokens` of `token_ids`; a step schedules the
    next chunk of them, and when a chunk reaches the end the sampler appends a token.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    arrival_time: float = field(default_factory=time.perf_counter)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Bumped by the block manager whenever it changes block_table other than by appending (or replaces
    # it): the worker's persistent block table then rewrites the sequence's row (worker/step_batch.py).
    block_table_version: int = 0
    cpu_block_table: list[int] = field(default_factory=list)  # its swap-space blocks while SWAPPED
    block_keys: list = field(default_factory=list)  # prefix-cache keys of its full computed blocks (block_manager)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    output_text: str = ""
    detokenizer: object | None = None  # its IncrementalDetokenizer, from its first output token (detokenizer.py)
    num_preemptions: int = 0
    state_slot: int = -1  # hybrid models: its linear-attention state slot while it holds pages (-1: none)
    # Hybrid models' prefix caching (engine/state_snapshots.py): the (boundary, snapshot slot) pairs its
    # next step writes, the snapshot a prefix hit resumes from (-1: none) and the hit's junction.
    state_snapshots: list[tuple[int, int]] = field(default_factory=list)
    restore_from: int = -1
    snapshot_junction: int = 0
    priority: int = 0  # lower runs first under the "priority" scheduling policy
    index: int = 0  # which of its request's samples or beams this is
    cumulative_logprob: float = 0.0  # sum of the model's log-probabilities of its output tokens
    logprobs: list | None = None  # per output token: {token id: Logprob} (SamplingParams.logprobs)
    prompt_logprobs: list | None = None  # per prompt token after the first (SamplingParams.prompt_logprobs)
    paused: bool = False  # nothing to run until its request advances (a beam that reported its candidates)
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache when first admitted
    # Speculative decoding: tokens proposed after token_ids for this step to verify, and how many of
    # token_ids the draft model's KV cache holds (engine/proposers.py).
    spec_token_ids: list[int] = field(default_factory=list)
    draft_computed: int = 0
    grammar: object | None = None  # its xgrammar GrammarMatcher, past its output (structured outputs)
    lane: int = 0  # under pipeline parallelism, which of the steps in flight it runs in (its request's)
    num_placeholders: int = 0  # async scheduling: PLACEHOLDERs ending token_ids (its tokens still on the device)

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)

    def fork(self, index: int, into: "Sequence | None" = None) -> "Sequence":
        """A copy sharing this sequence's progress (tokens, computed count, text); its block
        table is filled by BlockManager.fork, which shares the pages. `into`: an earlier fork of
        this sequence, not yet scheduled (a sample that drew its first token before the step's
        bookkeeping), brought up to date; it keeps its generator."""
        child = into or Sequence(self.request_id, self.prompt, self.prompt_token_ids, self.params, self.arrival_time)
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.draft_computed = self.draft_computed
        child.num_cached_tokens = self.num_cached_tokens
        child.block_keys = list(self.block_keys)
        child.status = self.status
        child.output_text = self.output_text
        child.detokenizer = None if self.detokenizer is None else self.detokenizer.fork()
        child.index = index
        child.priority = self.priority
        child.cumulative_logprob = self.cumulative_logprob
        child.paused = self.paused
        child.lane = self.lane
        child.num_placeholders = self.num_placeholders
        child.grammar = None if self.grammar is None else self.grammar.fork()
        child.logprobs = None if self.logprobs is None else list(self.logprobs)
        child.prompt_logprobs = None if self.prompt_logprobs is None else list(self.prompt_logprobs)
        return child

    @property
    def forked(self) -> bool:
        """Whether its request's samples or beams exist yet (they appear with the first token)."""
        return self.index > 0 or self.num_output_tokens > 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    # (read several times per sequence per step: len() inline, not through the properties above)
    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
