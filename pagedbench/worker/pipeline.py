"""Pipeline parallelism: each stage's ranks hold a contiguous run of layers and their KV cache.

A step's hidden states [T, hidden_size] go from stage to stage with torch.distributed send/recv
(gloo on CPU, NCCL on CUDA), each tensor-parallel rank to its counterpart in the next stage; the
last stage's tensor-parallel rank 0 sends the logits back to rank 0, the driver, which schedules,
samples and runs stage 0 itself. Every stage runs its steps in the order the driver sent them,
so several steps can be in flight (`PipelineRunner.launch` returns before the logits exist) and
page moves reach each stage's cache between the same two steps as on the driver."""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedbench.model.parallel import logits_group
from pagedbench.worker.model_runner import ModelRunner
from pagedbench.worker.pipeline_stage import StageLink
from pagedbench.worker.step_batch import StepInputs
from pagedbench.worker.tp_workers import ParallelRunner


@dataclass(slots=True)
class InFlight:
    """A step launched into the pipeline: stage 0's send of its hidden states, and the logits' shape."""

    send: object  # a torch.distributed Work
    hidden: torch.Tensor  # kept alive until sent
    num_logits: int


class PipelineRunner(ParallelRunner):
    """The driver's stage 0: `launch` sends the batch to every worker, runs stage 0's layers and
    posts their send; `collect` receives the step's logits from the last stage."""

    def __init__(self, runner: ModelRunner, workers, link: StageLink):
        super().__init__(runner, workers)
        self.link = link
        self.vocab_size = runner.model.config.vocab_size

    def launch(self, inputs: StepInputs, backend_state, timer=None) -> InFlight:
        self.workers.send("run_batch", inputs.batch)
        try:
            hidden = self.local.run(inputs, backend_state, timer)
            send = dist.isend(hidden, dst=self.link.next)
        except RuntimeError as e:
            raise self._broken(e) from None
        return InFlight(send, hidden, len(inputs.batch.logits_indices))

    def collect(self, step: InFlight) -> torch.Tensor:
        logits = torch.empty(step.num_logits, self.vocab_size, dtype=torch.float32, device=self.local.device)
        try:
            step.send.wait()
            dist.recv(logits, src=self.link.last_stage_rank, group=logits_group())
        except RuntimeError as e:
            raise self._broken(e) from None
        return logits

    def run(self, inputs: StepInputs, backend_state, timer=None) -> torch.Tensor:
        return self.collect(self.launch(inputs, backend_state, timer))
