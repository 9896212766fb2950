"""LLMEngine: requests in, one step at a time, RequestOutputs out. It only orchestrates: the
InputProcessor turns a prompt into a request, the Scheduler picks the step's work (the
BlockManager its pages), the Executor runs the model, the TokenPicker samples, and the
OutputProcessor turns new tokens into text, stops and outputs.

Under pipeline parallelism a step is launched and completed later: each request runs in one of
as many lanes as stages (the least loaded when it arrives), one step per lane is in flight, and
`step()` launches every idle lane's work before it completes the oldest step."""

import dataclasses
import itertools
import secrets
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from pagedbench.config import EngineConfig
from pagedbench.engine.block_manager import BlockManager
from pagedbench.engine.executor import Executor
from pagedbench.engine.input_processor import InputProcessor
from pagedbench.engine.output_processor import OutputProcessor
from pagedbench.engine.outputs import RequestOutput
from pagedbench.engine.proposers import DraftModelProposer, NgramProposer
from pagedbench.engine.request import SequenceGroup
from pagedbench.engine.scheduler import Scheduler, SchedulerOutput
from pagedbench.engine.sequence import SequenceStatus
from pagedbench.engine.speculator import Speculator
from pagedbench.engine.stats import EngineStats, RunCounters, wasted_slots
from pagedbench.engine.structured_outputs import StructuredOutputManager
from pagedbench.engine.token_picker import TokenPicker
from pagedbench.model.fused import dynamo_seconds
from pagedbench.model.hybrid import hybrid_engine_config
from pagedbench.model.loader import ResolvedModel, resolve_model_config
from pagedbench.model.tokenizer import tokenizer_for
from pagedbench.sample.sampling_params import BatchLogitsProcessor, BeamSearchParams, SamplingParams


@dataclass(slots=True)
class LaunchedStep:
    """A step whose model call has started: what it scheduled, the executor's handle, and the wall
    times (start, scheduled, proposed) so far."""

    sched: SchedulerOutput
    launched: tuple
    times: tuple[float, float, float]
    lane: int | None


