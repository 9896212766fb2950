"""LLMEngine: requests in, one step at a time, RequestOutputs out."""

import dataclasses
import itertools
import logging
import secrets
import time
import weakref
from collections.abc import Iterable

import numpy as np
import torch

from pagedbench.backends.base import one_line
from pagedbench.beam_search import BeamSearch, BeamSearchParams
from pagedbench.block_manager import BlockManager, blocks_needed
from pagedbench.config import EngineConfig
from pagedbench.cuda_graphs import DecodeGraphs, decode_buckets
from pagedbench.device import resolve_device_dtype
from pagedbench.device_timer import DeviceTimer
from pagedbench.loader import build_model, resolve_model_config, weights_path
from pagedbench.model_runner import ModelRunner, build_backend, kv_bytes_per_block, profile_activation_bytes
from pagedbench.outputs import Logprob, RequestOutput, request_output
from pagedbench.parallel import TPShard
from pagedbench.requests import tokenize, validate_request
from pagedbench.sampler import Sampler, SamplerOutput, SamplingBatch
from pagedbench.sampling_params import SamplingParams
from pagedbench.scheduler import Scheduler
from pagedbench.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedbench.stats import STEP_PARTS, EngineStats
from pagedbench.stopping import stop_check
from pagedbench.tokenizer import bad_words_token_ids, detokenize_incrementally, load_tokenizer, preset_tokenizer
from pagedbench.transfer import to_device, to_list
from pagedbench.workers import ParallelRunner, Workers, rank_device

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()
        if config.seed is None:  # one fresh seed, shared with the tensor-parallel workers
            config = dataclasses.replace(config, seed=secrets.randbelow(2**31))
        self.config = config
        self.device, self.dtype = resolve_device_dtype(config.device, config.dtype)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # graph capture, events and syncs act on the current device
        self.model_config, path = resolve_model_config(config.model, need_weights=config.load_format != "dummy")
        cfg = self.model_config
        self.tp = TPShard(0, config.tensor_parallel_size)
        self.tp.validate(cfg)
        if self.tp.size > 1:
            self.device = rank_device(self.device, 0)
            if self.device.type == "cuda" and torch.cuda.device_count() < self.tp.size:
                raise ValueError(
                    f"tensor_parallel_size={self.tp.size} needs as many GPUs; {torch.cuda.device_count()} visible"
                )
        bs = config.block_size
        backend = build_backend(config.backend, cfg, bs, self.device, self.dtype, self.tp)
        if config.tokenizer is not None:
            self.tokenizer = load_tokenizer(config.tokenizer)
        elif path is not None:
            self.tokenizer = load_tokenizer(path, required=False)
        else:  # a preset: bytes as tokens
            self.tokenizer = preset_tokenizer(cfg.vocab_size, cfg.eos_token_ids)

        max_len_cap = min(cfg.max_position_embeddings, cfg.sliding_window or cfg.max_position_embeddings)
        if config.max_model_len is not None and config.max_model_len > max_len_cap:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit {max_len_cap}")
        rope_len = config.max_model_len or max_len_cap
        # Workers build their shards while this process builds rank 0's.
        self.workers = Workers(config, rope_len, self.tp.size) if self.tp.size > 1 else None
        try:
            self.model = build_model(
                cfg,
                weights_path(path, config),
                self.device,
                self.dtype,
                rope_len,
                config.seed,
                self.tp,
                config.preset_init,
            )
            num_blocks = config.num_blocks or self._auto_num_blocks(backend, config.max_model_len or max_len_cap)
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
            num_cpu_blocks = 0
            if config.preemption_mode == "swap":
                num_cpu_blocks = int(config.swap_space * 2**30) // kv_bytes_per_block(cfg, bs, self.dtype, self.tp)
            self.runner = ModelRunner(self.model, backend, num_blocks, bs, self.device, self.dtype, num_cpu_blocks)
            if self.workers is not None:
                self.workers.start(self.device, num_blocks, num_cpu_blocks)
                self.runner = ParallelRunner(self.runner, self.workers)
                weakref.finalize(self, self.workers.shutdown)
            self.cuda_graphs = self._capture_graphs()
        except BaseException:
            self.shutdown()
            raise
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching, num_cpu_blocks)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.scheduling_policy,
            config.preemption_mode,
        )
        self.sampler = Sampler(self.device, config.seed)
        self.stats = EngineStats()
        # Device spans (CUDA events, read after a run; off unless enabled): "forward" / "forward_graph"
        # (eager / replayed), "attention" (each eager layer's call), "sample" (the sampler's kernels).
        self.timer = DeviceTimer(self.device)
        self._requests: dict[str, SequenceGroup] = {}
        self._sampling_batch: SamplingBatch | None = None  # last step's, reused while its sequences run on
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineConfig) -> "LLMEngine":
        """vLLM's constructor name (EngineArgs is EngineConfig here)."""
        return cls(args)

    @property
    def backend(self):
        return self.runner.backend

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is collected)."""
        if getattr(self, "workers", None) is not None:
            self.workers.shutdown()

    def _auto_num_blocks(self, backend, max_model_len: int) -> int:
        """KV blocks from the memory budget (`_cuda_kv_budget` on CUDA, cpu_kv_cache_bytes on
        CPU), never more than max_num_seqs full-length sequences need."""
        config = self.config
        per_block = kv_bytes_per_block(self.model_config, config.block_size, self.dtype, self.tp)
        if self.device.type == "cuda":
            budget = self._cuda_kv_budget(backend, max_model_len, per_block)
        else:
            budget = config.cpu_kv_cache_bytes
        n = min(budget // per_block, config.max_num_seqs * blocks_needed(max_model_len, config.block_size))
        if n < 1:
            raise ValueError(f"no memory for even one KV block ({per_block} bytes)")
        logger.info("KV cache: %d blocks of %d tokens, %.2f GiB", n, config.block_size, n * per_block / 2**30)
        return n

    def _cuda_kv_budget(self, backend, max_model_len: int, per_block: int) -> int:
        """vLLM's rule: gpu_memory_utilization x the device's memory, less what is in use (weights,
        other processes), the peak of a profiled step of max_num_batched_tokens tokens and, with
        CUDA graphs, their pool (a profiled decode step) and logits buffer."""
        config, vocab = self.config, self.model_config.vocab_size
        if self.tp.size > 1:
            # The profiling step would need the other ranks in its all-reduces, and they start
            # later: the free memory's share, as before vLLM profiled.
            return int(torch.cuda.mem_get_info(self.device)[0] * config.gpu_memory_utilization)
        args = (config.block_size, self.device, self.dtype)
        peak = profile_activation_bytes(
            self.model, backend, config.max_num_batched_tokens, config.max_num_seqs, max_model_len, *args
        )
        if self._graph_off_reason(backend) is None:
            rows = decode_buckets(config.max_num_seqs, backend.cuda_graph_powers_of_two)[-1]  # the largest graph
            peak += profile_activation_bytes(self.model, backend, rows, rows, 1, *args)
            peak += rows * vocab * 4
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * config.gpu_memory_utilization) - (total - free) - peak
        if budget < per_block:
            raise ValueError(
                f"the model does not fit: gpu_memory_utilization={config.gpu_memory_utilization} of "
                f"{total / 2**30:.1f} GiB leaves {budget / 2**30:.2f} GiB for the KV cache after "
                f"{(total - free) / 2**30:.2f} GiB in use and {peak / 2**30:.2f} GiB of activations; "
                "raise gpu_memory_utilization or lower max_num_batched_tokens"
            )
        return budget

    def _graph_off_reason(self, backend) -> str | None:
        if self.config.enforce_eager:
            return "enforce_eager"
        if self.device.type != "cuda":
            return f"no CUDA device (device is {self.device.type})"
        if self.tp.size > 1:
            return "tensor-parallel steps run eagerly"
        return backend.cuda_graph_reason

    def _capture_graphs(self) -> str:
        """Capture the decode CUDA graphs where they can run; returns what the reports say:
        "on: ..." or "off: why"."""
        reason = self._graph_off_reason(self.backend)
        if reason is not None:
            return f"off: {reason}"
        graphs = DecodeGraphs(self.runner, self.config.max_num_seqs, self.max_model_len)
        logger.info("capturing decode CUDA graphs for batch sizes %s", graphs.buckets)
        try:
            graphs.capture_all()
            mismatch = graphs.verify()
        except Exception as e:  # a backend that cannot be captured after all: eager, and say why
            mismatch = f"capture failed: {one_line(e)}"
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

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        return tokenize(prompt, self.tokenizer, self.config.model)

    def validate_request(self, token_ids: list[int], params: SamplingParams | BeamSearchParams) -> None:
        if isinstance(params, BeamSearchParams):
            params.validate()
            validate_request(token_ids, SamplingParams(), self.max_model_len, self.model_config.vocab_size, True)
        else:
            validate_request(
                token_ids,
                params,
                self.max_model_len,
                self.model_config.vocab_size,
                self.tokenizer is not None,
                self.config.max_logprobs,
            )
        if params.width > self.config.max_num_seqs:
            name = "beam_width" if isinstance(params, BeamSearchParams) else "best_of"
            raise ValueError(f"{name}={params.width} is more than max_num_seqs={self.config.max_num_seqs}")

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
        if params is not None and not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise TypeError(f"params must be a SamplingParams or BeamSearchParams, got {type(params).__name__}")
        params = params or SamplingParams()
        text, token_ids = self.tokenize(prompt)
        self.validate_request(token_ids, params)
        self.validate_priority(priority)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(params, SamplingParams) and params.bad_words:
            params._bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        seq = Sequence(request_id, text, token_ids, params)
        seq.priority = priority
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        seq.generator = self._generator(params, 0)
        group = SequenceGroup(request_id, text, token_ids, params, [seq], seq.arrival_time)
        if isinstance(params, BeamSearchParams):
            group.beam = BeamSearch(params, self.model_config.eos_token_ids, self.max_model_len)
        self._requests[request_id] = group
        self.scheduler.add(seq)
        return request_id

    def validate_priority(self, priority) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} given, but scheduling_policy is {self.config.scheduling_policy!r}")

    def _generator(self, params, index: int) -> torch.Generator | None:
        """Sample `index` of a seeded request draws from seed + index (vLLM's per-sample seeds)."""
        if getattr(params, "seed", None) is None:
            return None
        return torch.Generator(device=self.device).manual_seed(params.seed + index)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort one request or several (vLLM v1 takes a list); unknown ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            group = self._requests.pop(rid, None)
            for seq in group.seqs if group is not None else []:
                if not seq.finished:
                    self.scheduler.finish(seq, "abort")

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def get_tokenizer(self):
        """The Hugging Face tokenizer, or None for a preset without one."""
        return self.tokenizer

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use stay with their sequences)."""
        self.block_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns outputs of the requests that progressed."""
        st, bm = self.stats, self.block_manager
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        st.preemptions += sched.num_preempted
        if sched.empty:
            return []
        t1 = time.perf_counter()
        try:
            inputs, logits, (t2, t3, t4) = self._run_model(sched)
        except BaseException:
            self._abandon(sched)
            raise
        for seq, n in zip(sched.seqs, sched.num_tokens):
            st.prompt_tokens += max(0, min(n, seq.num_prompt_tokens - seq.num_computed_tokens))
        self.scheduler.computed(sched)
        plan = inputs.plan
        num_sampling = len(plan.sampling_rows)
        if plan.prompt_logprob_rows:
            self._record_prompt_logprobs(sched.seqs, plan.prompt_logprob_rows, logits[num_sampling:])
        progressed = self._sample([sched.seqs[i] for i in plan.sampling_rows], logits[:num_sampling])
        t5 = time.perf_counter()
        st.steps += 1
        st.peak_blocks_used = max(st.peak_blocks_used, bm.num_used_blocks)
        st.peak_shared_blocks = max(st.peak_shared_blocks, bm.num_shared_blocks)
        wasted = self._wasted_slots()
        st.used_block_steps += bm.num_used_blocks
        st.wasted_slot_steps += wasted
        st.peak_wasted_slots = max(st.peak_wasted_slots, wasted)
        st.timeline.append((t5, bm.num_used_blocks, wasted))
        for part, start, end in zip(STEP_PARTS, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
            st.time[part] += end - start
        for group in progressed:
            group.token_times.append(t5)
        return [self._output(group) for group in progressed]

    def _run_model(self, sched) -> tuple:
        """The step's page moves, metadata and forward: (inputs, logits, (t2, t3, t4))."""
        st, bm = self.stats, self.block_manager
        # Before the step writes anything: pages leaving for swap space, copy-on-write of shared
        # pages it writes into, pages coming back from swap space (that order: each may reuse
        # a block the one before read).
        swap_out, swap_in = bm.take_swaps()
        copies = bm.take_copies()
        if swap_out:
            self.runner.swap_out(swap_out)
            st.swap_outs += 1
        if copies:
            self.runner.copy_blocks(copies)
            st.block_copies += len(copies)
        if swap_in:
            self.runner.swap_in(swap_in)
        inputs = self.runner.prepare(sched)
        t2 = time.perf_counter()
        state = self.backend.prepare(inputs.metadata)
        t3 = time.perf_counter()
        forward_start = self.timer.mark()
        timer = self.timer if self.timer.enabled and inputs.graph is None else None
        logits = self.runner.run(inputs, state, timer)
        self.timer.span("forward" if inputs.graph is None else "forward_graph", forward_start)
        return inputs, logits, (t2, t3, time.perf_counter())

    def _abandon(self, sched) -> None:
        """A step that raised (an interrupt, out of memory, a worker) left K/V unwritten: forget
        every cached prefix (pages registered for this step among them) and send the step's
        sequences back to recompute, so nothing later reads what was never written."""
        self.block_manager.reset_prefix_cache()
        self.block_manager.take_copies()  # moves planned for the abandoned step, if not yet taken
        self.block_manager.take_swaps()
        for seq in sched.seqs:
            if seq.status is SequenceStatus.RUNNING:
                self.scheduler.preempt(seq, swap=False)

    def _wasted_slots(self) -> int:
        """Internal fragmentation: slots of running sequences' last pages that hold no token yet
        (a page shared by forks counted once, as full as its fullest reader)."""
        bs, filled = self.config.block_size, {}
        for seq in self.scheduler.running:
            if seq.block_table and seq.num_computed_tokens % bs:
                last = seq.block_table[(seq.num_computed_tokens - 1) // bs]
                filled[last] = max(filled.get(last, 0), seq.num_computed_tokens % bs)
            if len(seq.block_table) * bs >= seq.num_computed_tokens + bs:  # a page allocated ahead, empty
                filled.setdefault(seq.block_table[-1], 0)
        return sum(bs - n for n in filled.values())

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[SequenceGroup]:
        """Give `seqs` (logits row i for seqs[i]) their next tokens: a request's first token
        forks it into its best_of samples (all reading the same row), samples draw from the
        sampler, beams report to their search. Returns the requests that got tokens."""
        rows = list(range(len(seqs)))
        groups = [self._requests[s.request_id] for s in seqs]
        for i, (seq, group) in enumerate(zip(list(seqs), list(groups))):
            if group.beam is None and not seq.forked:
                for index in range(1, group.params.best_of):
                    child = self.scheduler.fork(seq, index)
                    child.generator = self._generator(group.params, index)
                    group.seqs.append(child)
                    seqs.append(child), groups.append(group), rows.append(i)
        progressed: dict[int, SequenceGroup] = {}
        samples = [j for j, g in enumerate(groups) if g.beam is None]
        if samples:
            sampled = [seqs[j] for j in samples]
            picked = [rows[j] for j in samples]
            sub = logits if picked == list(range(len(logits))) else logits[picked]
            cfg = self.model_config
            batch = SamplingBatch.from_seqs(
                sampled, cfg.vocab_size, self.device, cfg.eos_token_ids, previous=self._sampling_batch
            )
            self._sampling_batch = batch
            sample_start = self.timer.mark()
            out = self.sampler(sub, batch)
            self.timer.span("sample", sample_start)
            host = out.to_host()  # the step's one wait for the device
            tokens = host.tokens
            if batch.logprob_rows is not None:
                self._record_logprobs(sampled, batch.logprob_rows, host)
            self.stats.generation_tokens += len(samples)
            for j, token in zip(samples, tokens):
                self._append_token(seqs[j], token)
                progressed[id(groups[j])] = groups[j]
        beams = [j for j, g in enumerate(groups) if g.beam is not None]
        if beams:
            for group in self._advance_beams([seqs[j] for j in beams], logits[[rows[j] for j in beams]]):
                progressed[id(group)] = group
        return list(progressed.values())

    def _record_logprobs(self, seqs: list[Sequence], rows: list[int], out: SamplerOutput) -> None:
        """For the batch rows `rows` (of `seqs`): cumulative logprobs, and where the request asks
        for logprobs, the sampled token's and the top ones (vLLM's layout: token id -> Logprob)."""
        tokens, picked, ranks = out.tokens, out.token_logprobs, out.token_ranks  # host lists (to_host)
        top = (out.top_token_ids, out.top_logprobs) if out.top_token_ids is not None else None
        for k, row in enumerate(rows):
            seq = seqs[row]
            seq.cumulative_logprob += picked[k]
            if seq.params.logprobs is None:
                continue
            entry = {}
            if top is not None:
                for rank, (tid, lp) in enumerate(zip(top[0][k][: seq.params.logprobs], top[1][k]), 1):
                    entry[tid] = Logprob(lp, rank, self._token_text(tid, seq))
            entry[tokens[row]] = Logprob(picked[k], ranks[k], self._token_text(tokens[row], seq))
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(entry)

    def _record_prompt_logprobs(self, seqs: list[Sequence], rows: list[tuple[int, int, int]], logits) -> None:
        """Prompt logprobs of this step's prompt chunks: logits row j of (seq, first, count)
        predicts prompt token first + j + 1."""
        offset = 0
        for i, first, count in rows:
            seq = seqs[i]
            chunk = logits[offset : offset + count].log_softmax(dim=-1)
            offset += count
            targets = seq.prompt_token_ids[first + 1 : first + 1 + count]
            picked = chunk.gather(-1, to_device(np.array(targets, dtype=np.int64), chunk.device)[:, None])
            ranks = to_list((chunk > picked).sum(dim=-1) + 1)
            top_lps, top_ids = (
                map(to_list, chunk.topk(seq.params.prompt_logprobs, dim=-1))
                if seq.params.prompt_logprobs
                else (None, None)
            )
            picked = to_list(picked.squeeze(-1))
            seq.prompt_logprobs = seq.prompt_logprobs or []
            for j, token in enumerate(targets):
                entry = {}
                if top_ids is not None:
                    for rank, (tid, lp) in enumerate(zip(top_ids[j], top_lps[j]), 1):
                        entry[tid] = Logprob(lp, rank, self._token_text(tid, seq))
                entry[token] = Logprob(picked[j], ranks[j], self._token_text(token, seq))
                seq.prompt_logprobs.append(entry)

    def _detokenizer(self, seq: Sequence):
        """The tokenizer, unless there is none or the request asked for token ids only."""
        return self.tokenizer if getattr(seq.params, "detokenize", True) else None

    def _token_text(self, token: int, seq: Sequence) -> str | None:
        tokenizer = self._detokenizer(seq)
        return tokenizer.decode([token]) if tokenizer is not None else None

    def _advance_beams(self, seqs: list[Sequence], logits: torch.Tensor) -> list[SequenceGroup]:
        """Report each beam's best continuations; a request whose live beams have all reported
        selects its next beams (fork, continue, free). Returns those requests."""
        temperature = to_device(np.array([s.params.temperature or 1.0 for s in seqs], dtype=np.float32), logits.device)
        logprobs = torch.log_softmax(logits / temperature[:, None], dim=-1)
        k = min(max(self._requests[s.request_id].beam.num_candidates for s in seqs), logprobs.shape[-1])
        values, token_ids = map(to_list, logprobs.topk(k, dim=-1))
        reported: dict[int, SequenceGroup] = {}
        for seq, lps, ids in zip(seqs, values, token_ids):
            group = self._requests[seq.request_id]
            group.beam.report(seq, lps, ids)
            seq.paused = True  # until every live beam of its request has reported
            reported[id(group)] = group
        selected = [g for g in reported.values() if g.beam.ready(g.seqs)]
        for group in selected:
            self._select_beams(group)
        return selected

    def _select_beams(self, group: SequenceGroup) -> None:
        chosen = group.beam.select()
        self.stats.generation_tokens += len(chosen)
        kept: set[int] = set()
        beams = []
        for rank, c in enumerate(chosen):  # fork before any parent gets its new token
            if id(c.parent) in kept:
                beams.append(self.scheduler.fork(c.parent, rank))
            else:
                kept.add(id(c.parent))
                beams.append(c.parent)
        group.note_cached_tokens()
        for seq in group.seqs:
            if id(seq) not in kept:
                self.scheduler.finish(seq, "pruned")
        for rank, (seq, c) in enumerate(zip(beams, chosen)):
            seq.token_ids.append(c.token)
            seq.cumulative_logprob = c.cum_logprob
            seq.index = rank
            seq.paused = False
        group.seqs = beams

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        tokenizer = self._detokenizer(seq)
        new_text = detokenize_incrementally(tokenizer, seq) if tokenizer is not None else ""
        stop = stop_check(seq, token, new_text, self.model_config.eos_token_ids, self.max_model_len)
        if stop is not None:
            self.scheduler.finish(seq, *stop)
            if tokenizer is not None and not isinstance(seq.stop_reason, str):
                detokenize_incrementally(tokenizer, seq, flush=True)  # text held back for a partial character

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _output(self, group: SequenceGroup) -> RequestOutput:
        if group.finished:
            self._requests.pop(group.request_id, None)
        return request_output(group, self._decode)
