"""TokenPicker: the sampling half of a step's model call (the model runner's, in vLLM v1), from the
step's logits to a ModelRunnerOutput that changes no sequence (Scheduler.update_from_output applies
it). Verifying sequences go to the speculator. A request's first token is drawn for each of its
best_of samples: the samples are forked for it, each reading its parent's logits row, and join the
scheduler in update_from_output. Samples draw from the batched Sampler in one call; beams give their
best continuations for their search."""

from dataclasses import dataclass

import numpy as np
import torch

from pagedbench.device.timer import DeviceTimer
from pagedbench.device.transfer import HostCopy, to_device, to_list
from pagedbench.engine.input_processor import InputProcessor
from pagedbench.engine.request import SequenceGroup
from pagedbench.engine.scheduler import SchedulerOutput
from pagedbench.engine.sequence import Sequence
from pagedbench.engine.speculator import Speculator
from pagedbench.engine.step_update import BeamCandidates, ModelRunnerOutput, Sampled, logprob_row
from pagedbench.engine.structured_outputs import StructuredOutputManager
from pagedbench.model.config import ModelConfig
from pagedbench.sample.sampler import Sampler, SamplerOutput, SamplingBatch
from pagedbench.worker.step_batch import StepBatch


@dataclass(slots=True, eq=False)
class Draw:
    """An async step's sampling: row i draws for seqs[i]; once drawn, the tokens on the device (the next
    step's placeholders read them) and their copy to the host under way."""

    seqs: list[Sequence]
    batch: SamplingBatch | None
    on_device: SamplerOutput | None = None
    copy: HostCopy | None = None

    def feed(self, batch: StepBatch, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray] | None:
        """The next step's PLACEHOLDER positions in `batch` (of `seqs`, as scheduled) and the rows of
        this draw's tokens they take (executor.Feed, with the tokens once drawn); None when it has none."""
        positions = batch.placeholder_positions
        if not len(positions):
            return None
        row = {id(seq): i for i, seq in enumerate(self.seqs)}
        rows = np.array([row[id(seqs[i])] for i in batch.token_seq_idx[positions]], dtype=np.int64)
        return positions, rows


