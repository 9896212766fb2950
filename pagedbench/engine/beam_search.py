"""Beam search over engine sequences, with vLLM's API names and Hugging Face's algorithm.

The selection rule is transformers' `generate(num_beams=k, do_sample=False)` (early_stopping
False): each step takes the 2k best (beam, token) continuations by cumulative logprob; one that
ends the beam (EOS, max_tokens, max_model_len) among the first k becomes a finished hypothesis
scored `cumulative_logprob / generated_len ** length_penalty`; the first k that do not end are
the next beams. Search stops when every candidate ends, or when k hypotheses are finished and
the best live beam, scored at its current length, cannot beat the worst of them.

Beams are engine sequences: a continuation that reuses its parent keeps the parent's pages, a
second continuation of the same parent forks it (pages shared, copy-on-write on the partial last
page), and a beam no continuation chose is freed. Only the 2k best tokens of each beam's
log-softmax leave the device.
"""

from dataclasses import dataclass

from pagedbench.engine.sequence import Sequence
from pagedbench.sample.sampling_params import BeamSearchParams


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its output tokens (the ending token included), scored."""

    output_token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str
    stop_reason: int | None = None


@dataclass(slots=True)
class Continuation:
    parent: Sequence
    token: int
    cum_logprob: float


class BeamSearch:
    """The search state of one request: the candidates its live beams reported this round and
    the finished hypotheses (best first, at most beam_width)."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: list[int], max_model_len: int):
        self.params = params
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        self.max_model_len = max_model_len
        self.finished: list[Hypothesis] = []
        self.can_improve = True  # HF's early-stop heuristic not yet satisfied
        self.done = False
        self._reports: dict[int, tuple[Sequence, list[float], list[int]]] = {}

    @property
    def num_candidates(self) -> int:
        """Continuations kept per step (HF: 2k, so k live beams remain when k of them end)."""
        return 2 * self.params.beam_width

    def report(self, seq: Sequence, logprobs: list[float], token_ids: list[int]) -> None:
        """`seq`'s best next tokens and their logprobs (best first). A beam that recomputes
        after preemption reports again; the last report counts."""
        self._reports[id(seq)] = (seq, logprobs, token_ids)

    def ready(self, live: list[Sequence]) -> bool:
        return all(id(s) in self._reports for s in live)

    def select(self) -> list[Continuation]:
        """Rank every reported continuation; record finished hypotheses; return the next beams
        (best first). Sets `done` when the search is over."""
        k, p = self.params.beam_width, self.params
        ranked = sorted(
            (
                (seq.cumulative_logprob + lp, rank, token, seq)
                for rank, (seq, lps, ids) in enumerate(self._reports.values())
                for lp, token in zip(lps, ids)
            ),
            key=lambda c: (-c[0], c[1], c[2]),
        )[: self.num_candidates]
        self._reports.clear()
        beams, ended = [], 0
        for position, (cum, _, token, seq) in enumerate(ranked):
            generated = seq.num_output_tokens + 1
            eos = token in self.eos
            if eos or generated >= p.max_tokens or seq.num_tokens + 1 >= self.max_model_len:
                ended += 1
                if position < k and self.can_improve:
                    score = cum / generated**p.length_penalty
                    reason = "stop" if eos else "length"
                    hypothesis = Hypothesis([*seq.output_token_ids, token], cum, score, reason, token if eos else None)
                    self.finished.append(hypothesis)
            elif len(beams) < k:
                beams.append(Continuation(seq, token, cum))
        self.finished = sorted(self.finished, key=lambda h: -h.score)[:k]
        if beams and len(self.finished) == k:
            best_possible = beams[0].cum_logprob / (beams[0].parent.num_output_tokens + 1) ** p.length_penalty
            self.can_improve = self.can_improve and best_possible > self.finished[-1].score
        self.done = ended == len(ranked) or not self.can_improve or not beams
        return [] if self.done else beams
