"""Executor: the worker side as the engine sees it. It builds rank 0's model (and starts the
tensor- and pipeline-parallel workers), sizes and allocates the paged KV cache, captures the
decode CUDA graphs, and runs each step: page moves, then inputs and metadata, the backend's
prepare and the forward. Under pipeline parallelism a step is launched, and its logits collected
later, so that as many steps as stages are in flight."""

import logging
import os
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from pagedbench.backends.base import one_line
from pagedbench.config import EngineConfig
from pagedbench.device.dtypes import resolve_device_dtype
from pagedbench.device.timer import DeviceTimer
from pagedbench.engine.block_manager import blocks_needed
from pagedbench.engine.kv_budget import cuda_kv_budget, num_kv_blocks
from pagedbench.engine.sequence import Sequence
from pagedbench.engine.state_snapshots import SnapshotPlan
from pagedbench.model.config import ModelConfig
from pagedbench.model.llama import CausalLM
from pagedbench.model.loader import ResolvedModel, build_model, resolve_model_config, weights_path
from pagedbench.model.parallel import NO_TP, WHOLE_MODEL, PPStage, TPShard, layer_partition, placement
from pagedbench.worker.cuda_graphs import DecodeGraphs, decode_buckets
from pagedbench.worker.layer_attention import LayerAttention, build_layer_attention
from pagedbench.worker.linear_state import state_bytes_per_sequence
from pagedbench.worker.model_runner import ModelRunner, kv_bytes_per_block
from pagedbench.worker.pipeline import PipelineRunner
from pagedbench.worker.pipeline_stage import StageLink
from pagedbench.worker.step_plan import StepInputs
from pagedbench.worker.tp_workers import ParallelRunner, Workers, rank_device

logger = logging.getLogger(__name__)


def page_bytes(config: EngineConfig, cfg: ModelConfig, draft: ModelConfig | None, dtype: torch.dtype, tp: TPShard):
    """One page of K/V in every layer (of the largest pipeline stage), as stored, with the draft's
    page beside it (same ids)."""
    stage_layers = max(layer_partition(cfg.num_layers, config.pipeline_parallel_size, config.pipeline_layer_partition))
    if cfg.linear is not None:  # a hybrid (one stage): its DeltaNet layers keep no pages
        stage_layers = cfg.num_kv_layers
    per_block = kv_bytes_per_block(
        cfg, config.block_size, dtype, tp, config.kv_cache_dtype, stage_layers, config.index_cache_dtype
    )
    if draft is not None:
        per_block += kv_bytes_per_block(draft, config.block_size, dtype, NO_TP, config.kv_cache_dtype)
    return per_block


def num_state_slots(config: EngineConfig, cfg: ModelConfig) -> int:
    """Hybrid models: one linear-attention state slot per sequence that can run at once."""
    return config.max_num_seqs if cfg.linear is not None else 0