class TokenPicker:
    def __init__(
        self,
        requests: dict[str, SequenceGroup],
        inputs: InputProcessor,
        model_config: ModelConfig,
        device: torch.device,
        seed: int,
        timer: DeviceTimer,
        structured: StructuredOutputManager,
        logits_processors: list = (),
    ):
        self.requests, self.inputs = requests, inputs
        self.model_config, self.device, self.timer = model_config, device, timer
        self.structured = structured
        self.sampler = Sampler(device, seed, logits_processors)
        self.sampling_batch: SamplingBatch | None = None  # last step's, reused while its sequences run on

    def __call__(
        self, sched: SchedulerOutput, batch: StepBatch, logits: torch.Tensor, speculator: Speculator | None = None
    ) -> ModelRunnerOutput:
        """Step `sched`'s output from its `logits` (rows as `batch` laid them out: the sampling rows,
        each verifying sequence's 1 + proposals among them, then the prompt chunks' that want prompt logprobs)."""
        num_sampling = batch.num_sampling_logits
        out = ModelRunnerOutput(prompt_logprob_rows=batch.prompt_logprob_rows)
        if batch.prompt_logprob_rows:
            out.prompt_logits = logits[num_sampling:]
        seqs, logits = [sched.seqs[i] for i in batch.sampling_rows], logits[:num_sampling]
        if any(batch.num_spec):  # verifying sequences emit the proposals they accept, then the target's token
            seqs, logits, out.sampled = speculator.verify(seqs, batch.num_spec, logits)
        if not seqs:
            return out
        seqs, rows, groups, parents = self._fork_samples(seqs)
        samples = [j for j, g in enumerate(groups) if g.beam is None]
        if samples:
            picked = [rows[j] for j in samples]
            picked_logits = logits if picked == list(range(len(logits))) else logits[picked]
            drawn = self._sample([seqs[j] for j in samples], picked_logits)
            for j, s in zip(samples, drawn):
                s.parent = parents[j]
            out.sampled += drawn
        beams = [j for j, g in enumerate(groups) if g.beam is not None]
        if beams:
            out.beams = self._beam_candidates([seqs[j] for j in beams], logits[[rows[j] for j in beams]])
        return out

    def _fork_samples(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[int], list[SequenceGroup], list]:
        """(sequences, their logits rows, their requests, their parents): `seqs` (no parent), then the
        samples that requests fork at their first token (reading their parent's row), not yet scheduled."""
        seqs, rows, parents = list(seqs), list(range(len(seqs))), [None] * len(seqs)
        groups = [self.requests[s.request_id] for s in seqs]
        for i, (seq, group) in enumerate(zip(list(seqs), list(groups))):
            if group.beam is None and not seq.forked:
                for index in range(1, group.params.best_of):
                    child = seq.fork(index)
                    child.generator = self.inputs.generator(group.params, index)
                    seqs.append(child), groups.append(group), rows.append(i), parents.append(seq)
        return seqs, rows, groups, parents

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Sampled]:
        """One batched draw for `seqs` (logits row i for seqs[i]), read back in one copy."""
        batch = self._sampling_batch(seqs)
        sample_start = self.timer.mark()
        out = self.sampler(logits, batch)
        self.timer.span("sample", sample_start)
        return self._sampled(seqs, batch, out.to_host())  # the step's one wait for the device

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        cfg = self.model_config
        processors = self.sampler.logits_processors
        batch = SamplingBatch.from_seqs(
            seqs, cfg.vocab_size, self.device, cfg.eos_token_ids, self.sampling_batch, processors
        )
        self.sampling_batch = batch
        batch.grammar = self.structured.mask(seqs)
        return batch

    def _sampled(self, seqs: list[Sequence], batch: SamplingBatch, host: SamplerOutput) -> list[Sampled]:
        place = {row: k for k, row in enumerate(batch.logprob_rows or ())}
        return [
            Sampled(seq, [token], [logprob_row(host, i, place[i])] if i in place else None)
            for i, (seq, token) in enumerate(zip(seqs, host.tokens))
        ]

    # ---- async scheduling: a plain step's draw, split at the device ------------------------------

    def draw_rows(self, sched: SchedulerOutput, batch: StepBatch) -> "Draw":
        """On the host, before the step launches: who draws (every sampling row of a step without
        forks, beams, proposals or prompt logprobs) and their SamplingBatch."""
        seqs = [sched.seqs[i] for i in batch.sampling_rows]
        return Draw(seqs, self._sampling_batch(seqs) if seqs else None)

    def draw(self, draw: "Draw", logits: torch.Tensor) -> None:
        """On the device lane, after the forward: the draw, its tokens kept on the device for the next
        step's placeholders, and its copy to the host started."""
        if draw.seqs:
            draw.on_device = self.sampler(logits[: len(draw.seqs)], draw.batch)
            draw.copy = draw.on_device.host_copy()

    def drawn(self, draw: "Draw") -> ModelRunnerOutput:
        """On the host, a step later: the draw's tokens (waiting for its copy only)."""
        if not draw.seqs:
            return ModelRunnerOutput()
        return ModelRunnerOutput(sampled=self._sampled(draw.seqs, draw.batch, draw.on_device.from_host(draw.copy)))

    def _beam_candidates(self, seqs: list[Sequence], logits: torch.Tensor) -> list[BeamCandidates]:
        """Each beam's best continuations: the 2k best tokens of its log-softmax (k: its beam width)."""
        temperature = to_device(np.array([s.params.temperature or 1.0 for s in seqs], dtype=np.float32), logits.device)
        logprobs = torch.log_softmax(logits / temperature[:, None], dim=-1)
        k = min(max(self.requests[s.request_id].beam.num_candidates for s in seqs), logprobs.shape[-1])
        values, token_ids = map(to_list, logprobs.topk(k, dim=-1))
        return [BeamCandidates(seq, lps, ids) for seq, lps, ids in zip(seqs, values, token_ids)]
