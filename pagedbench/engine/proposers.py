"""Proposers of speculative tokens. Both propose deterministically (the verifier treats a
proposal as a point mass, sample/rejection.py), as vLLM v1's n-gram and draft proposers do.

- NgramProposer (prompt lookup): the continuation of the latest earlier occurrence of the
  sequence's last n tokens, n from prompt_lookup_max down to prompt_lookup_min. No model, no
  device work; it proposes before the scheduler runs, so a sequence with no match costs nothing.
- DraftModelProposer: a smaller model of the same vocabulary, greedy, in its own KV cache indexed
  by the target's block tables (the scheduler allocates the target's pages for the proposed
  tokens, and the draft writes its K/V into the same page ids of its own cache). It first catches
  up on the tokens it has not seen (`Sequence.draft_computed`: a whole prompt on a sequence's first
  proposal, or after a preemption), then runs one token per proposed position."""

from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedbench.config import SpeculativeConfig
from pagedbench.device.transfer import to_list
from pagedbench.engine.sequence import Sequence
from pagedbench.worker.model_runner import ModelRunner


def ngram_proposal(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens (longest n
    first); [] when no n in n_min..n_max matches."""
    ids = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, len(ids) - 1), n_min - 1, -1):
        # Windows that end before the last token, so that something follows each.
        hits = np.flatnonzero((sliding_window_view(ids[:-1], n) == ids[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return ids[start : start + k].tolist()
    return []


class NgramProposer:
    proposes_before_scheduling = True

    def __init__(self, spec: SpeculativeConfig):
        self.k, self.n_min, self.n_max = spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max

    def propose(self, seqs: list[Sequence], counts: list[int]) -> None:
        """Set each sequence's spec_token_ids: at most counts[i] proposed tokens."""
        for seq, count in zip(seqs, counts):
            seq.spec_token_ids = ngram_proposal(seq.token_ids, count, self.n_min, self.n_max) if count else []


@dataclass(slots=True)
class _DraftView:
    """A sequence as the draft's step batch reads it: its tokens so far (proposals appended), the
    target's pages, and how many of them the draft's cache holds."""

    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)
    params: None = None  # no prompt logprobs

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftModelProposer:
    proposes_before_scheduling = False

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def propose(self, seqs: list[Sequence], counts: list[int]) -> None:
        """Propose exactly counts[i] tokens for seqs[i] (their pages are allocated), one draft
        forward per position, the first one also catching up on unseen tokens."""
        views = [_DraftView(list(s.token_ids), s.block_table, min(s.draft_computed, s.num_tokens - 1)) for s in seqs]
        for seq in seqs:
            seq.spec_token_ids = []
        active = [i for i, c in enumerate(counts) if c > 0]
        while active:
            active.sort(key=lambda i: views[i].num_tokens - views[i].num_computed_tokens != 1)  # decodes first
            batch = [views[i] for i in active]
            inputs = self.runner.build_inputs(batch, [v.num_tokens - v.num_computed_tokens for v in batch])
            logits = self.runner.run(inputs, self.runner.backend.plan(inputs.metadata))
            for i, token in zip(active, to_list(logits[: len(active)].argmax(dim=-1))):
                views[i].num_computed_tokens = views[i].num_tokens
                views[i].token_ids.append(token)
                seqs[i].spec_token_ids.append(token)
            active = [i for i in active if len(seqs[i].spec_token_ids) < counts[i]]
        for seq, view in zip(seqs, views):
            seq.draft_computed = view.num_computed_tokens