def snapshot_plan(
    config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, budget: int | None, tp: TPShard = NO_TP
) -> SnapshotPlan | None:
    """A hybrid model's snapshots (None: not a hybrid, or no prefix caching): how many
    (num_state_snapshots; by default one per max_num_seqs, within a quarter of `budget`, the bytes
    a rank's KV pages would get, where known) and how far apart (mamba_block_size; by default vLLM's
    align rule: the fewest pages whose K/V in one attention layer outweighs one DeltaNet layer's state)."""
    if cfg.linear is None or not config.enable_prefix_caching:
        return None
    state = state_bytes_per_sequence(cfg, dtype, tp)
    count = config.num_state_snapshots
    if count is None:
        count = config.max_num_seqs if budget is None else min(config.max_num_seqs, max(0, budget) // 4 // state)
    interval = config.mamba_block_size or default_mamba_block_size(cfg, config.block_size, dtype, config.kv_cache_dtype)
    return SnapshotPlan(count, interval)


def default_mamba_block_size(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str) -> int:
    """vLLM's align rule: the fewest pages whose K/V in one attention layer outweighs one DeltaNet
    layer's state, in tokens (528 for Qwen3.5-0.8B in bf16 at pages of 16)."""
    page = kv_bytes_per_block(cfg, block_size, dtype, kv_cache_dtype=kv_cache_dtype, num_layers=1)
    return block_size * blocks_needed(state_bytes_per_sequence(cfg, dtype) // sum(cfg.linear.layers), page)


class Executor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: Path | None):
        self.config, self.model_config = config, model_config
        self.device, self.dtype = resolve_device_dtype(config.device, config.dtype)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # graph capture, events and syncs act on the current device
        self.tp, self.stage = self._placement()
        self.world = self.tp.size * self.stage.size
        backend = build_layer_attention(
            config.backend, model_config, config.block_size, self.device, self.dtype, self.tp, config.kv_cache_dtype
        )
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
                self.compiled,
            )  # fmt: skip
            # The draft's weights are in place before the cache is sized from what memory is left.
            draft_model = self._build_draft(rope_len) if self.draft_config is not None else None
            self.num_blocks, self.max_model_len = self._size_kv_cache(backend, max_len_cap)
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
            compile=config.compiles(self.device),
        )  # fmt: skip

    def _start_draft(self, model: CausalLM) -> ModelRunner:
        """The draft's KV cache: as many pages as the target's, addressed by the same block tables
        (it writes its K/V into the pages the scheduler gave the target)."""
        cfg, config = self.draft_config, self.config
        if cfg.max_position_embeddings < self.max_model_len:
            raise ValueError(
                f"draft model {config.speculative.model!r} allows {cfg.max_position_embeddings} positions, "
                f"fewer than max_model_len={self.max_model_len}"
            )
        args = (config.block_size, self.device, self.dtype)
        backend = build_layer_attention(config.backend, cfg, *args, NO_TP, config.kv_cache_dtype)
        return ModelRunner(model, backend, self.num_blocks, *args, 0, config.kv_cache_dtype, config.calculate_kv_scales)

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

    # ---- KV cache -----------------------------------------------------------------------------

    def _size_kv_cache(self, backend: LayerAttention, max_len_cap: int) -> tuple[int, int]:
        """(num_blocks, max_model_len): max_model_len None is as long as the model allows and the
        cache holds; an explicit one the cache cannot hold is an error."""
        config, bs = self.config, self.config.block_size
        self.state_snapshots = snapshot_plan(config, self.model_config, self.dtype, None)  # with num_blocks given
        num_blocks = config.num_blocks or self._auto_num_blocks(backend, config.max_model_len or max_len_cap)
        # A sequence holds its whole length in pages, or, when every layer is windowed, only the pages
        # of its window and the step's chunk (the rest are released as it goes).
        window = self.model_config.window_of_every_layer
        held = None if window is None else blocks_needed(window + config.max_num_batched_tokens, bs) + 1
        if config.max_model_len is None:
            return num_blocks, max_len_cap if held is not None and num_blocks >= held else min(
                max_len_cap, num_blocks * bs
            )
        if num_blocks < (held or blocks_needed(config.max_model_len, bs)):
            raise ValueError(
                f"KV cache of {num_blocks} blocks x {bs} tokens = {num_blocks * bs} tokens cannot hold one "
                f"sequence of max_model_len={config.max_model_len}; raise num_blocks or lower max_model_len"
            )
        return num_blocks, config.max_model_len

    def _auto_num_blocks(self, backend: LayerAttention, max_model_len: int) -> int:
        """KV blocks from the memory budget: vLLM's profiled rule on CUDA, cpu_kv_cache_bytes on CPU."""
        config = self.config
        per_block = page_bytes(config, self.model_config, self.draft_config, self.dtype, self.tp)
        if self.device.type != "cuda":
            budget = config.cpu_kv_cache_bytes
        elif self.world > 1:
            # The profiling step would need the other ranks in its collectives, and they start
            # later: the free memory's share, as before vLLM profiled.
            budget = int(torch.cuda.mem_get_info(self.device)[0] * config.gpu_memory_utilization)
        else:
            graphs = self._graph_off_reason(backend) is None
            rows = decode_buckets(config.max_num_seqs, backend.cuda_graph_powers_of_two)[-1] if graphs else None
            args = (per_block, rows, self.device, self.dtype)
            budget = cuda_kv_budget(config, self.model, backend, max_model_len, *args)
        slots = num_state_slots(config, self.model_config)
        if slots:  # hybrid models: the DeltaNet state slots (and prefix caching's snapshots) share the budget
            per_slot = state_bytes_per_sequence(self.model_config, self.dtype, self.tp)
            budget -= slots * per_slot
            self.state_snapshots = snapshot_plan(config, self.model_config, self.dtype, budget, self.tp)
            snapshots = self.state_snapshots.count if self.state_snapshots is not None else 0
            budget -= snapshots * per_slot
            logger.info(
                "linear-attention state: %d slots and %d prefix-cache snapshots, %.2f GiB",
                slots, snapshots, (slots + snapshots) * per_slot / 2**30,
            )  # fmt: skip
        return num_kv_blocks(config, budget, per_block, max_model_len)

    def _start_runner(self, backend: LayerAttention) -> ModelRunner | ParallelRunner:
        """The KV cache (and swap space) on every rank, and the runner that drives them."""
        config = self.config
        self.num_cpu_blocks = self.num_cpu_state_slots = 0
        if config.preemption_mode == "swap":
            per_block = page_bytes(config, self.model_config, None, self.dtype, self.tp)  # the draft's never swap
            swap = int(config.swap_space * 2**30)
            if self.num_state_slots:  # a hybrid's swapped-out states: up to half the swap space, one per sequence
                per_state = state_bytes_per_sequence(self.model_config, self.dtype, self.tp)
                self.num_cpu_state_slots = min(config.max_num_seqs, swap // 2 // per_state)
                swap -= self.num_cpu_state_slots * per_state
            self.num_cpu_blocks = swap // per_block
        runner = ModelRunner(
            self.model, backend, self.num_blocks, config.block_size, self.device, self.dtype, self.num_cpu_blocks,
            config.kv_cache_dtype, config.calculate_kv_scales, self.num_state_slots + self.num_state_snapshots,
            config.index_cache_dtype, config.linear_attention_kernel, self.num_cpu_state_slots,
        )  # fmt: skip
        if self.workers is None:
            return runner
        state_slots = (runner.num_state_slots, self.num_cpu_state_slots)
        self.workers.start(self.device, self.num_blocks, self.num_cpu_blocks, state_slots)
        weakref.finalize(self, self.workers.shutdown)
        if self.stage.size > 1:
            return PipelineRunner(runner, self.workers, StageLink(self.stage, 0, self.tp.size))
        return ParallelRunner(runner, self.workers)

    # ---- CUDA graphs --------------------------------------------------------------------------

    @property
    def num_state_slots(self) -> int:
        return num_state_slots(self.config, self.model_config)

    @property
    def num_state_snapshots(self) -> int:
        """Hybrid models' prefix-cache snapshots: slots after the running ones in the same state tensors."""
        return self.state_snapshots.count if self.state_snapshots is not None else 0

    def _graph_off_reason(self, backend: LayerAttention) -> str | None:
        if self.config.enforce_eager:
            return "enforce_eager"
        if self.model_config.linear is not None:
            return "hybrid models' DeltaNet steps are laid out on the host (a loop over sequences, or fla's cu_seqlens)"
        if self.model_config.indexer is not None:
            return "the sparse indexer's top-k is sized by each step's longest sequence"
        if self.device.type != "cuda":
            return f"no CUDA device (device is {self.device.type})"
        if self.world > 1:
            return "tensor- and pipeline-parallel steps run eagerly"
        return backend.cuda_graph_reason

    def capture_graphs(self) -> str:
        """Capture the decode CUDA graphs where they can run; returns what the reports say:
        "on: ..." or "off: why"."""
        reason = self._graph_off_reason(self.backend)
        if reason is not None:
            return f"off: {reason}"
        graphs = DecodeGraphs(self.runner, self.config.max_num_seqs, self.max_model_len)
        logger.info("capturing decode CUDA graphs for batch sizes %s", graphs.buckets)
        calibrate, self.runner.calibrate_kv = self.runner.calibrate_kv, False  # fp8 scales come from real K/V
        try:
            graphs.capture_all()
            mismatch = graphs.verify()
        except Exception as e:  # a backend that cannot be captured after all: eager, and say why
            mismatch = f"capture failed: {one_line(e)}"
        finally:
            self.runner.calibrate_kv = calibrate
        if mismatch is not None:
            logger.warning("CUDA graphs off: %s", mismatch)
            return f"off: {mismatch}"
        self.runner.graphs = graphs
        status = (
            f"on: {len(graphs.buckets)} decode sizes up to {graphs.buckets[-1]}, captured in "
            f"{graphs.capture_seconds:.1f} s, {graphs.capture_bytes / 2**20:.0f} MiB"
        )
        logger.info("CUDA graphs %s", status)
        return status

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

    def launch(self, seqs: list[Sequence], num_tokens: list[int]) -> tuple:
        """Start a step where `seqs[i]` runs its next `num_tokens[i]` tokens (a pipeline's first
        stage; the whole step otherwise); `collect` finishes it."""
        inputs = self.runner.prepare(seqs, num_tokens)
        t_metadata = time.perf_counter()
        state = self.backend.prepare(inputs.metadata)
        t_prepare = time.perf_counter()
        forward_start = self.timer.mark()
        timer = self.timer if self.timer.enabled and inputs.graph is None else None
        return inputs, self.runner.launch(inputs, state, timer), (t_metadata, t_prepare), forward_start

    def collect(self, launched: tuple) -> tuple[StepInputs, torch.Tensor, tuple]:
        """(inputs, fp32 logits, wall times) of a launched step, waiting for its last stage."""
        inputs, handle, times, forward_start = launched
        logits = self.runner.collect(handle)
        self.timer.span("forward" if inputs.graph is None else "forward_graph", forward_start)
        return inputs, logits, (*times, time.perf_counter())
