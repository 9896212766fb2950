"""How many KV blocks the engine gets: vLLM's rule on CUDA (a share of the device's memory,
less what is in use and the activation peak of a profiled step), a fixed budget on CPU, never
more than max_num_seqs full-length sequences need."""

import logging

import numpy as np
import torch

from pagedbench.backends.base import AttentionBackend
from pagedbench.config import EngineConfig
from pagedbench.engine.block_manager import blocks_needed
from pagedbench.engine.sequence import Sequence
from pagedbench.model.llama import CausalLM
from pagedbench.sample.sampler import Sampler, SamplingBatch
from pagedbench.sample.sampling_params import SamplingParams
from pagedbench.worker.model_runner import ModelRunner
from pagedbench.worker.step_plan import plan_step

logger = logging.getLogger(__name__)


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
    plan = plan_step(seqs, [seq_len] * num_seqs, block_size, runner.num_cache_blocks)
    plan.logits_indices = np.arange(num_logits, dtype=np.int64) % len(plan.input_ids)  # the sampler's rows
    sampling = SamplingBatch.from_seqs([seqs[i % num_seqs] for i in range(num_logits)], model.config.vocab_size, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    Sampler(device, seed=0)(runner.run_plan(plan), sampling)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del runner
    torch.cuda.empty_cache()
    return peak
