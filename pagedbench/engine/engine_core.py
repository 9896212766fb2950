"""EngineCore: the unfinished requests and the engine's step, as vLLM v1's EngineCore.step: the
Scheduler picks the work, the Executor runs the model, the TokenPicker samples (the Speculator
verifying proposals) into a ModelRunnerOutput, Scheduler.update_from_output applies it to the
sequences, and the OutputProcessor makes the outputs of the requests that progressed. LLMEngine
(llm_engine.py) turns prompts into requests for it and is what users call.

Under pipeline parallelism a step is launched and completed later: each request runs in one of
as many lanes as stages (the least loaded when it arrives), one step per lane is in flight, and
`step()` launches every idle lane's work before it completes the oldest step. A request aborted
while its step is in flight is aborted when the step comes back.

Under async scheduling (docs/async-scheduling.md) one step runs ahead: `step()` schedules and lays
out step N+1 while N is on the device lane (N's sampled tokens feed N+1's placeholders there), then
completes N. A step is run ahead of only when it was advanced (StepUpdate.advance: its tokens
counted, placeholders for its draws); a request that needs last step's tokens on the host, or an
abort, makes the engine complete the step in flight first."""

import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass

from pagedbench.device.lane import DeviceLane
from pagedbench.engine.executor import Executor, LaunchedForward
from pagedbench.engine.output_processor import OutputProcessor
from pagedbench.engine.outputs import RequestOutput
from pagedbench.engine.request import SequenceGroup
from pagedbench.engine.scheduler import Scheduler, SchedulerOutput
from pagedbench.engine.speculator import Speculator
from pagedbench.engine.stats import EngineStats, StepTimes, wasted_slots
from pagedbench.engine.token_picker import Draw, TokenPicker


