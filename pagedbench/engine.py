"""LLMEngine: requests in, one step at a time, RequestOutputs out."""

import itertools
import time

import torch

from pagedbench.backends.registry import get_backend, probe
from pagedbench.block_manager import BlockManager, blocks_needed
from pagedbench.config import EngineConfig
from pagedbench.device import resolve_device_dtype
from pagedbench.environment import synchronize
from pagedbench.loader import build_model, resolve_model_config
from pagedbench.model_runner import ModelRunner, kv_bytes_per_block
from pagedbench.outputs import RequestOutput, request_output
from pagedbench.requests import tokenize, validate_request
from pagedbench.sampler import Sampler, SamplingBatch
from pagedbench.sampling_params import SamplingParams
from pagedbench.scheduler import Scheduler
from pagedbench.sequence import Sequence
from pagedbench.stats import STEP_PARTS, EngineStats
from pagedbench.stopping import stop_check
from pagedbench.tokenizer import detokenize_incrementally, load_tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        self.device, self.dtype = resolve_device_dtype(config.device, config.dtype)
        self.model_config, path = resolve_model_config(config.model)
        cfg = self.model_config
        backend_cls = get_backend(config.backend)
        _, reason = probe(
            backend_cls,
            self.device,
            self.dtype,
            cfg.head_dim,
            config.block_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
        )
        if reason:
            raise ValueError(f"backend {config.backend!r} is unavailable here: {reason}")
        self.tokenizer = load_tokenizer(path) if path is not None else None

        max_len_cap = min(cfg.max_position_embeddings, cfg.sliding_window or cfg.max_position_embeddings)
        if config.max_model_len is not None and config.max_model_len > max_len_cap:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit {max_len_cap}")
        rope_len = config.max_model_len or max_len_cap
        self.model = build_model(cfg, path, self.device, self.dtype, rope_len, config.seed)

        bs = config.block_size
        num_blocks = config.num_blocks or self._auto_num_blocks(config.max_model_len or max_len_cap)
        if config.max_model_len is None:  # as long as the model allows and the cache holds
            self.max_model_len = min(max_len_cap, num_blocks * bs)
        else:
            self.max_model_len = config.max_model_len
            if num_blocks < blocks_needed(self.max_model_len, bs):
                raise ValueError(
                    f"KV cache of {num_blocks} blocks x {bs} tokens = {num_blocks * bs} tokens cannot hold one "
                    f"sequence of max_model_len={self.max_model_len}; raise num_blocks or lower max_model_len"
                )
        self.num_blocks = num_blocks
        backend = backend_cls(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5, bs, self.device, self.dtype
        )
        self.runner = ModelRunner(self.model, backend, num_blocks, bs, self.device, self.dtype)
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler(self.device, config.seed)
        self.stats = EngineStats()
        self.sync_timing = False  # synchronize the device around timed parts (for breakdowns)
        self._requests: dict[str, Sequence] = {}
        self._ids = itertools.count()

    @property
    def backend(self):
        return self.runner.backend

    def _auto_num_blocks(self, max_model_len: int) -> int:
        per_block = kv_bytes_per_block(self.model_config, self.config.block_size, self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.gpu_memory_utilization)
        else:
            budget = self.config.cpu_kv_cache_bytes
        useful = self.config.max_num_seqs * blocks_needed(max_model_len, self.config.block_size)
        n = min(budget // per_block, useful)
        if n < 1:
            raise ValueError(f"no memory for even one KV block ({per_block} bytes)")
        return n

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        return tokenize(prompt, self.tokenizer, self.config.model)

    def validate_request(self, token_ids: list[int], params: SamplingParams) -> None:
        validate_request(
            token_ids, params, self.max_model_len, self.model_config.vocab_size, self.tokenizer is not None
        )

    def add_request(
        self,
        prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request; raises ValueError (and changes nothing) when it is invalid."""
        params = params or SamplingParams()
        text, token_ids = self.tokenize(prompt)
        self.validate_request(token_ids, params)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, text, token_ids, params)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> None:
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.finish(seq, "abort")

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use stay with their sequences)."""
        self.block_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -------------------------------------------------------------------------

    def _now(self) -> float:
        if self.sync_timing:
            synchronize(self.device)
        return time.perf_counter()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns outputs of the requests that progressed."""
        st = self.stats
        t0 = self._now()
        sched = self.scheduler.schedule()
        st.preemptions += sched.num_preempted
        if sched.empty:
            return []
        t1 = self._now()
        inputs = self.runner.prepare(sched)
        t2 = self._now()
        state = self.backend.prepare(inputs.metadata)
        t3 = self._now()
        logits = self.runner.run(inputs, state)
        t4 = self._now()
        sampling_seqs = [sched.seqs[i] for i in inputs.sampling_rows]
        tokens = []
        if sampling_seqs:
            batch = SamplingBatch.from_seqs(sampling_seqs, self.model_config.vocab_size, self.device)
            tokens = self.sampler(logits, batch).tolist()
        t5 = time.perf_counter()
        st.steps += 1
        st.peak_blocks_used = max(st.peak_blocks_used, self.block_manager.num_used_blocks)
        if self.block_manager.enable_prefix_caching:
            st.peak_shared_blocks = max(st.peak_shared_blocks, self.block_manager.num_shared_blocks)
        for part, start, end in zip(STEP_PARTS, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
            st.time[part] += end - start
        self.scheduler.computed(sched)
        outputs = []
        for seq, token in zip(sampling_seqs, tokens):
            self._append_token(seq, token, t5)
            outputs.append(self._output(seq))
        return outputs

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        seq.token_ids.append(token)
        seq.token_times.append(now)
        new_text = detokenize_incrementally(self.tokenizer, seq) if self.tokenizer is not None else ""
        stop = stop_check(seq, token, new_text, self.model_config.eos_token_ids, self.max_model_len)
        if stop is not None:
            self.scheduler.finish(seq, *stop)
            if self.tokenizer is not None and not isinstance(seq.stop_reason, str):
                detokenize_incrementally(self.tokenizer, seq, flush=True)  # text held back for a partial character

    def _output(self, seq: Sequence) -> RequestOutput:
        if seq.finished:
            self._requests.pop(seq.request_id, None)
        return request_output(seq)
