"""CUDA graphs for decode steps, as vLLM does it: one graph per batch-size bucket, captured at
start-up, replayed with the step's inputs padded to its bucket.

A replay launches a whole decode step (embedding, every layer, the LM head) at once instead
of thousands of kernels one by one from Python. Prefill and mixed steps run eagerly: their
token counts change with every chunk, and their kernels are large enough to hide the launches.

Padding rows are one-token sequences in the runner's padding page (a page the block manager
never hands out), so they write and read only there; their logits are computed and ignored.
A backend takes part only if its `plan()` refills static buffers in place
(`cuda_graph_reason` is None); tensor-parallel steps run eagerly (`graphs_off_reason` has every
case). The engine captures the graphs at start-up and checks them against eager steps
(`capture_decode_graphs`), before anything is measured.
"""

import bisect
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from pagedbench.backends.base import one_line
from pagedbench.config import EngineConfig
from pagedbench.device.transfer import copy_to_device_, pack, to_device, unpack
from pagedbench.model.config import ModelConfig
from pagedbench.worker.step_batch import StepBatch, StepInputs

logger = logging.getLogger(__name__)


def graphs_off_reason(config: EngineConfig, cfg: ModelConfig, device: torch.device, world: int, backend) -> str | None:
    """Why decode steps run eagerly, or None: they may be captured (`world`: ranks of the engine)."""
    if config.enforce_eager:
        return "enforce_eager"
    if cfg.linear is not None:
        return "hybrid models' DeltaNet steps are laid out on the host (a loop over sequences, or fla's cu_seqlens)"
    if cfg.indexer is not None:
        return "the sparse indexer's top-k is sized by each step's longest sequence"
    if device.type != "cuda":
        return f"no CUDA device (device is {device.type})"
    if world > 1:
        return "tensor- and pipeline-parallel steps run eagerly"
    return backend.cuda_graph_reason


def capture_decode_graphs(runner, max_num_seqs: int, max_model_len: int) -> str:
    """Capture and verify `runner`'s decode graphs, which it replays from then on; returns what the
    reports say: "on: ..." or "off: why" (a capture that fails, or replays that disagree with eager
    steps, leave the runner eager)."""
    graphs = DecodeGraphs(runner, max_num_seqs, max_model_len)
    logger.info("capturing decode CUDA graphs for batch sizes %s", graphs.buckets)
    calibrate, runner.calibrate_kv = runner.calibrate_kv, False  # fp8 scales come from real K/V
    try:
        graphs.capture_all()
        mismatch = graphs.verify()
    except Exception as e:  # a backend that cannot be captured after all: eager, and say why
        mismatch = f"capture failed: {one_line(e)}"
    finally:
        runner.calibrate_kv = calibrate
    if mismatch is not None:
        logger.warning("CUDA graphs off: %s", mismatch)
        return f"off: {mismatch}"
    runner.graphs = graphs
    status = (
        f"on: {len(graphs.buckets)} decode sizes up to {graphs.buckets[-1]}, captured in "
        f"{graphs.capture_seconds:.1f} s, {graphs.capture_bytes / 2**20:.0f} MiB"
    )
    logger.info("CUDA graphs %s", status)
    return status


def decode_buckets(max_num_seqs: int, powers_of_two: bool = False) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then every multiple of 8 up to 256 and of 16 beyond,
    up to max_num_seqs (always the last one); or, for a backend that compiles only those, the
    powers of two from 2 up to the first that holds max_num_seqs."""
    if powers_of_two:
        return [1 << k for k in range(1, max(1, (max_num_seqs - 1).bit_length()) + 1)]
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, max_num_seqs + 16, 16)]
    return sorted({min(b, max_num_seqs) for b in sizes})


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds `num_seqs` sequences, or None when none does."""
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if i < len(buckets) else None


