"""How big the paged KV cache is: how many KV blocks the engine gets (vLLM's rule on CUDA: a share
of the device's memory, less what is in use and the activation peak of a profiled step; a fixed
budget on CPU; never more than max_num_seqs full-length sequences need), the longest sequence they
hold, the swap space, and a hybrid model's DeltaNet state slots and snapshots."""

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagedbench.backends.base import AttentionBackend
from pagedbench.config import DEFAULT_MAX_NUM_SEQS, EngineConfig
from pagedbench.engine.block_manager import blocks_needed
from pagedbench.engine.sequence import Sequence
from pagedbench.engine.state_snapshots import SnapshotPlan
from pagedbench.model.config import ModelConfig
from pagedbench.model.llama import CausalLM
from pagedbench.model.parallel import NO_TP, TPShard, layer_partition
from pagedbench.sample.sampler import Sampler, SamplingBatch
from pagedbench.sample.sampling_params import SamplingParams
from pagedbench.worker.cuda_graphs import decode_buckets
from pagedbench.worker.linear_state import state_bytes_per_sequence
from pagedbench.worker.model_runner import ModelRunner, kv_bytes_per_block
from pagedbench.worker.step_batch import step_batch

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class KVCacheSize:
    """The paged cache on every rank: pages on the device and in swap space, the longest sequence
    they hold, and a hybrid model's DeltaNet state slots (one per sequence that can run at once,
    prefix caching's snapshots after them, swapped-out sequences' in CPU memory)."""

    num_blocks: int
    max_model_len: int
    num_cpu_blocks: int = 0
    num_state_slots: int = 0
    state_snapshots: SnapshotPlan | None = None
    num_cpu_state_slots: int = 0

    @property
    def num_state_snapshots(self) -> int:
        return self.state_snapshots.count if self.state_snapshots is not None else 0


def size_kv_cache(
    config: EngineConfig,
    model: CausalLM,
    draft: ModelConfig | None,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    tp: TPShard,
    world: int,
    graphs: bool,
) -> KVCacheSize:
    """config.num_blocks, or as many blocks as the memory budget holds (with the `draft` model's
    pages beside the target's, a hybrid's states taken off first); `graphs`: decode CUDA graphs
    will be captured (their pool and logits buffer come off a CUDA budget too)."""
    cfg = model.config
    slots = config.max_num_seqs if cfg.linear is not None else 0
    snapshots = snapshot_plan(config, cfg, dtype, None)
    num_blocks = config.num_blocks
    if not num_blocks:
        per_block = page_bytes(config, cfg, draft, dtype, tp)
        max_len = config.max_model_len or cfg.max_position_embeddings
        if device.type != "cuda":
            budget = config.cpu_kv_cache_bytes
        elif world > 1:  # a profiled step would need the other ranks in its collectives, and they start later
            budget = int(torch.cuda.mem_get_info(device)[0] * config.gpu_memory_utilization)
        else:
            rows = decode_buckets(config.max_num_seqs, backend.cuda_graph_powers_of_two)[-1] if graphs else None
            budget = cuda_kv_budget(config, model, backend, max_len, per_block, rows, device, dtype)
        if slots:
            slots = fit_state_slots(config, state_bytes_per_sequence(cfg, dtype, tp), per_block, budget)
            config = dataclasses.replace(config, max_num_seqs=slots)  # the snapshots and swap slots follow it
            budget, snapshots = budget_after_states(config, cfg, dtype, tp, budget, slots)
        num_blocks = num_kv_blocks(config, budget, per_block, max_len)
    num_cpu_blocks, num_cpu_state_slots = swap_space(config, cfg, dtype, tp, slots)
    max_len = longest_sequence(config, cfg, num_blocks)
    return KVCacheSize(num_blocks, max_len, num_cpu_blocks, slots, snapshots, num_cpu_state_slots)


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