@dataclass(slots=True)
class LaunchedStep:
    """A step whose model call has started: what it scheduled, the executor's handle, and the wall
    times of its parts so far."""

    sched: SchedulerOutput
    forward: LaunchedForward | None
    times: StepTimes
    lane: int | None
    # Async scheduling: the step's device work on the lane (its LaunchedForward), its draw, and
    # whether it was advanced (the next step may be scheduled before it completes).
    on_lane: Future | None = None
    draw: Draw | None = None
    advanced: bool = False


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
        run_ahead: bool = False,
    ):
        self.scheduler, self.block_manager, self.executor = scheduler, scheduler.block_manager, executor
        self.token_picker, self.speculator, self.outputs, self.stats = token_picker, speculator, outputs, stats
        self.requests = requests  # unfinished requests by id
        # Pipeline parallelism: unfinished requests per lane, the steps in flight (oldest first), and
        # aborts that wait for their request's step to come back.
        self.lane_load = [0] * executor.pipeline_depth
        self.in_flight: deque[LaunchedStep] = deque()
        self.pending_aborts: set[str] = set()
        # Async scheduling: steps run ahead on the device lane (a worker thread on a CPU); requests
        # that need their tokens on the host each step (SequenceGroup.needs_host_tokens), counted.
        self.run_ahead = run_ahead
        self.overlap = True  # False: the lane without running ahead (the host benchmark's synchronous rows)
        self.device_lane = DeviceLane(executor.device, inline=not run_ahead)
        self.host_bound = 0

    def add_request(self, group: SequenceGroup) -> None:
        """Queue a validated request, in the least loaded lane."""
        lane = min(range(len(self.lane_load)), key=self.lane_load.__getitem__)
        group.lane = group.seqs[0].lane = lane
        self.lane_load[lane] += 1
        self.host_bound += group.needs_host_tokens
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
            self.outputs.forget([request_id])  # (an abort's DELTA offsets; a finished request's are gone)
            self.lane_load[group.lane] -= 1
            self.host_bound -= group.needs_host_tokens

    @property
    def busy_lanes(self) -> set[int]:
        """The lanes with a step in flight (their sequences may not be touched until it comes back)."""
        return {step.lane for step in self.in_flight}

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns outputs of the requests that progressed. Under
        pipeline parallelism: launch every idle lane's batch, then complete the oldest in flight."""
        if self.executor.pipeline_depth > 1:
            outputs = self._pipelined_step()
        elif self.run_ahead:
            outputs = self._async_step()
        else:
            launched = self._launch(None)
            outputs = [] if launched is None else self._complete(launched)
        for out in outputs:
            if out.finished:
                self._forget(out.request_id)
        self._abort_waiting()
        return outputs

    @contextmanager
    def synchronous(self):
        """Steps one at a time inside (a profile counting a step's operations, which run on the lane's
        thread otherwise): the steps in flight complete first, their outputs dropped."""
        ahead = self.run_ahead
        while self.in_flight:
            for out in self._complete(self.in_flight.popleft()):
                if out.finished:
                    self._forget(out.request_id)
        self.run_ahead = False
        try:
            yield
        finally:
            self.run_ahead = ahead

    def _abort_waiting(self) -> None:
        """The aborts that waited for their request's step to come back, once it has."""
        busy = self.busy_lanes
        if waited := [r for r in self.pending_aborts if r not in self.requests or self.requests[r].lane not in busy]:
            self.pending_aborts.difference_update(waited)
            self.abort_requests(waited)

    def _async_step(self) -> list[RequestOutput]:
        """Launch the next step, then complete the one in flight (first, when the host needs its
        tokens to schedule: a request that reads them, an abort, a step not advanced)."""
        try:
            outputs = []
            must_wait = self.pending_aborts or self.host_bound or not self.overlap
            if self.in_flight and (must_wait or not self.in_flight[0].advanced):
                outputs = self._complete(self.in_flight.popleft())
                self._abort_waiting()
            if self.host_bound:  # forks, beams, grammars, penalties...: the synchronous step
                launched = self._launch(None)
                return outputs + ([] if launched is None else self._complete(launched))
            launched = self._launch_ahead()
            if launched is not None:
                self.in_flight.append(launched)
                self.stats.in_flight_steps += len(self.in_flight)  # 2: launched while another computes
            if len(self.in_flight) > 1 or (launched is None and self.in_flight):
                outputs += self._complete(self.in_flight.popleft())
            if launched is not None:
                self.scheduler.step_update.advance(launched.sched, launched.draw.seqs)
                launched.advanced = True
            return outputs
        except BaseException:
            while self.in_flight:  # the lane runs steps in order: a failed one takes the next with it
                self.scheduler.abandon(self.in_flight.popleft().sched)
            raise

    def _launch_ahead(self) -> LaunchedStep | None:
        """Schedule and lay out a step on the host, and hand its device work to the lane: page moves,
        inputs (placeholders from the step in flight), plan, forward and draw."""
        times = StepTimes(start=time.perf_counter())
        sched = self.scheduler.schedule(None)
        self.stats.preemptions += sched.num_preempted
        if sched.empty:
            return None
        times.scheduled = times.proposed = time.perf_counter()
        try:
            moves = self._take_page_moves()
            batch = self.executor.runner.lay_out(sched.seqs, sched.num_tokens)
            draw = self.token_picker.draw_rows(sched, batch)
            previous = self.in_flight[-1].draw if self.in_flight else None
            placeholders = previous.feed(batch, sched.seqs) if previous is not None else None
            on_lane = self.device_lane.submit(self._on_device, moves, batch, draw, previous, placeholders, times)
        except BaseException:
            self.scheduler.abandon(sched)
            raise
        return LaunchedStep(sched, None, times, 0, on_lane, draw)

    def _on_device(self, moves, batch, draw: Draw, previous: Draw | None, placeholders, times: StepTimes):
        """A run-ahead step's device work, on the lane after the step before it."""
        self.executor.move_pages(*moves)
        feed = None if placeholders is None else (placeholders[0], previous.on_device.tokens, placeholders[1])
        forward = self.executor.launch_laid_out(batch, times, feed)
        self.token_picker.draw(draw, self.executor.collect(forward, times))
        return forward

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
        if step.on_lane is not None:  # run ahead: its device work, then its draw's copy to the host
            step.forward = step.on_lane.result()
            output = self.token_picker.drawn(step.draw)
        else:
            try:
                logits = self.executor.collect(step.forward, step.times)
            except BaseException:
                self.scheduler.abandon(sched)
                raise
            output = self.token_picker(sched, step.forward.inputs.batch, logits, self.speculator)
        progressed = self.scheduler.update_from_output(sched, output)
        step.times.end = time.perf_counter()
        bm, running = self.block_manager, self.scheduler.running
        wasted = wasted_slots(running, bm.block_size) if self.stats.samples_next_step else None
        self.stats.record_step(step.times, bm.num_used_blocks, bm.num_shared_blocks, wasted, len(running))
        return self.outputs.process_outputs(progressed, step.times.end)

    def _move_pages(self) -> None:
        """The page moves the block manager queued for this step: swaps and copy-on-write copies."""
        self.executor.move_pages(*self._take_page_moves())

    def _take_page_moves(self) -> tuple:
        """The moves the block manager queued for this step, counted: (swap out, copies, swap in, states)."""
        swap_out, swap_in = self.block_manager.take_swaps()
        copies = self.block_manager.take_copies()
        self.stats.swap_outs += bool(swap_out)
        self.stats.block_copies += len(copies)
        return swap_out, copies, swap_in, self.block_manager.take_state_copies()