def pad_decode_batch(batch: StepBatch, rows: int, width: int, pad_block: int) -> StepBatch:
    """The decode-only `batch` grown to `rows` sequences and `width` block-table columns. Each
    padding row is a one-token sequence at position 0 of page `pad_block`."""
    n, bs = len(batch.seq_lens), batch.block_size
    extra = rows - n
    if extra < 0 or batch.block_table.shape[1] > width:
        raise ValueError(f"a step of {n} sequences x {batch.block_table.shape[1]} pages exceeds {rows} x {width}")
    table = np.zeros((rows, width), dtype=np.int32)
    table[:n, : batch.block_table.shape[1]] = batch.block_table
    table[n:, 0] = pad_block
    zeros, ones = np.zeros(extra, dtype=np.int64), np.ones(extra, dtype=np.int64)
    return replace(
        batch,
        input_ids=np.concatenate([batch.input_ids, zeros]),
        positions=np.concatenate([batch.positions, zeros]),
        query_start_loc=np.arange(rows + 1, dtype=np.int64),
        seq_lens=np.concatenate([batch.seq_lens, ones]),
        context_lens=np.concatenate([batch.context_lens, zeros]),
        block_table=table,
        slot_mapping=np.concatenate([batch.slot_mapping, np.full(extra, pad_block * bs, dtype=np.int64)]),
        token_seq_idx=np.arange(rows, dtype=np.int64),
        logits_indices=np.arange(rows, dtype=np.int64),
    )


def graphable(batch: StepBatch) -> bool:
    """A pure decode step whose every sequence samples (no prompt logprob rows) and that does not cascade:
    a cascade step runs eagerly (its groups and prefix lengths change per step; a graph holds one shape)."""
    return (
        batch.cascade is None
        and len(batch.input_ids) == len(batch.seq_lens)
        and not batch.prompt_logprob_rows
        and len(batch.sampling_rows) == len(batch.seq_lens)
    )


# capture(fn, pool) -> (replay, pool): `replay()` reruns what `fn()` launched and returns its output.
Capture = Callable[[Callable[[], torch.Tensor], object], tuple[Callable[[], torch.Tensor], object]]


def cuda_capture(fn: Callable[[], torch.Tensor], pool) -> tuple[Callable[[], torch.Tensor], object]:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay, graph.pool()


@dataclass(slots=True)
class _Graph:
    replay: Callable[[], torch.Tensor]  # -> logits [bucket, V]
    buffers: dict  # numpy dtype -> the flat static input buffer each replay's inputs are copied into
    inputs: StepInputs  # views of those buffers (the capture's step)
    # The backend state the captured kernels read and write (triton's split-KV scratch, say): a
    # graph records addresses, not objects, so it lives as long as the graph, or a replay writes
    # into freed memory that other tensors now hold (on an H200: an illegal memory access).
    state: object