def fit_state_slots(config: EngineConfig, per_slot: int, per_block: int, budget: int) -> int:
    """How many sequences a hybrid model runs at once, one DeltaNet state slot each: max_num_seqs,
    or, at its default, as many as fit half the KV `budget` (the KV pages and prefix-cache snapshots
    keep the other half), with a note. An explicit max_num_seqs whose slots leave no room for one
    KV block is an error naming both."""
    asked = config.max_num_seqs
    slots = asked
    if asked == DEFAULT_MAX_NUM_SEQS:
        slots = min(asked, max(1, budget // 2 // per_slot))
        if slots < asked:
            logger.warning(
                "hybrid model: max_num_seqs %d -> %d: %d DeltaNet state slots of %s fit half the %s KV budget "
                "(the other half is left to the KV pages and prefix-cache snapshots)",
                asked, slots, slots, _size(per_slot), _size(budget),
            )  # fmt: skip
    if slots * per_slot + per_block > budget:
        fit = max(0, (budget - per_block) // per_slot)
        raise ValueError(
            f"max_num_seqs {slots} needs {slots} DeltaNet state slots of {_size(per_slot)} = "
            f"{_size(slots * per_slot)}, more than the {_size(budget)} KV budget holds beside one KV block "
            f"({fit} would fit); lower max_num_seqs or raise the budget (cpu_kv_cache_bytes, gpu_memory_utilization)"
        )
    return slots


def _size(nbytes: int) -> str:
    """1 GiB, 19.3 MiB, 16.1 KiB."""
    unit = next(u for u in (3, 2, 1, 0) if nbytes >= 2 ** (10 * u) or u == 0)
    return f"{nbytes / 2 ** (10 * unit):.3g} {('B', 'KiB', 'MiB', 'GiB')[unit]}"


def budget_after_states(
    config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, tp: TPShard, budget: int, slots: int
) -> tuple[int, SnapshotPlan | None]:
    """A hybrid model's `budget` less its DeltaNet state `slots` and prefix caching's snapshots
    (planned from what the slots leave), and those snapshots."""
    per_slot = state_bytes_per_sequence(cfg, dtype, tp)
    budget -= slots * per_slot
    plan = snapshot_plan(config, cfg, dtype, budget, tp)
    snapshots = plan.count if plan is not None else 0
    logger.info(
        "linear-attention state: %d slots and %d prefix-cache snapshots, %.2f GiB",
        slots, snapshots, (slots + snapshots) * per_slot / 2**30,
    )  # fmt: skip
    return budget - snapshots * per_slot, plan


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


def swap_space(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, tp: TPShard, state_slots: int):
    """(CPU blocks, CPU state slots) in swap_space GiB under preemption_mode "swap": a hybrid's
    swapped-out states take up to half of it, one per sequence; the draft's pages never swap."""
    if config.preemption_mode != "swap":
        return 0, 0
    swap, cpu_state_slots = int(config.swap_space * 2**30), 0
    if state_slots:
        per_state = state_bytes_per_sequence(cfg, dtype, tp)
        cpu_state_slots = min(config.max_num_seqs, swap // 2 // per_state)
        swap -= cpu_state_slots * per_state
    return swap // page_bytes(config, cfg, None, dtype, tp), cpu_state_slots


def longest_sequence(config: EngineConfig, cfg: ModelConfig, num_blocks: int) -> int:
    """max_model_len in a cache of `num_blocks`: None is as long as the model allows and the cache
    holds; an explicit one the cache cannot hold is an error. A sequence holds its whole length in
    pages, or, when every layer is windowed, only the pages of its window and the step's chunk (the
    rest are released as it goes)."""
    bs, longest = config.block_size, cfg.max_position_embeddings
    window = cfg.window_of_every_layer
    held = None if window is None else blocks_needed(window + config.max_num_batched_tokens, bs) + 1
    if config.max_model_len is None:
        return longest if held is not None and num_blocks >= held else min(longest, num_blocks * bs)
    if num_blocks < (held or blocks_needed(config.max_model_len, bs)):
        raise ValueError(
            f"KV cache of {num_blocks} blocks x {bs} tokens = {num_blocks * bs} tokens cannot hold one "
            f"sequence of max_model_len={config.max_model_len}; raise num_blocks or lower max_model_len"
        )
    return config.max_model_len


def num_kv_blocks(config: EngineConfig, budget: int, per_block: int, max_model_len: int) -> int:
    """Blocks of `per_block` bytes in `budget` bytes, never more than max_num_seqs full-length
    sequences need."""
    n = min(budget // per_block, config.max_num_seqs * blocks_needed(max_model_len, config.block_size))
    if n < 1:
        raise ValueError(f"no memory for even one KV block ({per_block} bytes)")
    logger.info("KV cache: %d blocks of %d tokens, %.2f GiB", n, config.block_size, n * per_block / 2**30)
    return n


def cuda_kv_budget(
    config: EngineConfig,
    model: CausalLM,
    backend: AttentionBackend,
    max_model_len: int,
    per_block: int,
    graph_rows: int | None,
    device: torch.device,
    dtype: torch.dtype,
) -> int:
    """vLLM's rule: gpu_memory_utilization x the device's memory, less what is in use (weights,
    other processes), the peak of a profiled step of max_num_batched_tokens tokens and, with
    CUDA graphs (the largest of `graph_rows` rows), their pool (a profiled decode step) and
    logits buffer."""
    args = (config.block_size, device, dtype)
    peak = profile_activation_bytes(
        model, backend, config.max_num_batched_tokens, config.max_num_seqs, max_model_len, *args
    )
    if graph_rows is not None:
        peak += profile_activation_bytes(model, backend, graph_rows, graph_rows, 1, *args)
        peak += graph_rows * model.config.vocab_size * 4
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * config.gpu_memory_utilization) - (total - free) - peak
    if budget < per_block:
        raise ValueError(
            f"the model does not fit: gpu_memory_utilization={config.gpu_memory_utilization} of "
            f"{total / 2**30:.1f} GiB leaves {budget / 2**30:.2f} GiB for the KV cache after "
            f"{(total - free) / 2**30:.2f} GiB in use and {peak / 2**30:.2f} GiB of activations; "
            "raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return budget


def profile_activation_bytes(
    model: CausalLM,
    backend: AttentionBackend,
    num_tokens: int,
    num_logits: int,
    max_model_len: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> int:
    """Peak CUDA memory, beyond what is allocated before it, of one step of `num_tokens` prompt
    tokens (sequences of at most max_model_len) whose `num_logits` logits rows then go through
    the sampler with top-k and top-p (its sort is the largest temporary). What the KV cache
    must leave free; the small cache the step writes to is not counted."""
    seq_len = min(num_tokens, max_model_len)
    num_seqs = -(-num_tokens // seq_len)
    pages = -(-seq_len // block_size)
    runner = ModelRunner(model, backend, num_seqs * pages, block_size, device, dtype)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
    seqs = []
    for i in range(num_seqs):
        seq = Sequence(str(i), None, [0] * seq_len, params)
        seq.block_table = list(range(i * pages, (i + 1) * pages))
        seqs.append(seq)
    batch = step_batch(seqs, [seq_len] * num_seqs, block_size, runner.num_cache_blocks)
    batch.logits_indices = np.arange(num_logits, dtype=np.int64) % len(batch.input_ids)  # the sampler's rows
    sampling = SamplingBatch.from_seqs([seqs[i % num_seqs] for i in range(num_logits)], model.config.vocab_size, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    Sampler(device, seed=0)(runner.run_batch(batch), sampling)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del runner
    torch.cuda.empty_cache()
    return peak
