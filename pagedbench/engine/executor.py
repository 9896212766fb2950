"""Executor: the worker side as the engine sees it. It builds rank 0's model (and starts the
tensor- and pipeline-parallel workers), allocates the paged KV cache (as kv_budget sizes it), has
the decode CUDA graphs captured where they can run (cuda_graphs), and runs each step: page moves,
then inputs and metadata, the backend's plan and the forward. Under pipeline parallelism a step
is launched, and its logits collected later, so that as many steps as stages are in flight."""

import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from pagedbench.backends.cascade import cascade_setting
from pagedbench.config import EngineConfig
from pagedbench.device.dtypes import resolve_device_dtype
from pagedbench.device.timer import DeviceTimer
from pagedbench.engine.kv_budget import size_kv_cache
from pagedbench.engine.sequence import Sequence
from pagedbench.engine.stats import StepTimes
from pagedbench.model.config import ModelConfig
from pagedbench.model.llama import CausalLM
from pagedbench.model.loader import ResolvedModel, build_model, resolve_model_config, weights_path
from pagedbench.model.parallel import NO_TP, WHOLE_MODEL, PPStage, TPShard, placement
from pagedbench.worker.cuda_graphs import capture_decode_graphs, graphs_off_reason
from pagedbench.worker.layer_attention import LayerAttention, build_layer_attention
from pagedbench.worker.model_runner import ModelRunner
from pagedbench.worker.pipeline import InFlight, PipelineRunner
from pagedbench.worker.pipeline_stage import StageLink
from pagedbench.worker.step_batch import StepBatch, StepInputs
from pagedbench.worker.tp_workers import ParallelRunner, Workers, rank_device

# Async scheduling: (input positions of PLACEHOLDERs, the previous step's sampled tokens on the device,
# their rows there) -- StepInputs.fill_placeholders.
Feed = tuple[np.ndarray, torch.Tensor, np.ndarray]


@dataclass(slots=True)
class LaunchedForward:
    """A step's model call once started: its inputs, where its device span began, and its logits,
    or, while a pipeline's later stages run, what brings them."""

    inputs: StepInputs
    span_start: object
    logits: torch.Tensor | None = None
    in_flight: InFlight | None = None