class LLMEngine:
    def __init__(self, config: EngineConfig, logits_processors: list | None = None, model: ResolvedModel | None = None):
        """`logits_processors`: engine-wide BatchLogitsProcessors (instances, or subclasses built
        with no arguments) that see every sampling row each step, after each request's own.
        `model`: config.model as the command already resolved it (else resolved here)."""
        config.validate()
        logits_processors = engine_logits_processors(logits_processors)
        if config.seed is None:  # one fresh seed, shared with the tensor-parallel workers
            config = dataclasses.replace(config, seed=secrets.randbelow(2**31))
        self.config = config
        self.model_config, path = model or resolve_model_config(
            config.model, need_weights=config.load_format != "dummy"
        )
        self.model_path = path  # the model's directory (weights, tokenizer); None for a preset
        cfg = self.model_config
        if cfg.linear is not None:
            config = self.config = hybrid_engine_config(config)
        self.tokenizer = tokenizer_for(config.tokenizer, path, cfg.vocab_size, cfg.eos_token_ids)
        self.executor = Executor(config, cfg, path)
        ex = self.executor
        self.device, self.dtype = ex.device, ex.dtype
        self.max_model_len, self.num_blocks = ex.max_model_len, ex.num_blocks  # the executor sized the cache
        self.block_manager = BlockManager(
            ex.num_blocks, config.block_size, config.enable_prefix_caching, ex.num_cpu_blocks,
            cfg.window_of_every_layer, ex.num_state_slots, ex.state_snapshots,
        )  # fmt: skip
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.scheduling_policy,
            config.preemption_mode,
        )
        self.stats = EngineStats()
        self.requests: dict[str, SequenceGroup] = {}  # unfinished requests by id
        self.structured_outputs = StructuredOutputManager(
            self.tokenizer,
            cfg.vocab_size,
            cfg.eos_token_ids,
            self.device,
            self.stats,
            ex.timer,
            config.disable_any_whitespace,
        )
        self.input_processor = InputProcessor(
            config, cfg, self.tokenizer, self.max_model_len, self.device, self.structured_outputs
        )
        self.output_processor = OutputProcessor(self.tokenizer, cfg, self.max_model_len, self.scheduler)
        self.token_picker = TokenPicker(
            self.requests,
            self.scheduler,
            self.input_processor,
            self.output_processor,
            cfg,
            self.device,
            config.seed,
            self.stats,
            ex.timer,
            self.structured_outputs,
            logits_processors,
        )
        self.speculator = self._speculator()
        self._ids = itertools.count()
        # Pipeline parallelism: unfinished requests per lane, the steps in flight (oldest first),
        # and aborts that wait for their request's step to come back.
        self.lane_load = [0] * ex.pipeline_depth
        self.in_flight: deque[LaunchedStep] = deque()
        self._pending_aborts: set[str] = set()

    def _speculator(self) -> Speculator | None:
        spec = self.config.speculative
        if spec is None:
            return None
        if spec.method == "ngram":
            proposer = NgramProposer(spec)
        else:
            proposer = DraftModelProposer(self.executor.draft_runner)
        args = (self.model_config, self.token_picker.sampler, self.stats, self.max_model_len, self.structured_outputs)
        return Speculator(spec, proposer, self.scheduler, self.output_processor, self.requests, *args)

    @classmethod
    def from_engine_args(cls, args: EngineConfig) -> "LLMEngine":
        """vLLM's constructor name (EngineArgs is EngineConfig here)."""
        return cls(args)

    # The worker side, as the executor holds it.
    runner = property(lambda self: self.executor.runner)
    backend = property(lambda self: self.executor.backend)
    model = property(lambda self: self.executor.model)
    timer = property(lambda self: self.executor.timer, doc="device spans of steps (a DeviceTimer)")
    cuda_graphs = property(lambda self: self.executor.cuda_graphs, doc='"on: ..." or "off: why"')
    workers = property(lambda self: self.executor.workers, doc="tensor-parallel worker processes, if any")

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is collected)."""
        self.executor.shutdown()

    # ---- what a benchmark run reads -------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Processes (GPUs) the engine runs on: tensor x pipeline parallel ranks."""
        return self.executor.world

    def set_timing(self, enabled: bool) -> None:
        """Device spans from CUDA events, read after a run (no sync in the loop); off by default."""
        self.timer.enabled = enabled

    def gauges(self) -> dict[str, float]:
        """What the server's /metrics reads now: requests by queue (a request's samples count once),
        KV use, the token, preemption and prefix-cache counters and, when speculating, the
        proposals' counters (a data-parallel front sums its replicas' gauges)."""
        sched, bm, st = self.scheduler, self.block_manager, self.stats

        def requests(queue) -> int:
            return len({s.request_id for s in queue})

        spec = {}
        if self.speculator is not None:
            spec = {
                "spec_drafts": st.spec.num_drafts,
                "spec_draft_tokens": st.spec.num_draft_tokens,
                "spec_accepted_tokens": st.spec.num_accepted_tokens,
            } | {f"spec_accepted_at_{j}": n for j, n in enumerate(st.spec.accepted_per_position)}
        return spec | {
            "running": requests(sched.running),
            "waiting": requests(sched.waiting),
            "swapped": requests(sched.swapped),
            "used_blocks": bm.num_used_blocks,
            "num_blocks": bm.num_blocks,
            "prompt_tokens": st.prompt_tokens,
            "generation_tokens": st.generation_tokens,
            "preemptions": st.preemptions,
            "prefix_queries": bm.prefix_queries,
            "prefix_hits": bm.prefix_hits,
        }

    def reset_counters(self) -> None:
        """Start counting a run: stats, device spans, prefix-cache and compile counters from zero."""
        self.stats.reset()
        self.timer.reset()
        bm = self.block_manager
        self._counted_from = (bm.prefix_queries, bm.prefix_hits, self.backend.compile_seconds, dynamo_seconds())

    def run_counters(self) -> RunCounters:
        """The counters since reset_counters()."""
        queries, hits, compiled, dynamo = getattr(self, "_counted_from", (0, 0, 0.0, 0.0))
        bm = self.block_manager
        backend = self.backend.compile_seconds - compiled
        return RunCounters(
            self.stats,
            self.timer.totals(),
            bm.prefix_queries - queries,
            bm.prefix_hits - hits,
            backend,
            # torch.compile's time in this process, less a compiling backend's own (flex's kernels)
            max(0.0, dynamo_seconds() - dynamo - backend) if self.executor.compiled else 0.0,
        )

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        return self.input_processor.tokenize(prompt)

    def validate_request(self, token_ids: list[int], params: SamplingParams | BeamSearchParams) -> None:
        self.input_processor.validate(token_ids, params)

    def validate_priority(self, priority) -> None:
        self.input_processor.validate_priority(priority)

    def add_request(
        self,
        prompt,
        params: SamplingParams | BeamSearchParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request (sampling, or beam search with BeamSearchParams); raises ValueError
        (and changes nothing) when it is invalid. `priority` needs scheduling_policy="priority".
        vLLM's positional order, add_request(request_id, prompt, params), is accepted too."""
        if isinstance(request_id, (SamplingParams, BeamSearchParams)) and isinstance(prompt, str):
            prompt, params, request_id = params, request_id, prompt
        if isinstance(params, BeamSearchParams) and self.speculator is not None:
            raise ValueError("beam search does not run with speculative decoding (speculative_config is set)")
        if params is not None and not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise TypeError(f"params must be a SamplingParams or BeamSearchParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else request_id
        group = self.input_processor.process(request_id, prompt, params or SamplingParams(), arrival_time, priority)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        lane = min(range(len(self.lane_load)), key=self.lane_load.__getitem__)
        group.lane = group.seqs[0].lane = lane
        self.lane_load[lane] += 1
        self.requests[request_id] = group
        self.scheduler.add(group.seqs[0])
        return request_id

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort one request or several (vLLM v1 takes a list); unknown ids are ignored. A request
        whose step is in flight is aborted when the step comes back."""
        busy = {step.lane for step in self.in_flight}
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            group = self.requests.get(rid)
            if group is not None and group.lane in busy:
                self._pending_aborts.add(rid)
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

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def get_tokenizer(self):
        """The Hugging Face tokenizer, or None for a preset without one."""
        return self.tokenizer

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use stay with their sequences)."""
        self.block_manager.reset_prefix_cache()

    def warm_up(self, num_seqs: int = 4) -> tuple[float, float]:
        """Run, before the first real request, what a serving step can need: a full chunk of
        prefill (max_num_batched_tokens, as vLLM's profile run) beside a few short prompts, then
        their decodes together. Compiled backends (flex) build their graphs and lazy initialisation
        happens here, not in the first requests' latency
        (the compiled model's too, fused.py). It leaves no trace: its requests finish,
        and the stats and the cached prefixes are reset. Returns (seconds, of which compiling)."""
        if self.has_unfinished_requests():
            raise ValueError("warm_up runs on an idle engine, before requests are added")
        start, compiled, dynamo = time.perf_counter(), self.backend.compile_seconds, dynamo_seconds()
        vocab = self.model_config.vocab_size
        long_len = max(1, min(self.config.max_num_batched_tokens, self.max_model_len - 4))
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, detokenize=False)
        for i, length in enumerate([long_len] + [8] * min(num_seqs, self.config.max_num_seqs - 1)):
            ids = [(7 * t + i) % (vocab - 1) + 1 for t in range(length)]
            self.add_request({"prompt_token_ids": ids}, params, request_id=f"warm-up-{i}")
        while self.has_unfinished_requests():
            self.step()
        self.stats.reset()
        self.reset_prefix_cache()
        backend = self.backend.compile_seconds - compiled
        model = max(0.0, dynamo_seconds() - dynamo - backend) if self.executor.compiled else 0.0
        return time.perf_counter() - start, backend + model

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns outputs of the requests that progressed. Under
        pipeline parallelism: launch every idle lane's batch, then complete the oldest in flight."""
        if self.executor.pipeline_depth > 1:
            return self._pipelined_step()
        launched = self._launch(None)
        return [] if launched is None else self._complete(launched)

    def _pipelined_step(self) -> list[RequestOutput]:
        try:
            busy = {step.lane for step in self.in_flight}
            for lane in range(self.executor.pipeline_depth):
                if lane not in busy and (launched := self._launch(lane)) is not None:
                    self.in_flight.append(launched)
                    self.stats.in_flight_steps += len(self.in_flight)
            if not self.in_flight:
                return []
            outputs = self._complete(self.in_flight.popleft())
        except BaseException:
            while self.in_flight:  # the stages hold steps nobody will collect: the pipeline is gone
                self._abandon(self.in_flight.popleft().sched)
            self.executor.shutdown(broken=True)
            raise
        for rid in [r for r in self._pending_aborts if r not in self.requests or not self._lane_busy(r)]:
            self._pending_aborts.discard(rid)
            self.abort_request(rid)
        return outputs

    def _lane_busy(self, request_id: str) -> bool:
        return self.requests[request_id].lane in {step.lane for step in self.in_flight}

    def _launch(self, lane: int | None) -> LaunchedStep | None:
        """Schedule (`lane`'s sequences, under pipeline parallelism) and start the model call."""
        t_start = time.perf_counter()
        if self.speculator is not None:
            self.speculator.before_schedule()
        sched = self.scheduler.schedule(lane)
        self.stats.preemptions += sched.num_preempted
        if sched.empty:
            return None
        t_schedule = time.perf_counter()
        try:
            self._move_pages()
            if self.speculator is not None:
                self.speculator.propose(sched)
            t_propose = time.perf_counter()
            launched = self.executor.launch(sched.seqs, sched.num_tokens)
        except BaseException:
            self._abandon(sched)
            raise
        return LaunchedStep(sched, launched, (t_start, t_schedule, t_propose), lane)

    def _complete(self, step: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step's logits, sample, and turn new tokens into outputs."""
        sched = step.sched
        try:
            inputs, logits, forward_times = self.executor.collect(step.launched)
        except BaseException:
            self._abandon(sched)
            raise
        for seq, n in zip(sched.seqs, sched.num_tokens):
            self.stats.prompt_tokens += max(0, min(n, seq.num_prompt_tokens - seq.num_computed_tokens))
        plan = inputs.plan
        num_sampling = plan.num_sampling_logits
        sampling, sampling_logits = [sched.seqs[i] for i in plan.sampling_rows], logits[:num_sampling]
        verdicts = []
        if any(plan.num_spec):  # verifying sequences computed only the tokens they emit
            sampling, plain_logits, verdicts = self.speculator.verify(sampling, plan.num_spec, sampling_logits)
            emitted = {id(v.seq): len(v.tokens) for v in verdicts}
            sched.num_tokens = [emitted.get(id(s), n) for s, n in zip(sched.seqs, sched.num_tokens)]
        self.scheduler.computed(sched)
        if plan.prompt_logprob_rows:
            self.output_processor.record_prompt_logprobs(sched.seqs, plan.prompt_logprob_rows, logits[num_sampling:])
        progressed = {}  # id -> (request, tokens it got: one, or with speculation up to k + 1)
        if verdicts:
            self.speculator.rollback(verdicts)
            progressed = self.speculator.emit(verdicts, sampling_logits)
            sampling_logits = plain_logits
        if sampling:
            progressed.update((id(g), (g, 1)) for g in self.token_picker(sampling, sampling_logits))
        t_end = time.perf_counter()
        bm = self.block_manager
        wasted = wasted_slots(self.scheduler.running, self.config.block_size)
        times = (*step.times, *forward_times, t_end)
        running = len(self.scheduler.running)
        self.stats.record_step(times, bm.num_used_blocks, bm.num_shared_blocks, wasted, running)
        for group, count in progressed.values():
            group.token_times += [t_end] * count  # tokens verified together arrive together
            if group.finished:
                self._forget(group.request_id)
        return [self.output_processor.output(group) for group, _ in progressed.values()]

    def _move_pages(self) -> None:
        """The page moves the block manager queued for this step: swaps and copy-on-write copies."""
        swap_out, swap_in = self.block_manager.take_swaps()
        copies = self.block_manager.take_copies()
        self.executor.move_pages(swap_out, copies, swap_in, self.block_manager.take_state_copies())
        self.stats.swap_outs += bool(swap_out)
        self.stats.block_copies += len(copies)

    def _abandon(self, sched: SchedulerOutput) -> None:
        """A step that raised (an interrupt, out of memory, a worker) left K/V unwritten: forget
        every cached prefix (pages registered for this step among them) and send the step's
        sequences back to recompute, so nothing later reads what was never written."""
        self.block_manager.reset_prefix_cache()
        self.block_manager.take_copies()  # moves planned for the abandoned step, if not yet taken
        self.block_manager.take_swaps()
        for seq in sched.seqs:
            if seq.status is SequenceStatus.RUNNING:
                self.scheduler.preempt(seq, swap=False)


def engine_logits_processors(processors) -> list[BatchLogitsProcessor]:
    """LLM(logits_processors=...): BatchLogitsProcessor instances, or subclasses to build; TypeError otherwise."""
    if processors is None:
        return []
    if not isinstance(processors, (list, tuple)):
        raise TypeError(f"logits_processors must be a list, got {type(processors).__name__}")
    built = []
    for p in processors:
        if isinstance(p, type) and issubclass(p, BatchLogitsProcessor):
            p = p()
        if not isinstance(p, BatchLogitsProcessor):
            raise TypeError(
                "LLM(logits_processors=...) takes BatchLogitsProcessor instances or subclasses (batch-wise, every "
                f"row); got {p!r} (a per-request function goes in SamplingParams.logits_processors)"
            )
        built.append(p)
    return built
