"""LLMEngine: requests in, one step at a time, RequestOutputs out. It holds the requests and
orchestrates: the InputProcessor turns a prompt into a request, and EngineCore.step (engine_core.py)
runs a step: the Scheduler picks the work (the BlockManager its pages), the Executor runs the
model, the TokenPicker samples (the Speculator verifying proposals), Scheduler.update_from_output
applies the step to its sequences, and the OutputProcessor makes the outputs.

Under pipeline parallelism a step is launched and completed later: each request runs in one of
as many lanes as stages (the least loaded when it arrives), one step per lane is in flight, and
`step()` launches every idle lane's work before it completes the oldest step."""

import dataclasses
import itertools
import secrets
import time
from collections.abc import Iterable

from pagedbench.config import EngineConfig
from pagedbench.engine.async_scheduling import async_scheduling
from pagedbench.engine.block_manager import BlockManager
from pagedbench.engine.engine_core import EngineCore
from pagedbench.engine.executor import Executor
from pagedbench.engine.heap import collect_dropped_engines, freeze_startup_heap, thaw_heap
from pagedbench.engine.input_processor import InputProcessor, engine_logits_processors
from pagedbench.engine.output_processor import OutputProcessor
from pagedbench.engine.outputs import RequestOutput
from pagedbench.engine.request import SequenceGroup
from pagedbench.engine.scheduler import Scheduler
from pagedbench.engine.speculator import make_speculator
from pagedbench.engine.stats import EngineStats, RunCounters, gauges
from pagedbench.engine.structured_outputs import StructuredOutputManager
from pagedbench.engine.token_picker import TokenPicker
from pagedbench.model.config import check_model_settings
from pagedbench.model.fused import dynamo_seconds
from pagedbench.model.hybrid import hybrid_engine_config
from pagedbench.model.loader import ResolvedModel, resolve_model_config
from pagedbench.model.tokenizer import tokenizer_for
from pagedbench.sample.sampling_params import BeamSearchParams, SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, logits_processors: list | None = None, model: ResolvedModel | None = None):
        """`logits_processors`: engine-wide BatchLogitsProcessors (instances, or subclasses built
        with no arguments) that see every sampling row each step, after each request's own.
        `model`: config.model as the command already resolved it (else resolved here)."""
        config.validate()
        collect_dropped_engines()
        logits_processors = engine_logits_processors(logits_processors)
        if config.seed is None:  # one fresh seed, shared with the tensor-parallel workers
            config = dataclasses.replace(config, seed=secrets.randbelow(2**31))
        self.config = config
        self.model_config, path = model or resolve_model_config(
            config.model, need_weights=config.load_format != "dummy"
        )
        self.model_path = path  # the model's directory (weights, tokenizer); None for a preset
        cfg = self.model_config
        check_model_settings(config, cfg)
        if cfg.linear is not None:
            config = self.config = hybrid_engine_config(config)
        self.tokenizer = tokenizer_for(config.tokenizer, path, cfg.vocab_size, cfg.eos_token_ids)
        self.executor = Executor(config, cfg, path)
        ex = self.executor
        self.device, self.dtype = ex.device, ex.dtype
        kv = ex.kv_size  # the executor sized the cache
        if kv.num_state_slots and kv.num_state_slots < config.max_num_seqs:  # a hybrid's states fit fewer
            config = self.config = dataclasses.replace(config, max_num_seqs=kv.num_state_slots)
        self.max_model_len, self.num_blocks = kv.max_model_len, kv.num_blocks
        self.block_manager = BlockManager(
            kv.num_blocks, config.block_size, config.enable_prefix_caching, kv.num_cpu_blocks,
            cfg.window_of_every_layer, kv.num_state_slots, kv.state_snapshots, kv.num_cpu_state_slots,
        )  # fmt: skip
        self.stats = EngineStats()
        self.requests: dict[str, SequenceGroup] = {}  # unfinished requests by id
        self.output_processor = OutputProcessor(self.tokenizer)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.scheduling_policy,
            config.preemption_mode, requests=self.requests, outputs=self.output_processor, stats=self.stats,
            model_config=cfg, max_model_len=self.max_model_len,
        )  # fmt: skip
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
        self.token_picker = TokenPicker(
            self.requests, self.input_processor, cfg, self.device, config.seed, ex.timer, self.structured_outputs,
            logits_processors,
        )  # fmt: skip
        self.speculator = make_speculator(
            config.speculative, ex, self.scheduler, cfg, self.token_picker.sampler, self.max_model_len,
            self.structured_outputs,
        )  # fmt: skip
        self.async_scheduling = async_scheduling(config, cfg, self.device)
        self.core = EngineCore(
            self.scheduler, ex, self.token_picker, self.speculator, self.output_processor, self.stats, self.requests,
            run_ahead=self.async_scheduling,
        )  # fmt: skip
        self.lane_load = self.core.lane_load  # pipeline parallelism: unfinished requests per lane
        self._ids = itertools.count()
        freeze_startup_heap()

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
        self.core.device_lane.shutdown()
        self.executor.shutdown()
        thaw_heap()

    # ---- what a benchmark run reads -------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Processes (GPUs) the engine runs on: tensor x pipeline parallel ranks."""
        return self.executor.world

    def set_timing(self, enabled: bool) -> None:
        """Device spans from CUDA events, read after a run (no sync in the loop); off by default."""
        self.timer.enabled = enabled

    def gauges(self) -> dict[str, float]:
        """What the server's /metrics reads now (stats.gauges; a data-parallel front sums its replicas')."""
        return gauges(self.scheduler, self.stats, speculating=self.speculator is not None)

    def reset_counters(self) -> None:
        """Start counting a run: stats, device spans, prefix-cache and compile counters from zero."""
        self.stats.reset()
        self.timer.reset()
        cache = self.block_manager.prefix_cache
        self._counted_from = (cache.queries, cache.hits, self.backend.compile_seconds, dynamo_seconds())

    def run_counters(self) -> RunCounters:
        """The counters since reset_counters()."""
        queries, hits, compiled, dynamo = getattr(self, "_counted_from", (0, 0, 0.0, 0.0))
        bm = self.block_manager
        backend = self.backend.compile_seconds - compiled
        return RunCounters(
            self.stats,
            self.timer.totals(),
            bm.prefix_cache.queries - queries,
            bm.prefix_cache.hits - hits,
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
        self.core.add_request(group)
        return request_id

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort one request or several (vLLM v1 takes a list); unknown ids are ignored. A request
        whose step is in flight is aborted when the step comes back."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.core.abort_requests(request_ids)
        self.output_processor.forget([r for r in request_ids if r not in self.requests])  # not left in flight

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
        return self.scheduler.has_unfinished() or bool(self.core.in_flight)

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch (EngineCore.step: schedule, execute, update_from_output, make
        outputs); returns outputs of the requests that progressed. Under pipeline parallelism:
        launch every idle lane's batch, then complete the oldest in flight."""
        return self.core.step()
