"""Verification of speculated tokens by exact rejection sampling (Leviathan et al. 2023, Chen et
al. 2023), batched over every verified position of a step.

A proposer offers tokens d_1..d_m after a sequence's last token; the target's one forward gives
logits at m + 1 positions. Position j is judged with the distribution the sampler would draw from
there had d_1..d_j already been sampled: the request's processors, bans and penalties see those
tokens as output (a `Position` row each). The proposers here propose deterministically, a point
mass q = 1 on d, so the test is: accept d with probability p(d); on rejection draw from p with d
removed, renormalised; after m acceptances draw a bonus token from the last row. Each emitted token
then has exactly the target's distribution: P(y) = p(d)[y = d] + (1 - p(d)) p(y)[y != d] / (1 - p(d))
= p(y). A greedy row accepts d when it is the argmax and otherwise emits the argmax, so greedy
output is token-identical to decoding without speculation.
"""

from dataclasses import dataclass

import torch

from pagedbench.sample.sampler import Sampler, SamplingBatch, inverse_cdf, process_logits, warp
from pagedbench.sample.sampling_params import SamplingParams


@dataclass(slots=True)
class Position:
    """One verified position of a sequence, as the sampler sees it (a SamplingSequence): the
    sequence's output so far plus the proposed tokens before this position."""

    params: SamplingParams
    prompt_token_ids: list[int]
    generator: torch.Generator | None
    output_token_ids: list[int]
    grammar: object | None = None  # structured outputs: a fork of the sequence's matcher, past the proposals before

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def positions(seq, proposed: list[int], grammars: list | None = None) -> list[Position]:
    """The m + 1 rows that verify `proposed` (m tokens) after `seq`'s tokens; under structured
    outputs, row j reads grammars[j] (StructuredOutputManager.lookahead)."""
    output, grammars = seq.output_token_ids, grammars or [None] * (len(proposed) + 1)
    return [
        Position(seq.params, seq.prompt_token_ids, seq.generator, output + proposed[:j], grammars[j])
        for j in range(len(proposed) + 1)
    ]


def verify(
    sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch, proposed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] fp32 of the rows of `batch` (Positions); proposed [R] int64, the token each row
    judges (-1 on a bonus row, which judges none). Returns (accepted [R] bool, drawn [R] int64):
    whether the row accepts its token, and what it emits if it is the first that does not."""
    logits = process_logits(logits, batch)
    judged = proposed >= 0
    token = proposed.clamp(min=0)[:, None]
    greedy_tokens = logits.argmax(dim=-1) if batch.any_greedy else None
    if batch.all_greedy:
        return (greedy_tokens == token[:, 0]) & judged, greedy_tokens
    probs = warp(logits, batch).softmax(dim=-1)
    rows = range(len(probs))
    accepted = (sampler.uniform(rows, batch, probs.device)[:, 0] < probs.gather(-1, token)[:, 0]) & judged
    residual = torch.where(judged[:, None], probs.scatter(-1, token, 0.0), probs)
    drawn = inverse_cdf(residual, sampler.uniform(rows, batch, probs.device))
    if greedy_tokens is not None:
        accepted = torch.where(batch.greedy, (greedy_tokens == token[:, 0]) & judged, accepted)
        drawn = torch.where(batch.greedy, greedy_tokens, drawn)
    return accepted, drawn
