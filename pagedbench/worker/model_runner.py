"""ModelRunner: owns the model, the paged KV cache (and its swap space) and the backend; runs a
step's page moves and its forward over one flat token batch (worker/step_batch.py)."""

import math

import numpy as np
import torch

from pagedbench.backends.base import (
    AttentionBackend,
    kv_scale_layout,
    kv_storage_dtype,
    one_line,
    per_token_scales,
    scale_bytes_per_slot,
)
from pagedbench.device.transfer import to_device, to_host
from pagedbench.model.config import ModelConfig
from pagedbench.model.delta_rule import check_linear_attention_kernel
from pagedbench.model.layers import AttentionContext
from pagedbench.model.llama import CausalLM
from pagedbench.model.parallel import NO_TP, TPShard
from pagedbench.model.sparse_index import SparseStep
from pagedbench.worker.layer_attention import LayerAttention, LayerStates
from pagedbench.worker.linear_state import LinearStateCache, LinearStep
from pagedbench.worker.step_batch import BlockTables, ScheduledSequence, StepBatch, StepInputs, step_batch


def kv_bytes_per_block(
    cfg: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    tp: TPShard = NO_TP,
    kv_cache_dtype: str = "auto",
    num_layers: int | None = None,
    index_cache_dtype: str = "auto",
) -> int:
    """K and V (or latent attention's one latent) of one page in every layer (`num_layers`: a
    pipeline stage's), on one tensor-parallel rank, as stored (`kv_cache_dtype`; int8 pages add an
    fp16 scale per token and KV head; DeepSeek-V3.2's index keys beside them, in the model's dtype or fp8
    with an fp32 scale per token: `index_cache_dtype`)."""
    storage = kv_storage_dtype(kv_cache_dtype, dtype)
    layers = num_layers or cfg.num_kv_layers
    slots = cfg.kv_planes * layers * block_size * tp.local_heads(cfg)[1]
    index_keys = 0
    if cfg.indexer is not None:
        per_key = cfg.indexer.head_dim + 4 if index_cache_dtype == "fp8" else cfg.indexer.head_dim * dtype.itemsize
        index_keys = layers * block_size * per_key
    return slots * (cfg.head_dim * storage.itemsize + scale_bytes_per_slot(storage)) + index_keys


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        backend: LayerAttention | AttentionBackend,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        num_cpu_blocks: int = 0,
        kv_cache_dtype: str = "auto",
        calculate_kv_scales: bool = False,
        num_state_slots: int = 0,
        index_cache_dtype: str = "auto",
        linear_attention_kernel: str = "torch",
        num_cpu_state_slots: int = 0,
    ):
        cfg = model.config
        self.model, self.backend = model, backend
        self.block_size, self.device, self.dtype = block_size, device, dtype
        # The last page is the padding page: CUDA-graph padding rows write there.
        self.pad_block = num_blocks
        self.num_cache_blocks = num_blocks + 1
        self.graphs = None  # DecodeGraphs, once captured
        self.block_tables = BlockTables()  # the running sequences' pages, kept across steps
        self.step_recorder = None  # `run --record-steps`: called with each step's inputs (bench/step_record.py)
        stage_layers = list(model.stage.layers(cfg.num_layers))  # a pipeline stage caches its own layers' K/V
        # Hybrid models: pages only for the attention layers, and a DeltaNet state slot per sequence the
        # block manager can admit (engine: num_state_slots).
        layers = [i for i in stage_layers if not cfg.is_linear_layer(i)]
        self.num_state_slots = num_state_slots  # (with prefix caching's snapshot slots after the running ones)
        self.num_cpu_state_slots = num_cpu_state_slots  # swapped-out sequences' states
        self.linear_states = (
            LinearStateCache.allocate(cfg, stage_layers, num_state_slots, device, dtype, model.tp, num_cpu_state_slots)
            if cfg.linear
            else None
        )
        if self.linear_states is not None:  # the gated delta rule's kernel: refused here if it cannot run
            check_linear_attention_kernel(linear_attention_kernel, device)
            self.linear_states.kernel = linear_attention_kernel
        self._allocate_kv_cache(layers, num_cpu_blocks, kv_cache_dtype, index_cache_dtype, calculate_kv_scales)

    def _allocate_kv_cache(
        self, layers: list[int], num_cpu_blocks: int, kv_cache_dtype: str, index_cache_dtype: str, calibrate: bool
    ) -> None:
        """The pages of `layers` (the stage's attention layers): K/V, quantized pages' scales (fp8's
        calibrated on the first step if `calibrate`), index keys, and `num_cpu_blocks` of swap space.
        One allocation; each layer's K and V are views [num_blocks + 1, block_size, H_kv, D] (this
        rank's KV heads)."""
        cfg, device, dtype = self.model.config, self.device, self.dtype
        heads = (self.backend.num_kv_heads, cfg.head_dim)
        shape = (len(layers), cfg.kv_planes, self.num_cache_blocks, self.block_size, *heads)
        storage = kv_storage_dtype(kv_cache_dtype, dtype)
        try:
            self.kv_cache = torch.zeros(shape, device=device, dtype=storage)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            gib = math.prod(shape) * storage.itemsize / 2**30
            raise ValueError(
                f"cannot allocate a KV cache of {self.pad_block} blocks ({gib:.1f} GiB) on {device}: {one_line(e)}"
            ) from None
        # Latent attention has one plane: its values are a view of the latent's first kv_lora_rank dims.
        value_plane = 1 if cfg.mla is None else 0
        value_dims = cfg.head_dim if cfg.mla is None else cfg.mla.kv_lora_rank
        # By the model's layer index (None: another stage's layer).
        self.kv_caches = [None] * cfg.num_layers
        for i, layer in enumerate(layers):
            self.kv_caches[layer] = (self.kv_cache[i, 0], self.kv_cache[i, value_plane, ..., :value_dims])
        # Quantized pages' scales (base.write_kv): per layer for fp8 (1.0 unless calibrated on the
        # first step), per slot and KV head for int8 (moved with its page).
        self.kv_scale, self.kv_scales, self.calibrate_kv = None, None, False
        self.paged = [self.kv_cache]  # what page copies and swaps move
        if storage != dtype:
            scale_shape, scale_dtype = kv_scale_layout(storage, shape[2:])
            self.kv_scale = torch.ones((*shape[:2], *scale_shape), device=device, dtype=scale_dtype)
            self.kv_scales = [None] * cfg.num_layers
            for i, layer in enumerate(layers):
                self.kv_scales[layer] = (self.kv_scale[i, 0], self.kv_scale[i, value_plane])
            if per_token_scales(storage):
                self.paged.append(self.kv_scale)
            else:
                self.calibrate_kv = calibrate
        # DeepSeek-V3.2's index keys: a plane of their own under the same block ids, moved with the pages.
        # fp8 (index_cache_dtype): e4m3 keys and an fp32 scale per token, its own plane of the same block ids.
        self.index_caches = [None] * cfg.num_layers
        if cfg.indexer is not None:
            fp8 = index_cache_dtype == "fp8"
            keys = (len(layers), 1, *shape[2:4], cfg.indexer.head_dim)
            index_cache = torch.zeros(keys, device=device, dtype=torch.float8_e4m3fn if fp8 else dtype)
            scales = torch.ones(keys[:-1], device=device, dtype=torch.float32) if fp8 else None
            for i, layer in enumerate(layers):
                self.index_caches[layer] = (index_cache[i, 0], None if scales is None else scales[i, 0])
            self.paged += [index_cache] + ([scales] if fp8 else [])
        # Swap space: the same layout in (pinned, on CUDA) CPU memory.
        pin = device.type == "cuda" and num_cpu_blocks > 0
        self.cpu_paged = [
            torch.zeros((*t.shape[:2], num_cpu_blocks, *t.shape[3:]), dtype=t.dtype, pin_memory=pin) for t in self.paged
        ]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: K/V of block src -> block dst in every layer (reads happen before writes)."""
        src, dst = to_device(np.array(copies, dtype=np.int64).T.copy(), self.device)
        for paged in self.paged:
            paged[:, :, dst] = paged[:, :, src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """K/V of device block -> CPU block, every layer."""
        device_blocks, cpu_blocks = np.array(pairs, dtype=np.int64).T
        device_index, cpu_index = to_device(device_blocks.copy(), self.device), torch.from_numpy(cpu_blocks)
        for paged, cpu in zip(self.paged, self.cpu_paged):
            cpu[:, :, cpu_index] = to_host(paged[:, :, device_index])

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """K/V of CPU block -> device block, every layer."""
        cpu_blocks, device_blocks = np.array(pairs, dtype=np.int64).T
        device_index, cpu_index = to_device(device_blocks.copy(), self.device), torch.from_numpy(cpu_blocks)
        for paged, cpu in zip(self.paged, self.cpu_paged):
            paged[:, :, device_index] = to_device(cpu[:, :, cpu_index], self.device)

    def build_inputs(self, seqs: list[ScheduledSequence], num_tokens: list[int]) -> StepInputs:
        """The step's inputs on the device (`seqs[i]` runs its next `num_tokens[i]` tokens): a
        captured graph's static inputs for a decode step that fits one, else fresh tensors."""
        return self.device_inputs(self.lay_out(seqs, num_tokens))

    def lay_out(self, seqs: list[ScheduledSequence], num_tokens: list[int]) -> StepBatch:
        """The step's host arrays (what build_inputs copies; async scheduling lays a step out ahead)."""
        return step_batch(seqs, num_tokens, self.block_size, self.num_cache_blocks, self.block_tables)

    def device_inputs(self, batch: StepBatch) -> StepInputs:
        bucket = self.graphs.bucket(batch) if self.graphs is not None else None
        return batch.to(self.device) if bucket is None else self.graphs.inputs(batch, bucket)

    def run_batch(self, batch: StepBatch) -> torch.Tensor | None:
        """A whole step from its host arrays (what a tensor-parallel worker does)."""
        inputs = batch.to(self.device)
        return self.run(inputs, self.backend.plan(inputs.metadata))

    def run(self, inputs: StepInputs, backend_state, timer=None, hidden=None) -> torch.Tensor | None:
        """fp32 logits [len(logits_indices), vocab] (None on tensor-parallel ranks other than 0);
        a graph's step returns its bucket's rows, the step's own first. `timer` (a DeviceTimer)
        times each layer's attention in eager steps. A pipeline stage starts from the previous
        stage's `hidden` and, before the last, returns its own [T, hidden_size]."""
        if self.step_recorder is not None:  # host arrays only: no device sync
            self.step_recorder.record(inputs, timer)
        if inputs.graph is not None:
            return self.graphs.replay(inputs)
        return self.run_eager(inputs, backend_state, timer, hidden)

    def run_eager(self, inputs: StepInputs, backend_state: LayerStates, timer=None, hidden=None) -> torch.Tensor | None:
        ctx = AttentionContext(
            backend_state.backends,
            backend_state.states,
            inputs.metadata.slot_mapping,
            self.kv_caches,
            timer,
            self.kv_scales,
            self.calibrate_kv,
            self._linear_step(inputs.batch),
            self._sparse_step(inputs.metadata, timer),
        )
        self.calibrate_kv = False  # the first step's K/V set the fp8 scales
        return self.model(inputs.input_ids, inputs.metadata.positions, ctx, inputs.logits_indices, hidden)

    def _linear_step(self, batch) -> LinearStep | None:
        if self.linear_states is None:
            return None
        qsl, ctx = batch.query_start_loc.tolist(), batch.context_lens.tolist()
        return LinearStep(self.linear_states, batch.state_slots, qsl, ctx, batch.state_snapshots)

    def _sparse_step(self, meta, timer) -> SparseStep | None:
        cfg = self.model.config
        return None if cfg.indexer is None else SparseStep.build(meta, self.index_caches, cfg, timer)

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Linear-attention state of slot src -> slot dst (a fork's sample continues its parent's, a
        prefix hit resumes from a snapshot, a swapped sequence's state leaves for a CPU slot and returns)."""
        self.linear_states.copy(pairs)

    @property
    def backend(self) -> LayerAttention:
        """Every layer's backend, planned once per step for all of them (`plan` -> LayerStates)."""
        return self._attention

    @backend.setter
    def backend(self, backend: LayerAttention | AttentionBackend) -> None:
        """A single backend serves every layer (what tests and a plain model use)."""
        if not isinstance(backend, LayerAttention):
            backend = LayerAttention.uniform(backend, self.model.config.num_layers)
        self._attention = backend
