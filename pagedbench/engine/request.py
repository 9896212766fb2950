"""SequenceGroup: the engine's state of one request (its samples or beams, their search, its timings)."""

from dataclasses import dataclass, field

from pagedbench.engine.beam_search import BeamSearch
from pagedbench.engine.sequence import Sequence, SequenceStatus
from pagedbench.sample.sampling_params import BeamSearchParams, SamplingParams


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """One request: its single sequence, its n/best_of samples (live and finished), or its live
    beams (`beam` holds the search and the finished hypotheses)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    seqs: list[Sequence]
    arrival_time: float
    beam: BeamSearch | None = None
    token_times: list[float] = field(default_factory=list)  # per output token, when its step ended
    num_cached_tokens: int = 0  # prompt tokens its first sequence found in the prefix cache
    lane: int = 0  # pipeline parallelism: the lane its sequences run in (llm_engine.py)

    def note_cached_tokens(self) -> None:
        """Keep the prefix-cache hit of its sequences (they may all be gone once beams end)."""
        hits = [s.num_cached_tokens for s in self.seqs if s.num_cached_tokens is not None]
        self.num_cached_tokens = max(hits, default=self.num_cached_tokens)

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        if len(self.seqs) == 1:  # (every step, every request: one sample is the common case)
            return self.params.width == 1 and self.seqs[0].status is SequenceStatus.FINISHED
        return len(self.seqs) == self.params.width and all(s.finished for s in self.seqs)

    @property
    def needs_host_tokens(self) -> bool:
        """Whether a step of this request needs its previous step's tokens on the host (async scheduling
        then waits for them): beams, samples forked at the first token, grammars, penalties, bad words,
        logits processors and prompt logprobs read the tokens or the output so far."""
        p = self.params
        if self.beam is not None or p.width > 1:
            return True
        grammar_or_prompt = p.structured_outputs is not None or p.prompt_logprobs is not None
        return grammar_or_prompt or p.penalized or bool(p.bad_words or p.logits_processors)

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.seqs)