class Executor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: Path | None):
        self.config, self.model_config = config, model_config
        self.device, self.dtype = resolve_device_dtype(config.device, config.dtype)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # graph capture, events and syncs act on the current device
        self.tp, self.stage = self._placement()
        self.world = self.tp.size * self.stage.size
        backend = build_layer_attention(
            config.backend, model_config, config.block_size, self.device, self.dtype, self.tp, config.kv_cache_dtype,
            config.batch_invariant,
        )  # fmt: skip
        cfg = model_config
        # A sliding window no longer caps the length: each backend attends within its layers' windows.
        max_len_cap = cfg.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > max_len_cap:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit {max_len_cap}")
        rope_len = config.max_model_len or max_len_cap
        self.draft_config, self.draft_path = self._draft_config()
        # Workers build their shards while this process builds rank 0's (none under an external launcher).
        spawn = self.world > 1 and not self.tp.logits_everywhere
        self.workers = Workers(config, ResolvedModel(model_config, model_path), rope_len, self.world) if spawn else None
        try:
            weights = weights_path(model_path, config)
            self.compiled = config.compiles(self.device)
            self.model = build_model(
                cfg, weights, self.device, self.dtype, rope_len, config.seed, self.tp, config.preset_init, self.stage,
                self.compiled, config.batch_invariant,
            )  # fmt: skip
            # The draft's weights are in place before the cache is sized from what memory is left.
            draft_model = self._build_draft(rope_len) if self.draft_config is not None else None
            graphs = graphs_off_reason(config, cfg, self.device, self.world, backend) is None
            self.kv_size = size_kv_cache(
                config, self.model, self.draft_config, backend, self.device, self.dtype, self.tp, self.world, graphs
            )
            self.runner = self._start_runner(backend)
            self.draft_runner = self._start_draft(draft_model) if draft_model is not None else None
            self.cuda_graphs = self.capture_graphs()
        except BaseException:
            self.shutdown()
            raise
        # Device spans (CUDA events, read after a run; off unless enabled): "forward" / "forward_graph"
        # (eager / replayed), "attention" (each eager layer's call), "sample" (the sampler's kernels).
        self.timer = DeviceTimer(self.device)

    def _placement(self) -> tuple[TPShard, PPStage]:
        """Rank 0's tensor-parallel shard and pipeline stage (the first)."""
        config, cfg = self.config, self.model_config
        pp = config.pipeline_parallel_size
        if config.distributed_executor_backend == "external_launcher":
            if pp > 1:
                raise ValueError(
                    "pipeline_parallel_size > 1 runs with distributed_executor_backend='mp' (the engine's own "
                    "workers); under torchrun every rank runs a whole engine"
                )
            return self._launched_shard(), WHOLE_MODEL
        if pp > 1 and config.speculative is not None:
            raise ValueError("speculative decoding does not run with pipeline_parallel_size > 1")
        tp, stage = placement(0, config.tensor_parallel_size, pp, cfg.num_layers, config.pipeline_layer_partition)
        tp.validate(cfg)
        world = tp.size * pp
        if world > 1:
            self.device = rank_device(self.device, 0)
            if self.device.type == "cuda" and torch.cuda.device_count() < world:
                raise ValueError(
                    f"tensor_parallel_size={tp.size} x pipeline_parallel_size={pp} needs {world} GPUs; "
                    f"{torch.cuda.device_count()} visible"
                )
        return tp, stage

    def _launched_shard(self) -> TPShard:
        """This process's shard under torchrun (vLLM's external_launcher): rank and world size from
        the launcher's environment, the process group joined here unless the caller did (gloo on
        CPU, NCCL on CUDA, one GPU per local rank); no workers are spawned."""
        env = os.environ
        if not dist.is_initialized() and not {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} <= set(env):
            raise ValueError(
                "distributed_executor_backend='external_launcher' runs under torchrun (RANK, WORLD_SIZE, "
                "MASTER_ADDR and MASTER_PORT unset): torchrun --nproc-per-node N ..."
            )
        if self.device.type == "cuda":
            self.device = torch.device("cuda", int(env.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
            self.owns_process_group = True
        rank, world = dist.get_rank(), dist.get_world_size()
        tp = TPShard(rank, world, logits_everywhere=True)
        try:
            if self.config.tensor_parallel_size != world:
                raise ValueError(
                    f"external_launcher: tensor_parallel_size={self.config.tensor_parallel_size} must equal the "
                    f"launcher's world size {world} (under torchrun every rank runs one tensor-parallel shard)"
                )
            tp.validate(self.model_config)
        except ValueError:
            self.shutdown()  # leaves the group it joined
            raise
        return tp

    def _draft_config(self) -> tuple[ModelConfig | None, Path | None]:
        """The draft model's config (speculative method "draft_model"), checked against the target's."""
        spec = self.config.speculative
        if spec is None or spec.method != "draft_model":
            return None, None
        draft, path = resolve_model_config(spec.model, need_weights=self.config.load_format != "dummy")
        if draft.vocab_size != self.model_config.vocab_size:
            raise ValueError(
                f"draft model {spec.model!r} has a vocabulary of {draft.vocab_size} tokens, the target "
                f"{self.model_config.vocab_size}: a draft must share the target's vocabulary"
            )
        return draft, path

    def _build_draft(self, rope_len: int) -> CausalLM:
        cfg, config = self.draft_config, self.config
        rope_len = min(rope_len, cfg.max_position_embeddings)
        weights = weights_path(self.draft_path, config)
        return build_model(
            cfg, weights, self.device, self.dtype, rope_len, config.seed, NO_TP, config.preset_init,
            compile=config.compiles(self.device), batch_invariant=config.batch_invariant,
        )  # fmt: skip

    def _start_draft(self, model: CausalLM) -> ModelRunner:
        """The draft's KV cache: as many pages as the target's, addressed by the same block tables
        (it writes its K/V into the pages the scheduler gave the target)."""
        cfg, config = self.draft_config, self.config
        if cfg.max_position_embeddings < self.kv_size.max_model_len:
            raise ValueError(
                f"draft model {config.speculative.model!r} allows {cfg.max_position_embeddings} positions, "
                f"fewer than max_model_len={self.kv_size.max_model_len}"
            )
        args = (config.block_size, self.device, self.dtype)
        kv = (config.kv_cache_dtype, config.batch_invariant)
        backend = build_layer_attention(config.backend, cfg, *args, NO_TP, *kv)
        num_blocks = self.kv_size.num_blocks
        return ModelRunner(model, backend, num_blocks, *args, 0, config.kv_cache_dtype, config.calculate_kv_scales)

    @property
    def backend(self) -> LayerAttention:
        return self.runner.backend

    def shutdown(self, broken: bool = False) -> None:
        """Stop the tensor-parallel workers, if any (also done when the executor is collected), and
        leave the process group this engine joined under an external launcher. `broken`: a step
        was cut off mid-way (workers may be blocked in a collective: they are killed sooner)."""
        if getattr(self, "workers", None) is not None:
            self.workers.shutdown(broken)
        if getattr(self, "owns_process_group", False) and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_process_group = False

    def _start_runner(self, backend: LayerAttention) -> ModelRunner | ParallelRunner:
        """The KV cache (and swap space) on every rank, and the runner that drives them."""
        config, kv = self.config, self.kv_size
        runner = ModelRunner(
            self.model, backend, kv.num_blocks, config.block_size, self.device, self.dtype, kv.num_cpu_blocks,
            config.kv_cache_dtype, config.calculate_kv_scales, kv.num_state_slots + kv.num_state_snapshots,
            config.index_cache_dtype, config.linear_attention_kernel, kv.num_cpu_state_slots,
        )  # fmt: skip
        runner.block_tables.cascade = cascade_setting(backend.distinct, config.cascade_attention)
        if self.workers is None:
            return runner
        state_slots = (runner.num_state_slots, kv.num_cpu_state_slots)
        self.workers.start(self.device, kv.num_blocks, kv.num_cpu_blocks, state_slots)
        weakref.finalize(self, self.workers.shutdown)
        if self.stage.size > 1:
            return PipelineRunner(runner, self.workers, StageLink(self.stage, 0, self.tp.size))
        return ParallelRunner(runner, self.workers)

    def capture_graphs(self) -> str:
        """Capture the decode CUDA graphs where they can run; returns what the reports say:
        "on: ..." or "off: why"."""
        reason = graphs_off_reason(self.config, self.model_config, self.device, self.world, self.backend)
        if reason is not None:
            return f"off: {reason}"
        return capture_decode_graphs(self.runner, self.config.max_num_seqs, self.kv_size.max_model_len)

    # ---- a step -------------------------------------------------------------------------------

    def move_pages(self, swap_out: list, copies: list, swap_in: list, state_copies: list = ()) -> None:
        """Before the step writes anything: pages leaving for swap space, copy-on-write of shared
        pages it writes into, pages coming back from swap space (that order: each may reuse a
        block the one before read); hybrid models' DeltaNet states first (forks, snapshot restores,
        swaps: block_manager.take_state_copies)."""
        if state_copies:
            self.runner.copy_states(state_copies)
        if swap_out:
            self.runner.swap_out(swap_out)
        if copies:
            self.runner.copy_blocks(copies)
            if self.draft_runner is not None:
                self.draft_runner.copy_blocks(copies)
        if swap_in:
            self.runner.swap_in(swap_in)

    @property
    def pipeline_depth(self) -> int:
        """Steps that may be in flight at once: one per pipeline stage."""
        return self.stage.size

    def launch(self, seqs: list[Sequence], num_tokens: list[int], times: StepTimes) -> LaunchedForward:
        """Start a step where `seqs[i]` runs its next `num_tokens[i]` tokens (a pipeline's first
        stage; the whole step otherwise), stamping `times` as its parts end; `collect` finishes it."""
        return self._start(self.runner.build_inputs(seqs, num_tokens), times)

    def launch_laid_out(self, batch: StepBatch, times: StepTimes, feed: Feed | None = None) -> LaunchedForward:
        """Async scheduling's launch (on the device lane): a step laid out ahead (`runner.lay_out`), its
        PLACEHOLDER inputs taking the previous step's sampled tokens on the device (`feed`)."""
        inputs = self.runner.device_inputs(batch)
        if feed is not None:
            inputs.fill_placeholders(*feed)
        return self._start(inputs, times)

    def _start(self, inputs: StepInputs, times: StepTimes) -> LaunchedForward:
        times.metadata = time.perf_counter()
        state = self.backend.plan(inputs.metadata)
        times.planned = time.perf_counter()
        step = LaunchedForward(inputs, self.timer.mark())
        timer = self.timer if self.timer.enabled and inputs.graph is None else None
        if self.pipeline_depth > 1:
            step.in_flight = self.runner.launch(inputs, state, timer)
        else:
            step.logits = self.runner.run(inputs, state, timer)
        return step

    def collect(self, step: LaunchedForward, times: StepTimes) -> torch.Tensor:
        """The fp32 logits of a launched step, once its last stage has run."""
        logits = step.logits if step.in_flight is None else self.runner.collect(step.in_flight)
        self.timer.span("forward" if step.inputs.graph is None else "forward_graph", step.span_start)
        times.forward = time.perf_counter()
        return logits
