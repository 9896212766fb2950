"""Speculator: speculative decoding's part of an engine step. A decoding sequence may verify up to
k proposed tokens beyond its next one: the scheduler allocates their pages with it (`lookahead`),
the proposer fills them in (`propose`), the target runs all k + 1 positions in one forward (a
query of k + 1 tokens through the attention backend), and `verify` accepts a prefix of them by exact
rejection sampling and adds the target's own next token; Scheduler.update_from_output then returns
the pages of the rejected ones (step_update.py). Greedy output is token-identical to decoding
without speculation; sampled output keeps the target's distribution (sample/rejection.py)."""

import numpy as np
import torch

from pagedbench.config import SpeculativeConfig
from pagedbench.device.transfer import to_device, to_list
from pagedbench.engine.proposers import DraftModelProposer, NgramProposer
from pagedbench.engine.scheduler import Scheduler, SchedulerOutput
from pagedbench.engine.sequence import Sequence
from pagedbench.engine.step_update import Sampled, logprob_row
from pagedbench.engine.structured_outputs import StructuredOutputManager
from pagedbench.model.config import ModelConfig
from pagedbench.sample.rejection import positions, verify
from pagedbench.sample.sampler import Sampler, SamplerOutput, SamplingBatch, fill_logprobs
from pagedbench.sample.sampling_params import SamplingParams


class Speculator:
    def __init__(
        self,
        spec: SpeculativeConfig,
        proposer: NgramProposer | DraftModelProposer,
        scheduler: Scheduler,
        model_config: ModelConfig,
        sampler: Sampler,
        max_model_len: int,
        structured: StructuredOutputManager,
    ):
        self.k, self.proposer = spec.num_speculative_tokens, proposer
        self.scheduler, self.model_config, self.sampler = scheduler, model_config, sampler
        self.max_model_len, self.structured = max_model_len, structured
        scheduler.lookahead = self.lookahead

    def room(self, seq: Sequence) -> int:
        """Tokens `seq` may propose now: k, fewer near its max_tokens or max_model_len (a step emits
        at most proposals + 1), none before its first output token or for a beam."""
        if not isinstance(seq.params, SamplingParams) or seq.num_output_tokens == 0 or seq.paused:
            return 0
        room = self.max_model_len - seq.num_tokens - 1
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(0, min(self.k, room))

    def lookahead(self, seq: Sequence) -> int:
        """What the scheduler reserves beyond a decoding sequence's next token."""
        return len(seq.spec_token_ids) if self.proposer.proposes_before_scheduling else self.room(seq)

    def before_schedule(self) -> None:
        """A proposer that needs no pages (n-gram) proposes now, so the scheduler reserves only what it found."""
        if self.proposer.proposes_before_scheduling:
            seqs = [s for s in self.scheduler.running if s.num_uncomputed_tokens == 1]
            self.proposer.propose(seqs, [self.room(s) for s in seqs])

    def propose(self, sched: SchedulerOutput) -> None:
        """After the scheduler (and the page moves): each verifying sequence holds exactly as many
        proposals as it was scheduled beyond its next token; every other one holds none."""
        seqs, counts = [], []
        for seq, n in zip(sched.seqs, sched.num_tokens):
            if n > 1 and seq.num_uncomputed_tokens == 1:
                seqs.append(seq)
                counts.append(n - 1)
            else:
                seq.spec_token_ids = []
        if self.proposer.proposes_before_scheduling:  # the budget may have cut a proposal short
            for seq, count in zip(seqs, counts):
                seq.spec_token_ids = seq.spec_token_ids[:count]
        elif seqs:
            self.proposer.propose(seqs, counts)

    def verify(
        self, seqs: list[Sequence], num_spec: list[int], logits: torch.Tensor
    ) -> tuple[list[Sequence], torch.Tensor, list[Sampled]]:
        """Split a step's sampling rows (seqs[i] has 1 + num_spec[i] logits rows, in order): the
        sequences that sample as usual with their rows, and per verifying sequence the tokens it emits
        (the proposals it accepted, then the target's own) with their logprobs where wanted."""
        plain, plain_rows, verifying, rows, proposed, judged = [], [], [], [], [], []
        offset = 0
        for seq, m in zip(seqs, num_spec):
            if m:
                verifying.append(seq)
                rows += range(offset, offset + m + 1)
                proposed += [*seq.spec_token_ids, -1]
                grammars = self.structured.lookahead(seq.grammar, seq.spec_token_ids) if seq.grammar else None
                judged += positions(seq, seq.spec_token_ids, grammars)
            else:
                plain.append(seq)
                plain_rows.append(offset)
            offset += 1 + m
        if not verifying:
            return plain, logits, []
        cfg = self.model_config
        processors = self.sampler.logits_processors
        batch = SamplingBatch.from_seqs(judged, cfg.vocab_size, logits.device, cfg.eos_token_ids, None, processors)
        batch.grammar = self.structured.mask(judged)
        proposed_ids = to_device(np.array(proposed, dtype=np.int64), logits.device)
        accepted, drawn = verify(self.sampler, logits[rows], batch, proposed_ids)
        accepted, drawn = to_list(torch.stack([accepted.long(), drawn]))  # the step's one wait for the device
        verdicts, token_rows, start = [], [], 0
        for seq in verifying:
            m = len(seq.spec_token_ids)
            a = next((j for j in range(m) if not accepted[start + j]), m)
            verdicts.append(Sampled(seq, [*seq.spec_token_ids[:a], drawn[start + a]], num_proposed=m))
            token_rows.append(rows[start : start + a + 1])
            start += m + 1
        self._logprobs(verdicts, token_rows, logits)
        return plain, logits[plain_rows], verdicts

    def _logprobs(self, verdicts: list[Sampled], token_rows: list[list[int]], logits: torch.Tensor) -> None:
        """The logprobs of each verdict's tokens (logits rows `token_rows`), where its request wants
        them (logprobs or best_of asked): one host row per token."""
        wanted = [j for j, v in enumerate(verdicts) if v.seq.params.logprobs is not None or v.seq.params.best_of > 1]
        if not wanted:
            return
        rows = [r for j in wanted for r in token_rows[j]]
        tokens = to_device(np.array([t for j in wanted for t in verdicts[j].tokens], dtype=np.int64), logits.device)
        out = SamplerOutput(tokens)
        fill_logprobs(out, logits[rows], tokens, max(verdicts[j].seq.params.logprobs or 0 for j in wanted))
        host, start = out.to_host(), 0
        for j in wanted:
            verdicts[j].logprobs = [logprob_row(host, start + i, start + i) for i in range(len(verdicts[j].tokens))]
            start += len(verdicts[j].tokens)


def make_speculator(
    spec: SpeculativeConfig | None,
    executor,
    scheduler: Scheduler,
    model_config: ModelConfig,
    sampler: Sampler,
    max_model_len: int,
    structured: StructuredOutputManager,
) -> Speculator | None:
    """The engine's Speculator (None without speculative_config): n-gram proposals, or the draft
    model the executor loaded."""
    if spec is None:
        return None
    proposer = NgramProposer(spec) if spec.method == "ngram" else DraftModelProposer(executor.draft_runner)
    return Speculator(spec, proposer, scheduler, model_config, sampler, max_model_len, structured)
