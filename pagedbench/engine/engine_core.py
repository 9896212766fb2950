"""EngineCore: the unfinished requests and the engine's step, as vLLM v1's EngineCore.step: the
Scheduler picks the work, the Executor runs the model, the TokenPicker samples (the Speculator
verifying proposals) into a ModelRunnerOutput, Scheduler.update_from_output applies it to the
sequences, and the OutputProcessor makes the outputs of the requests that progressed. LLMEngine
(llm_engine.py) turns prompts into requests for it and is what users call.

Under pipeline parallelism a step is launched and completed later: each request runs in one of
as many lanes as stages (the least loaded when it arrives), one step per lane is in flight, and
`step()` launches every idle lane's work before it completes the oldest step. A request aborted
while its step is in flight is aborted when the step comes back."""

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from pagedbench.engine.executor import Executor, LaunchedForward
from pagedbench.engine.output_processor import OutputProcessor
from pagedbench.engine.outputs import RequestOutput
from pagedbench.engine.request import SequenceGroup
from pagedbench.engine.scheduler import Scheduler, SchedulerOutput
from pagedbench.engine.speculator import Speculator
from pagedbench.engine.stats import EngineStats, StepTimes, wasted_slots
from pagedbench.engine.token_picker import TokenPicker


@dataclass(slots=True)
class LaunchedStep:
    """A step whose model call has started: what it scheduled, the executor's handle, and the wall
    times of its parts so far."""

    sched: SchedulerOutput
    forward: LaunchedForward
    times: StepTimes
    lane: int | None


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        token_picker: TokenPicker,
        speculator: Speculator | None,
        outputs: OutputProcessor,
        stats: EngineStats,
        requests: dict[str, SequenceGroup],
    ):
        self.scheduler, self.block_manager, self.executor = scheduler, scheduler.block_manager, executor
        self.token_picker, self.speculator, self.outputs, self.stats = token_picker, speculator, outputs, stats
        self.requests = requests  # unfinished requests by id
        # Pipeline parallelism: unfinished requests per lane, the steps in flight (oldest first), and
        # aborts that wait for their request's step to come back.
        self.lane_load = [0] * executor.pipeline_depth
        self.in_flight: deque[LaunchedStep] = deque()
        self.pending_aborts: set[str] = set()

    def add_request(self, group: SequenceGroup) -> None:
        """Queue a validated request, in the least loaded lane."""
        lane = min(range(len(self.lane_load)), key=self.lane_load.__getitem__)
        group.lane = group.seqs[0].lane = lane
        self.lane_load[lane] += 1
        self.requests[group.request_id] = group
        self.scheduler.add(group.seqs[0])

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort these requests (unknown ids are ignored); one whose step is in flight, once it comes back."""
        busy = self.busy_lanes
        for rid in request_ids:
            group = self.requests.get(rid)
            if group is not None and group.lane in busy:
                self.pending_aborts.add(rid)
                continue
            self._forget(rid)
            for seq in group.seqs if group is not None else []:
                if not seq.finished:
                    self.scheduler.finish(seq, "abort")

    def _forget(self, request_id: str) -> None:
        """A request leaves the engine (finished or aborted)."""
        group = self.requests.pop(request_id, None)
        if group is not None:
            self.lane_load[group.lane] -= 1

    @property
    def busy_lanes(self) -> set[int]:
        """The lanes with a step in flight (their sequences may not be touched until it comes back)."""
        return {step.lane for step in self.in_flight}

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns outputs of the requests that progressed. Under
        pipeline parallelism: launch every idle lane's batch, then complete the oldest in flight."""
        if self.executor.pipeline_depth > 1:
            outputs = self._pipelined_step()
        else:
            launched = self._launch(None)
            outputs = [] if launched is None else self._complete(launched)
        for out in outputs:
            if out.finished:
                self._forget(out.request_id)
        busy = self.busy_lanes
        if waited := [r for r in self.pending_aborts if r not in self.requests or self.requests[r].lane not in busy]:
            self.pending_aborts.difference_update(waited)
            self.abort_requests(waited)
        return outputs

    def _pipelined_step(self) -> list[RequestOutput]:
        try:
            busy = self.busy_lanes
            for lane in range(self.executor.pipeline_depth):
                if lane not in busy and (launched := self._launch(lane)) is not None:
                    self.in_flight.append(launched)
                    self.stats.in_flight_steps += len(self.in_flight)
            if not self.in_flight:
                return []
            return self._complete(self.in_flight.popleft())
        except BaseException:
            while self.in_flight:  # the stages hold steps nobody will collect: the pipeline is gone
                self.scheduler.abandon(self.in_flight.popleft().sched)
            self.executor.shutdown(broken=True)
            raise

    def _launch(self, lane: int | None) -> LaunchedStep | None:
        """Schedule (`lane`'s sequences, under pipeline parallelism) and start the model call."""
        times = StepTimes(start=time.perf_counter())
        if self.speculator is not None:
            self.speculator.before_schedule()
        sched = self.scheduler.schedule(lane)
        self.stats.preemptions += sched.num_preempted
        if sched.empty:
            return None
        times.scheduled = time.perf_counter()
        try:
            self._move_pages()
            if self.speculator is not None:
                self.speculator.propose(sched)
            times.proposed = time.perf_counter()
            forward = self.executor.launch(sched.seqs, sched.num_tokens, times)
        except BaseException:
            self.scheduler.abandon(sched)
            raise
        return LaunchedStep(sched, forward, times, lane)

    def _complete(self, step: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step's logits, sample (the model runner's output), apply the step to
        its sequences (Scheduler.update_from_output) and make the outputs of its new tokens."""
        sched = step.sched
        try:
            logits = self.executor.collect(step.forward, step.times)
        except BaseException:
            self.scheduler.abandon(sched)
            raise
        output = self.token_picker(sched, step.forward.inputs.batch, logits, self.speculator)
        progressed = self.scheduler.update_from_output(sched, output)
        step.times.end = time.perf_counter()
        bm, running = self.block_manager, self.scheduler.running
        wasted = wasted_slots(running, bm.block_size)
        self.stats.record_step(step.times, bm.num_used_blocks, bm.num_shared_blocks, wasted, len(running))
        return self.outputs.process_outputs(progressed, step.times.end)

    def _move_pages(self) -> None:
        """The page moves the block manager queued for this step: swaps and copy-on-write copies."""
        swap_out, swap_in = self.block_manager.take_swaps()
        copies = self.block_manager.take_copies()
        self.executor.move_pages(swap_out, copies, swap_in, self.block_manager.take_state_copies())
        self.stats.swap_outs += bool(swap_out)
        self.stats.block_copies += len(copies)
