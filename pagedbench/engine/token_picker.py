"""TokenPicker: the step's next token for every sequence that samples. A request's first token
forks it into its best_of samples (all reading the same logits row); samples draw from the
batched Sampler in one call; beams report their best continuations to their search, which
forks, continues and prunes them once every live beam of the request has reported."""

import numpy as np
import torch

from pagedbench.device.timer import DeviceTimer
from pagedbench.device.transfer import to_device, to_list
from pagedbench.engine.input_processor import InputProcessor
from pagedbench.engine.output_processor import OutputProcessor
from pagedbench.engine.request import SequenceGroup
from pagedbench.engine.scheduler import Scheduler
from pagedbench.engine.sequence import Sequence
from pagedbench.engine.stats import EngineStats
from pagedbench.engine.structured_outputs import StructuredOutputManager
from pagedbench.model.config import ModelConfig
from pagedbench.sample.sampler import Sampler, SamplingBatch


class TokenPicker:
    def __init__(
        self,
        requests: dict[str, SequenceGroup],
        scheduler: Scheduler,
        inputs: InputProcessor,
        outputs: OutputProcessor,
        model_config: ModelConfig,
        device: torch.device,
        seed: int,
        stats: EngineStats,
        timer: DeviceTimer,
        structured: StructuredOutputManager,
        logits_processors: list = (),
    ):
        self.requests, self.scheduler, self.inputs, self.outputs = requests, scheduler, inputs, outputs
        self.model_config, self.device, self.stats, self.timer = model_config, device, stats, timer
        self.structured = structured
        self.sampler = Sampler(device, seed, logits_processors)
        self.sampling_batch: SamplingBatch | None = None  # last step's, reused while its sequences run on

    def __call__(self, seqs: list[Sequence], logits: torch.Tensor) -> list[SequenceGroup]:
        """Give `seqs` (logits row i for seqs[i]) their next tokens. Returns the requests that got tokens."""
        seqs, rows, groups = self._fork_samples(seqs)
        progressed: dict[int, SequenceGroup] = {}
        samples = [j for j, g in enumerate(groups) if g.beam is None]
        if samples:
            sampled = [seqs[j] for j in samples]
            picked = [rows[j] for j in samples]
            self._sample(sampled, logits if picked == list(range(len(logits))) else logits[picked])
            progressed.update((id(groups[j]), groups[j]) for j in samples)
        beams = [j for j, g in enumerate(groups) if g.beam is not None]
        if beams:
            for group in self._advance_beams([seqs[j] for j in beams], logits[[rows[j] for j in beams]]):
                progressed[id(group)] = group
        return list(progressed.values())

    def _fork_samples(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[int], list[SequenceGroup]]:
        """(sequences, their logits rows, their requests): `seqs`, then the samples that requests
        fork at their first token (reading their parent's row)."""
        seqs, rows = list(seqs), list(range(len(seqs)))
        groups = [self.requests[s.request_id] for s in seqs]
        for i, (seq, group) in enumerate(zip(list(seqs), list(groups))):
            if group.beam is None and not seq.forked:
                for index in range(1, group.params.best_of):
                    child = self.scheduler.fork(seq, index)
                    child.generator = self.inputs.generator(group.params, index)
                    group.seqs.append(child)
                    seqs.append(child), groups.append(group), rows.append(i)
        return seqs, rows, groups

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """One batched draw for `seqs` (logits row i for seqs[i]), read back in one copy."""
        cfg = self.model_config
        processors = self.sampler.logits_processors
        batch = SamplingBatch.from_seqs(
            seqs, cfg.vocab_size, self.device, cfg.eos_token_ids, self.sampling_batch, processors
        )
        self.sampling_batch = batch
        batch.grammar = self.structured.mask(seqs)
        sample_start = self.timer.mark()
        out = self.sampler(logits, batch)
        self.timer.span("sample", sample_start)
        host = out.to_host()  # the step's one wait for the device
        if batch.logprob_rows is not None:
            self.outputs.record_logprobs(seqs, batch.logprob_rows, host)
        self.stats.generation_tokens += len(seqs)
        for seq, token in zip(seqs, host.tokens):
            self.outputs.append_token(seq, token)

    def _advance_beams(self, seqs: list[Sequence], logits: torch.Tensor) -> list[SequenceGroup]:
        """Report each beam's best continuations; a request whose live beams have all reported
        selects its next beams (fork, continue, free). Returns those requests."""
        temperature = to_device(np.array([s.params.temperature or 1.0 for s in seqs], dtype=np.float32), logits.device)
        logprobs = torch.log_softmax(logits / temperature[:, None], dim=-1)
        k = min(max(self.requests[s.request_id].beam.num_candidates for s in seqs), logprobs.shape[-1])
        values, token_ids = map(to_list, logprobs.topk(k, dim=-1))
        reported: dict[int, SequenceGroup] = {}
        for seq, lps, ids in zip(seqs, values, token_ids):
            group = self.requests[seq.request_id]
            group.beam.report(seq, lps, ids)
            seq.paused = True  # until every live beam of its request has reported
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
                beams.append(self.scheduler.fork(c.parent, rank))
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
