"""One pipeline stage's side of a step on a worker: receive the previous stage's hidden states,
run the stage's layers, send the result on (pipeline.py has the driver's side)."""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedbench.model.parallel import PPStage, logits_group
from pagedbench.worker.model_runner import ModelRunner
from pagedbench.worker.step_batch import StepBatch


@dataclass(frozen=True, slots=True)
class StageLink:
    """Rank `tp_rank` of pipeline `stage`: its counterparts in the stages before and after."""

    stage: PPStage
    tp_rank: int
    tp_size: int

    @property
    def prev(self) -> int:
        return (self.stage.index - 1) * self.tp_size + self.tp_rank

    @property
    def next(self) -> int:
        return (self.stage.index + 1) * self.tp_size + self.tp_rank

    @property
    def last_stage_rank(self) -> int:
        """The rank that sends the logits to the driver: the last stage's tensor-parallel rank 0."""
        return (self.stage.size - 1) * self.tp_size


class StageRunner:
    """A worker's ModelRunner for one pipeline stage: a step receives the previous stage's hidden
    states (unless first), runs the stage's layers and sends the result on (the last stage: its
    logits to the driver)."""

    def __init__(self, runner: ModelRunner, link: StageLink):
        self.runner, self.link = runner, link
        self.hidden_size = runner.model.config.hidden_size

    def run_batch(self, batch: StepBatch) -> None:
        runner, link = self.runner, self.link
        inputs = batch.to(runner.device)
        state = runner.backend.plan(inputs.metadata)
        hidden = None
        if not link.stage.first:
            hidden = torch.empty(len(batch.input_ids), self.hidden_size, dtype=runner.dtype, device=runner.device)
            dist.recv(hidden, src=link.prev)
        out = runner.run(inputs, state, hidden=hidden)
        if not link.stage.last:
            dist.send(out, dst=link.next)
        elif out is not None:  # tensor-parallel rank 0 of the last stage
            dist.send(out, dst=0, group=logits_group())

    def __getattr__(self, name):  # copy_blocks, swap_out, swap_in
        return getattr(self.runner, name)