class DecodeGraphs:
    """The captured decode graphs of one model runner and the static inputs they read."""

    def __init__(self, runner, max_num_seqs: int, max_model_len: int, capture: Capture = cuda_capture):
        self.runner = runner
        self.buckets = decode_buckets(max_num_seqs, runner.backend.cuda_graph_powers_of_two)
        self.width = -(-max_model_len // runner.block_size)  # block-table columns of the longest sequence
        self.max_seq_len = max_model_len
        self._capture = capture
        self.graphs: dict[int, _Graph] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def capture_all(self) -> None:
        """Capture every bucket, largest first (so the backend's static buffers reach their
        final size before any graph records their addresses); records time and memory used."""
        cuda = self.runner.device.type == "cuda"
        free_before = torch.cuda.mem_get_info(self.runner.device)[0] if cuda else 0
        start, pool = time.perf_counter(), None
        vocab = self.runner.model.config.vocab_size
        # One logits buffer for every graph: each graph's own output is a temporary of the shared
        # pool (reused by the next capture), not [bucket, V] kept alive per bucket.
        self.logits = torch.empty(self.buckets[-1], vocab, dtype=torch.float32, device=self.runner.device)
        for bucket in reversed(self.buckets):
            batch = self._padding_batch(bucket)
            buffers = {d: to_device(h, self.runner.device) for d, h in pack(batch.arrays()).items()}
            inputs = self._graph_shaped(batch.inputs(unpack(buffers, batch.arrays())))
            state = self.runner.backend.plan(inputs.metadata)
            step = functools.partial(self._step, inputs, state, self.logits[:bucket])
            for _ in range(2):  # warm-up outside the graph: lazy initialisation, JIT compiles
                step()
            replay, pool = self._capture(step, pool)
            self.graphs[bucket] = _Graph(replay, buffers, inputs, state)
        if cuda:
            torch.cuda.synchronize(self.runner.device)
            self.capture_bytes = free_before - torch.cuda.mem_get_info(self.runner.device)[0]
        self.capture_seconds = time.perf_counter() - start

    def _step(self, inputs: StepInputs, state, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(self.runner.run_eager(inputs, state))

    def verify(self, seed: int = 0) -> str | None:
        """Replay the smallest and largest graphs on a fresh decode step (random tokens, one page
        per row at a random fill) and compare with the same step run eagerly; None when they
        agree, else why not. Catches a backend whose replay reads stale state before any number
        is measured. Writes K/V into pages no sequence holds yet (the cache is empty at start)."""
        rng = np.random.default_rng(seed)
        bs = self.runner.block_size
        for bucket in dict.fromkeys((self.buckets[0], self.buckets[-1])):
            rows = min(bucket, self.runner.pad_block)
            context = rng.integers(0, bs, rows)
            pages = rng.permutation(self.runner.pad_block)[:rows].astype(np.int32)
            batch = StepBatch(
                input_ids=rng.integers(0, self.runner.model.config.vocab_size, rows),
                positions=context,
                query_start_loc=np.arange(rows + 1, dtype=np.int64),
                seq_lens=context + 1,
                context_lens=context,
                block_table=pages[:, None],
                slot_mapping=pages.astype(np.int64) * bs + context,
                token_seq_idx=np.arange(rows, dtype=np.int64),
                logits_indices=np.arange(rows, dtype=np.int64),
                sampling_rows=list(range(rows)),
                prompt_logprob_rows=[],
                block_size=bs,
                num_cache_blocks=self.runner.num_cache_blocks,
            )
            # The eager step gets the graph's shapes (padding, table width, max length), so both
            # run the same kernels and may be compared closely.
            eager_inputs = self._graph_shaped(self._pad(batch, bucket).to(self.runner.device))
            eager = self.runner.run_eager(eager_inputs, self.runner.backend.plan(eager_inputs.metadata))[:rows]
            inputs = self.inputs(batch, bucket)
            self.runner.backend.plan(inputs.metadata)
            replayed = self.replay(inputs)[:rows]
            diff = (replayed - eager).abs().max().item()
            scale = eager.abs().max().item()
            if not diff <= 1e-2 * max(scale, 1.0):
                return f"the batch-{bucket} graph's logits differ from eager ones by {diff:.3g} (of {scale:.3g})"
        return None

    def bucket(self, batch: StepBatch) -> int | None:
        return bucket_for(len(batch.seq_lens), self.buckets) if graphable(batch) else None

    def inputs(self, batch: StepBatch, bucket: int) -> StepInputs:
        """`batch` padded to `bucket` and copied into that graph's static inputs (one copy per dtype)."""
        graph = self.graphs[bucket]
        padded = self._pad(batch, bucket)
        for dtype, host in pack(padded.arrays()).items():
            copy_to_device_(graph.buffers[dtype], host)
        inputs = replace(graph.inputs, batch=batch, graph=bucket)
        inputs.metadata = self._metadata(padded, graph.inputs)
        return inputs

    def replay(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [bucket, V]: the first len(batch.seq_lens) rows are the step's."""
        return self.graphs[inputs.graph].replay()

    def _pad(self, batch: StepBatch, bucket: int) -> StepBatch:
        return pad_decode_batch(batch, bucket, self.width, self.runner.pad_block)

    def _padding_batch(self, bucket: int) -> StepBatch:
        empty = np.zeros(0, dtype=np.int64)
        nothing = StepBatch(
            input_ids=empty,
            positions=empty,
            query_start_loc=np.zeros(1, dtype=np.int64),
            seq_lens=empty,
            context_lens=empty,
            block_table=np.zeros((0, 1), dtype=np.int32),
            slot_mapping=empty,
            token_seq_idx=empty,
            logits_indices=empty,
            sampling_rows=[],
            prompt_logprob_rows=[],
            block_size=self.runner.block_size,
            num_cache_blocks=self.runner.num_cache_blocks,
        )
        return self._pad(nothing, bucket)

    def _graph_shaped(self, inputs: StepInputs) -> StepInputs:
        """`inputs` with the longest sequence the kernels are captured for as max_seq_len."""
        inputs.metadata = replace(inputs.metadata, max_seq_len=self.max_seq_len)
        return inputs

    def _metadata(self, padded: StepBatch, captured: StepInputs):
        """The captured metadata (same tensors, refilled) with this step's host-side lengths."""
        return replace(
            captured.metadata,
            query_start_loc_cpu=padded.query_start_loc.tolist(),
            seq_lens_cpu=padded.seq_lens.tolist(),
            context_lens_cpu=padded.context_lens.tolist(),
        )
