"""Speculator: speculative decoding's part of an engine step. A decoding sequence may verify up to
k proposed tokens beyond its next one: the scheduler allocates their pages with it (`lookahead`),
the proposer fills them in (`propose`), the target runs all k + 1 positions in one forward (a
query of k + 1 tokens through the attention backend), `verify` accepts a prefix of them by exact
rejection sampling and adds the target's own next token, and `rollback` returns the pages of the
rejected ones. Greedy output is token-identical to decoding without speculation; sampled output
keeps the target's distribution (sample/rejection.py)."""

from dataclasses import dataclass

import numpy as np
import torch

from pagedbench.config import SpeculativeConfig
from pagedbench.device.transfer import to_device, to_list
from pagedbench.engine.output_processor import OutputProcessor
from pagedbench.engine.proposers import DraftModelProposer, NgramProposer
from pagedbench.engine.request import SequenceGroup
from pagedbench.engine.scheduler import Scheduler, SchedulerOutput
from pagedbench.engine.sequence import Sequence
from pagedbench.engine.stats import EngineStats
from pagedbench.engine.structured_outputs import StructuredOutputManager
from pagedbench.model.config import ModelConfig
from pagedbench.sample.rejection import positions, verify
from pagedbench.sample.sampler import Sampler, SamplerOutput, SamplingBatch, fill_logprobs
from pagedbench.sample.sampling_params import SamplingParams


@dataclass(slots=True)
class Verdict:
    """A verifying sequence's outcome: the tokens it emits (accepted proposals, then the target's
    own) and the logits row of each."""

    seq: Sequence
    tokens: list[int]
    rows: list[int]


class Speculator:
    def __init__(
        self,
        spec: SpeculativeConfig,
        proposer: NgramProposer | DraftModelProposer,
        scheduler: Scheduler,
        outputs: OutputProcessor,
        requests: dict[str, SequenceGroup],
        model_config: ModelConfig,
        sampler: Sampler,
        stats: EngineStats,
        max_model_len: int,
        structured: StructuredOutputManager,
    ):
        self.k, self.proposer = spec.num_speculative_tokens, proposer
        self.scheduler, self.outputs, self.requests = scheduler, outputs, requests
        self.model_config, self.sampler, self.stats = model_config, sampler, stats
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
    ) -> tuple[list[Sequence], torch.Tensor, list[Verdict]]:
        """Split a step's sampling rows (seqs[i] has 1 + num_spec[i] logits rows, in order): the
        sequences that sample as usual with their rows, and a Verdict per verifying sequence."""
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
        verdicts, start = [], 0
        for seq in verifying:
            m = len(seq.spec_token_ids)
            a = next((j for j in range(m) if not accepted[start + j]), m)
            verdicts.append(Verdict(seq, [*seq.spec_token_ids[:a], drawn[start + a]], rows[start : start + a + 1]))
            self.stats.spec.record(m, a)
            start += m + 1
        return plain, logits[plain_rows], verdicts

    def rollback(self, verdicts: list[Verdict]) -> None:
        """After the scheduler counted each verifying sequence's emitted tokens as computed: the
        pages of the rejected proposals go back, and the draft's cache holds no rejected token."""
        for v in verdicts:
            seq = v.seq
            seq.spec_token_ids = []
            if not seq.finished:
                self.scheduler.block_manager.trim(seq)
                seq.draft_computed = min(seq.draft_computed, seq.num_computed_tokens)

    def emit(self, verdicts: list[Verdict], logits: torch.Tensor) -> dict[int, tuple[SequenceGroup, int]]:
        """Append each verdict's tokens (with their logprobs where asked) until one stops the
        sequence. Returns the requests that got tokens, by id, with the most any sample got."""
        logprobs = self._logprobs(verdicts, logits)
        progressed = {}
        for v in verdicts:
            count = 0
            for j, token in enumerate(v.tokens):
                self.outputs.append_token(v.seq, token)
                count += 1
                if id(v) in logprobs:
                    self.outputs.record_logprobs([v.seq], [0], logprobs[id(v)][j])
                if v.seq.finished:
                    break
            self.stats.generation_tokens += count
            group = self.requests[v.seq.request_id]
            progressed[id(group)] = (group, max(count, progressed.get(id(group), (group, 0))[1]))
        return progressed

    def _logprobs(self, verdicts: list[Verdict], logits: torch.Tensor) -> dict[int, list[SamplerOutput]]:
        """Per verdict that needs them (logprobs or best_of asked), one SamplerOutput per emitted token."""
        wanted = [v for v in verdicts if v.seq.params.logprobs is not None or v.seq.params.best_of > 1]
        if not wanted:
            return {}
        rows = [r for v in wanted for r in v.rows]
        tokens = to_device(np.array([t for v in wanted for t in v.tokens], dtype=np.int64), logits.device)
        out = SamplerOutput(tokens)
        fill_logprobs(out, logits[rows], tokens, max(v.seq.params.logprobs or 0 for v in wanted))
        host, start, found = out.to_host(), 0, {}
        for v in wanted:
            found[id(v)] = [_row(host, start + j) for j in range(len(v.tokens))]
            start += len(v.tokens)
        return found


def _row(host: SamplerOutput, i: int) -> SamplerOutput:
    """Row i of a host SamplerOutput as a one-row one."""
    top = host.top_token_ids is not None
    return SamplerOutput(
        [host.tokens[i]],
        [host.token_logprobs[i]],
        [host.token_ranks[i]],
        [host.top_logprobs[i]] if top else None,
        [host.top_token_ids[i]] if top else None,
    )
