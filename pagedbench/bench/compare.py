"""The benchmark driver: one scenario's request set on one or more backends, in one process,
each with the same KV budget and engine limits; warmup, then measured runs."""

import dataclasses
import gc
import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from pagedbench.backends.cascade import CascadeCounts
from pagedbench.backends.registry import resolve
from pagedbench.bench.alone_check import add_alone_columns
from pagedbench.bench.environment import environment, synchronize
from pagedbench.bench.metrics import identical_token_share, latency_summary, request_latencies, throughput_summary
from pagedbench.bench.noise import rankings, spread
from pagedbench.bench.peers import hf_peer, peer_provider, peer_unavailable_reason
from pagedbench.bench.report_schema import setting_columns
from pagedbench.bench.scenario import Request, Scenario, model_requests
from pagedbench.bench.step_profile import profile_decode
from pagedbench.bench.step_record import RecordSteps, detach_recorder
from pagedbench.config import EngineConfig, speculation_label
from pagedbench.device.dtypes import resolve_device_dtype
from pagedbench.engine.data_parallel import make_engine
from pagedbench.engine.kv_budget import longest_sequence
from pagedbench.engine.llm_engine import LLMEngine
from pagedbench.engine.outputs import RequestOutput
from pagedbench.model.config import ModelConfig, check_model_settings
from pagedbench.model.delta_rule import timing_caveat as linear_timing_caveat
from pagedbench.model.loader import ResolvedModel, resolve_model_config
from pagedbench.model.moe import experts_kernel
from pagedbench.model.parallel import TPShard
from pagedbench.worker.linear_state import state_bytes_per_sequence
from pagedbench.worker.model_runner import kv_bytes_per_block

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Measurement:
    """One measured run of one backend."""

    row: dict  # a CSV row: environment, engine config, metrics, engine internals
    outputs: list[list[int]]  # output token ids of each request's samples, in request order
    requests: list[dict]  # per request: lengths and latencies (for latency CDFs)
    kv: list[dict]  # KV utilization over the run (at most MAX_KV_POINTS steps)


@dataclass(slots=True)
class Comparison:
    rows: list[dict]  # one per backend x run, unavailable backends too (status, reason)
    request_rows: list[dict]
    kv_rows: list[dict]
    unavailable: dict[str, str]
    # What cut the compare short (Ctrl-C, or a backend's RuntimeError), None when it ran to the end:
    # the runs that finished are rows, and a "cut" row names each backend it stopped or never started.
    stopped: BaseException | None = None
    running: tuple | None = None  # the backend being measured: its row head and finished runs
    num_requests: int = 0  # the requests each backend runs (a dataset may hold fewer than num_prompts)


def engine_config(
    scenario: Scenario, model: ModelConfig, backend: str, device, dtype: torch.dtype, speculative_config="scenario"
) -> EngineConfig:
    """The scenario's engine settings for `backend` on `device` and `dtype`, with the KV budget as
    blocks (of its kv_cache_dtype and index_cache_dtype) and `speculative_config` (default: the scenario's)."""
    engine = scenario.engine
    check_model_settings(engine, model)
    spec = engine.speculative_config if speculative_config == "scenario" else speculative_config
    blocks = kv_blocks(scenario, dtype, model)
    return dataclasses.replace(
        engine, backend=backend, device=device, dtype=dtype, num_blocks=blocks, speculative_config=spec
    )


def engine_max_model_len(scenario: Scenario, model: ModelConfig, dtype: torch.dtype) -> int:
    """The longest sequence every backend's engine takes (the scenario's max_model_len, else the
    model's, capped by the KV budget, as the engine sizes it), known before any engine is built."""
    config = engine_config(scenario, model, "", None, dtype)
    return longest_sequence(config, model, config.num_blocks)


def kv_blocks(scenario: Scenario, dtype: torch.dtype, model: ModelConfig) -> int:
    """The KV budget in blocks. The scenario gives it as unquantized pages; quantized pages (and
    fp8 index keys) get the same memory, so more of them (twice as many fp8 pages as bf16 ones)."""
    engine = scenario.engine
    if engine.kv_cache_dtype == "auto" and engine.index_cache_dtype == "auto":
        return scenario.kv_blocks
    tp = TPShard(0, engine.tensor_parallel_size)
    memory = scenario.kv_blocks * kv_bytes_per_block(model, engine.block_size, dtype, tp)
    stored = (engine.kv_cache_dtype, None, engine.index_cache_dtype)  # None: every layer
    return memory // kv_bytes_per_block(model, engine.block_size, dtype, tp, *stored)


def speculation_variants(scenario: Scenario) -> list[dict | None]:
    """The speculative settings each backend runs: the scenario's, and none first if it asks for a baseline."""
    spec = scenario.engine.speculative_config
    return [None, spec] if scenario.speculation_baseline else [spec]


def drive(engine: LLMEngine, requests: list[Request], desc: str = "") -> tuple[float, list[RequestOutput]]:
    """Add each request when its arrival time has come, step until all finish (sleeping while
    idle until the next arrival). Returns the wall time and the finished outputs in request order,
    the only ones the engine makes (FINAL_ONLY: no output work per step that grows with its length)."""
    from pagedbench.sample.sampling_params import RequestOutputKind, with_output_kind

    params = with_output_kind([r.params for r in requests], RequestOutputKind.FINAL_ONLY)
    pending = deque(sorted(range(len(requests)), key=lambda i: requests[i].arrival_time))
    finished: dict[int, RequestOutput] = {}
    with tqdm(total=len(requests), desc=desc, disable=None, leave=False) as bar:
        synchronize(engine.device)
        start = time.perf_counter()
        while len(finished) < len(requests):
            now = time.perf_counter()
            while pending and start + requests[pending[0]].arrival_time <= now:
                i = pending.popleft()
                engine.add_request(
                    {"prompt_token_ids": requests[i].prompt_token_ids},
                    params[i],
                    request_id=str(i),
                    arrival_time=start + requests[i].arrival_time,
                )
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, start + requests[pending[0]].arrival_time - time.perf_counter()))
                continue
            for out in engine.step():
                if out.finished:
                    finished[int(out.request_id)] = out
                    bar.update()
        synchronize(engine.device)
        duration = time.perf_counter() - start
    return duration, [finished[i] for i in range(len(requests))]


def measure(engine: LLMEngine, requests: list[Request], desc: str) -> Measurement:
    """One run of `requests` (an LLMEngine, or a DataParallelEngine: its replicas' counters merged)."""
    engine.reset_prefix_cache()  # every run starts cold, as the warmup did: repeats measure the same thing
    engine.reset_counters()
    cascade_before = dataclasses.replace(cascade_counts(engine))
    duration, outputs = drive(engine, requests, desc)
    counters = engine.run_counters()
    device, st = counters.device, counters.stats
    output_ids = [[c.token_ids for c in o.outputs] for o in outputs]  # each request's samples
    output_lens = [sum(map(len, samples)) for samples in output_ids]
    pipelined = engine.config.pipeline_parallel_size > 1
    row = {
        **throughput_summary([len(r.prompt_token_ids) for r in requests], output_lens, duration),
        **latency_summary([o.metrics for o in outputs]),
        "steps": st.steps,
        "preemptions": st.preemptions,
        "peak_kv_blocks": st.peak_blocks_used,
        "peak_kv_utilization": st.peak_blocks_used / engine.num_blocks,
        "peak_running_seqs": st.peak_running,
        "world_size": engine.world_size,  # processes (GPUs) the engine runs on: dp x tp x pp
        # as the engine ran it (a hybrid model keeping no state snapshots turns it off), not as the scenario asked
        "enable_prefix_caching": engine.config.enable_prefix_caching,
        # Pipeline parallelism: steps in flight when each was launched (1: the stages never overlap).
        "mean_steps_in_flight": st.in_flight_steps / max(st.steps, 1) if pipelined else 1.0,
        # Data parallelism: requests and output tokens per replica (one engine: all of them).
        **(
            engine.replica_load()
            if hasattr(engine, "replica_load")
            else {"replica_requests": str(len(requests)), "replica_output_tokens": str(sum(output_lens))}
        ),
        **st.time_columns(),
        **device_columns(device, sum(st.time.values())),
        **linear_kernel_column(engine),
        "time_backend_compile_s": counters.compile_seconds,  # 0 after a warmup run
        "time_model_compile_s": counters.model_compile_seconds,  # torch.compile of the layers (fused.py)
        "cuda_graphs": engine.cuda_graphs,  # "on: sizes, capture time, MiB" or "off: why"
        "prefix_cache_queries": counters.prefix_queries,  # prompt tokens looked up
        "prefix_cache_hits": counters.prefix_hits,  # of which cached
        **snapshot_columns(engine),
        "peak_shared_blocks": st.peak_shared_blocks,
        "block_copies": st.block_copies,  # copy-on-write page copies (forked samples)
        **cascade_columns(engine, cascade_before),
        "mean_kv_utilization": st.used_block_steps / max(st.steps, 1) / engine.num_blocks,
        "mean_wasted_slots": st.wasted_slot_steps / max(st.wasted_slot_samples, 1),  # internal fragmentation
        "peak_wasted_slots": st.peak_wasted_slots,
        **st.spec.columns(),
        **grammar_columns(st, device.get("grammar", 0.0)),
        "async_scheduling": getattr(engine, "async_scheduling", False),  # as the engine resolved it
    }
    row["busy_share"] = row["time_device_s"] / duration if row["time_device_s"] else np.nan  # (device timed: CUDA)
    per_request = [
        {"request": i, "input_len": len(r.prompt_token_ids), "output_len": n, **request_latencies(o.metrics)}
        for i, (r, o, n) in enumerate(zip(requests, outputs, output_lens))
    ]
    timeline = kv_timeline(st.timeline, engine.num_blocks)
    return Measurement(row, [ids for samples in output_ids for ids in samples], per_request, timeline)


def snapshot_columns(engine) -> dict:
    """A hybrid model's prefix caching: tokens between DeltaNet state snapshots, how many it keeps
    and the bytes they take (engine/state_snapshots.py); nothing for other models."""
    executor = getattr(engine, "executor", None)  # none in front of data-parallel replicas
    plan = executor.kv_size.state_snapshots if executor is not None else None
    if plan is None:
        return {"mamba_block_size": np.nan, "state_snapshots": 0, "state_snapshot_bytes": 0}
    per_snapshot = state_bytes_per_sequence(engine.model_config, engine.dtype)
    return {
        "mamba_block_size": plan.interval,
        "state_snapshots": plan.count,
        "state_snapshot_bytes": plan.count * per_snapshot,
    }


def cascade_counts(engine) -> CascadeCounts:
    """The cascade counters of the engine's worker (backends/cascade.py; empty ones in front of replicas)."""
    runner = getattr(getattr(engine, "executor", None), "runner", None)
    tables = getattr(runner, "block_tables", None) or getattr(getattr(runner, "runner", None), "block_tables", None)
    return tables.cascade_counts if tables is not None else CascadeCounts()


def cascade_columns(engine, before: CascadeCounts) -> dict:
    """cascade_attention as the engine resolved it ("auto": the heuristic), how many of the run's steps
    cascaded and the share of the decode rows' KV reads (query rows x keys) its prefix passes served."""
    now = cascade_counts(engine)
    decode = now.decode_kv_tokens - before.decode_kv_tokens
    runner = getattr(getattr(engine, "executor", None), "runner", None)
    resolved = getattr(getattr(runner, "block_tables", None), "cascade", engine.config.cascade_attention)
    return {
        "cascade_attention": "auto" if resolved is None else resolved,  # as resolved: False where the backend has none
        "cascade_steps": now.cascade_steps - before.cascade_steps,
        "cascade_share": (now.shared_kv_tokens - before.shared_kv_tokens) / decode if decode else 0.0,
    }


def linear_kernel_column(engine) -> dict:
    """The gated delta rule's kernel a hybrid model's DeltaNet layers ran (linear_attention_kernel);
    empty for other models."""
    model = getattr(engine, "model_config", None)
    hybrid = model is not None and model.linear is not None
    return {"linear_attention_kernel": engine.config.linear_attention_kernel if hybrid else ""}


def device_columns(device: dict[str, float], step_wall: float) -> dict:
    """Device time of the steps (CUDA events around each step's forward and sampler; launch gaps
    inside count as busy, so the overhead is a lower bound), the share of eager forward time
    spent in attention, and the engine's overhead: the share of step wall time not covered."""
    forward, attention = device.get("forward", 0.0), device.get("attention", 0.0)
    moe = device.get("moe")  # MoE layers' time, for a model that has them
    linear = device.get("linear_attention")  # hybrid models' DeltaNet layers (token mixing beside attention)
    indexer = device.get("indexer")  # DeepSeek-V3.2's selection (scores and top-k), apart from attention
    step = forward + device.get("forward_graph", 0.0) + device.get("sample", 0.0)
    return {
        "time_device_s": step,
        "time_attention_s": attention,
        "attention_share": attention / forward if forward else np.nan,
        "time_moe_s": np.nan if moe is None else moe,
        "moe_share": moe / forward if moe is not None and forward else np.nan,
        "time_linear_attention_s": np.nan if linear is None else linear,
        "linear_attention_share": linear / forward if linear is not None and forward else np.nan,
        "time_indexer_s": np.nan if indexer is None else indexer,
        "indexer_share": indexer / forward if indexer is not None and forward else np.nan,
        "engine_overhead_share": max(0.0, 1 - step / step_wall) if step_wall else np.nan,
    }


def grammar_columns(st, apply_s: float) -> dict:
    """Structured outputs' cost in the run: host time filling token bitmasks, device time applying
    them, their share of the steps' wall time, rows masked, and grammar compile time (outside steps)."""
    step_wall = sum(st.time.values())
    return {
        "time_grammar_fill_s": st.grammar_fill_s,
        "time_grammar_apply_s": apply_s,
        "grammar_share": (st.grammar_fill_s + apply_s) / step_wall if step_wall else np.nan,
        "grammar_rows": st.grammar_rows,
        "time_grammar_compile_s": st.grammar_compile_s,
    }


MAX_KV_POINTS = 500


def kv_timeline(timeline: list[tuple[float, int, int]], num_blocks: int) -> list[dict]:
    """The run's KV use step by step (evenly thinned to MAX_KV_POINTS), time from its first step."""
    if not timeline:
        return []
    keep = sorted(set(np.linspace(0, len(timeline) - 1, min(len(timeline), MAX_KV_POINTS)).round().astype(int)))
    start = timeline[0][0]
    return [
        {
            "num_blocks": num_blocks,
            "step": int(i),
            "time_s": timeline[i][0] - start,
            "used_blocks": timeline[i][1],
            "kv_utilization": timeline[i][1] / num_blocks,
            "wasted_slots": timeline[i][2],
        }
        for i in keep
    ]


def warmup_requests(requests: list[Request], max_tokens: int = 16) -> list[Request]:
    """Every request, all at t=0, generating at most `max_tokens`: the prefill shapes and
    batch sizes of the measured run compile (and caches warm) before timing starts."""
    return [
        Request(
            r.prompt_token_ids,
            dataclasses.replace(r.params, max_tokens=min(max_tokens, r.params.max_tokens or max_tokens)),
            0.0,
        )
        for r in requests
    ]


def run_backend(
    scenario: Scenario,
    model: ResolvedModel,
    requests: list[Request],
    backend: str,
    device,
    dtype,
    repeats: int,
    warmup: bool,
    runs: list[Measurement],
    speculative_config: dict | None = None,
    record: RecordSteps | None = None,
) -> None:
    """`repeats` measurements of one backend on one engine, each appended to `runs` as it finishes
    (a run cut short keeps the ones before it), its row with the engine's max_model_len; `record`:
    the first measured run's steps are recorded (bench/step_record.py)."""
    engine = make_engine(engine_config(scenario, model.config, backend, device, dtype, speculative_config), model=model)
    if speculative_config is not None:
        backend = f"{backend} [{speculation_label(speculative_config)}]"  # what the progress bars say
    try:
        engine.set_timing(True)  # device time from CUDA events read after each run: no sync in the loop
        if scenario.dataset_name is None and scenario.longest_request > engine.max_model_len:
            raise ValueError(
                f"scenario {scenario.name!r}: its longest request needs {scenario.longest_request} tokens, "
                f"more than max_model_len={engine.max_model_len} (the model's limit or the KV budget "
                f"of {engine.num_blocks} blocks x {scenario.engine.block_size}); lower --scale"
            )
        compile_seconds = 0.0
        if warmup:
            engine.reset_counters()
            drive(engine, warmup_requests(requests), desc=f"{backend} warmup")
            compile_seconds = engine.run_counters().model_compile_seconds
        for i in range(repeats):
            recorder = record.attach(engine, backend) if record is not None and i == 0 else None
            m = measure(engine, requests, desc=f"{backend} run {i + 1}/{repeats}")
            if recorder is not None:
                detach_recorder(engine)
                recorder.write(record.path(backend))
            m.row.update(max_model_len=engine.max_model_len, compile=engine.config.compiles(engine.device))
            if i == 0:  # the model's compile time lands in the first run it happened in
                m.row["time_model_compile_s"] += compile_seconds
            runs.append(m)
        launched = decode_launches(engine, max(m.row["peak_running_seqs"] for m in runs), scenario.engine.block_size)
        for m in runs:
            m.row.update(launched)
    finally:
        engine.shutdown()


def decode_launches(engine, batch: int, context: int) -> dict:
    """kernels_per_step / kernels_per_layer: what one decode step of `batch` sequences launches,
    device kernels on CUDA, dispatched operations on CPU (step_profile.py). Profiled after the
    timed runs, on the same engine; NaN where the step cannot be profiled in this process (data,
    pipeline or tensor parallelism: the other ranks' work is elsewhere) or does not fit."""
    empty = {"kernels_per_step": np.nan, "kernels_per_layer": np.nan}
    if not hasattr(engine, "executor") or engine.world_size > 1:
        return empty
    per_seq = -(-(context + 8) // engine.config.block_size)
    batch = max(1, min(batch, engine.num_blocks // per_seq, engine.config.max_num_seqs))
    try:
        profile = profile_decode(engine, batch, context, steps=2, warmup=1)
    except Exception as e:  # a diagnostic column never costs the measured rows
        logger.warning("kernels per step not profiled: %s: %s", type(e).__name__, e)
        return empty
    return {"kernels_per_step": profile.per_step, "kernels_per_layer": profile.per_layer}


def compare(
    scenario: Scenario,
    backends: list[str],
    scale: float,
    device: str | None = None,
    dtype: str | None = None,
    repeats: int = 1,
    warmup: bool = True,
    rows: list | None = None,
    peers: list[str] = (),
    alone_check: int = 0,
    record: RecordSteps | None = None,
) -> Comparison:
    """Every available backend on the identical request set and KV budget, one engine at a time,
    then each peer library (`peers.PEERS`) on the same requests. Serving rows are appended to
    `rows` (a report.CsvLog writes each out) as runs finish. `record`: each backend's first measured
    run's steps are written beside the report (`--record-steps`)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if alone_check < 0:
        raise ValueError(f"--alone-check takes a positive number of requests, got {alone_check}")
    for peer in peers:
        peer_unavailable_reason(peer, scenario)  # an unknown name fails here, before any run
    dev, dt = resolve_device_dtype(device, dtype)
    model = resolve_model_config(scenario.engine.model)  # once: every engine, peer and column below reuses it
    requests = model_requests(scenario, *model, engine_max_model_len(scenario, model.config, dt))
    workload = scenario_columns(scenario, scale, dt, model.config) | expert_columns(model.config, dev, dt)
    env = environment(dev, dt)
    out, measured = Comparison([] if rows is None else rows, [], [], {}, num_requests=len(requests)), {}
    try:
        how = (dev, dt, repeats, warmup, record)
        _compare_backends(scenario, model, backends, requests, how, (env, workload), out, measured)
        _compare_peers(scenario, model, peers, requests, (dev, dt, repeats, warmup), (env, workload), out, measured)
    except (KeyboardInterrupt, RuntimeError) as stop:  # Ctrl-C, or one backend failed: keep what finished
        out.stopped = stop
        _mark_cut(out, [*backends, *peers], repeats, {**env, **workload})
    measured = {key: runs for key, runs in measured.items() if runs}
    _add_cross_backend_columns(out.rows, measured, greedy=scenario.temperature == 0)
    if alone_check and out.stopped is None:  # --alone-check: K requests again, one at a time
        configs = {name: engine_config(scenario, model.config, name, dev, dt, None) for name in backends}
        add_alone_columns(out.rows, measured, configs, model, requests, alone_check, scenario.temperature == 0, drive)
    if model.path is None:  # a preset: the peer's random weights differ
        for row in out.rows:
            if row["backend"] in peers and "identical_token_share" in row:
                row["identical_token_share"] = np.nan
    return out


def _compare_peers(scenario, model, peers, requests, how, columns, out, measured) -> None:
    """Each peer library's runs on the same requests (`how`: device, dtype, repeats, warmup), as
    rows of `out` that start with `columns` (environment, workload); the unavailable ones with their reason."""
    env, workload = columns
    for peer in peers:
        head = {**env, "backend": peer, "provider": peer_provider(peer, model.config), **workload, "speculative": "off"}
        reason = peer_unavailable_reason(peer, scenario)
        if reason:
            out.unavailable[peer] = reason
            out.rows.append({**head, "status": "unavailable", "reason": reason})
            continue
        runs = measured[peer, "off"] = []
        out.running = head, runs
        try:
            run_peer(scenario, model, requests, *how, runs)
        finally:
            for repeat, m in enumerate(runs):
                out.rows.append({**head, "status": "ok", "reason": "", "repeat": repeat, **m.row})
        out.running = None
        gc.collect()


def _mark_cut(out: Comparison, names: list[str], repeats: int, columns: dict) -> None:
    """A "cut" row for the backend (or peer) the stop caught, saying how many of its runs finished
    (their rows are kept), and one for each asked for that never started."""
    stop = out.stopped
    why = "interrupted" if isinstance(stop, KeyboardInterrupt) else "failed"
    if out.running is not None:
        head, runs = out.running
        error = "" if why == "interrupted" else " ".join(f": {type(stop).__name__}: {stop}".split())  # one line
        out.rows.append({**head, "status": "cut", "reason": f"{why} after {len(runs)} of {repeats} runs{error}"})
        why = f"{head['backend']} {why}"
    started = {row["backend"] for row in out.rows}
    for name in dict.fromkeys(names):
        if name not in started:
            out.rows.append({**columns, "backend": name, "status": "cut", "reason": f"not run: {why} before it"})


def expert_columns(model: ModelConfig, device: torch.device, dtype: torch.dtype) -> dict:
    """The model's experts per MoE layer, how many each token uses and what their matmuls run as
    (empty for a dense model)."""
    moe = model.moe
    if moe is None or not any(moe.layers):
        return {"num_experts": np.nan, "experts_per_token": np.nan, "moe_kernel": ""}
    return {
        "num_experts": moe.num_experts,
        "experts_per_token": moe.top_k,
        "moe_kernel": experts_kernel(device.type, dtype),
    }


def scenario_columns(scenario: Scenario, scale: float, dtype: torch.dtype, model: ModelConfig) -> dict:
    """What every row of a scenario's run says about the workload, every engine setting by its
    EngineConfig name among it (the backend, device and dtype are the row's own columns)."""
    config = engine_config(scenario, model, "", None, dtype)
    return {
        "scenario": scenario.label,  # a user's dataset by its kind and file (custom:prompts), else the name
        "scenario_hash": scenario.content_hash(),
        "scale": scale,
        "prompts": scenario.dataset_name or scenario.prompts,
        "dataset_name": scenario.dataset_name or "",
        "dataset_path": scenario.dataset_path or "",
        **setting_columns(config),
        "arrival": scenario.arrival,
        "request_rate": scenario.request_rate,
        "temperature": scenario.temperature,
        "n": scenario.n,
        "structured": scenario.structured_label,
    }


def _compare_backends(
    scenario: Scenario,
    model: ResolvedModel,
    backends: list[str],
    requests,
    how: tuple,
    columns,
    out: Comparison,
    measured: dict,
) -> None:
    """Each backend's runs into `measured` and as rows of `out` that start with `columns`
    (environment, workload), a run's rows as soon as it finishes or is cut; the unavailable ones
    with their reason. `how`: device, dtype, repeats, warmup, and where to record steps (or None)."""
    device, dtype, repeats, warmup, record = how
    env, workload = columns
    cfg = model.config
    num_heads, num_kv_heads = TPShard(0, scenario.engine.tensor_parallel_size).local_heads(cfg)  # per rank
    found = [  # an unknown name fails here, before any run
        resolve(
            name,
            device,
            dtype,
            cfg.head_dim,
            scenario.engine.block_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
        )
        for name in backends
    ]
    for name, cls, provider, reason in found:
        if reason:
            out.unavailable[name] = reason
            head = {**env, "backend": name, "provider": provider, **workload}
            out.rows.append({**head, "status": "unavailable", "reason": reason})
            continue
        for variant, spec in enumerate(speculation_variants(scenario)):
            label = speculation_label(spec)
            head = {**env, "backend": name, "provider": provider, **workload, "speculative": label}
            caveat = cls.timing_caveat(device) or ""  # an interpreted backend: its times are not a kernel's
            linear_caveat = (
                linear_timing_caveat(scenario.engine.linear_attention_kernel, device) if cfg.linear else None
            )
            caveat = "; ".join(filter(None, [caveat, linear_caveat]))  # or interpreted DeltaNet layers (fla on CPU)
            runs = measured[name, label] = []
            out.running = head, runs
            try:
                recording = record if variant == 0 else None  # a backend's first run is recorded
                run_backend(scenario, model, requests, name, device, dtype, repeats, warmup, runs, spec, recording)
            finally:
                _add_run_rows(out, {**head, "status": "ok", "reason": caveat}, runs)
            out.running = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the next engine gets the memory this one held


def _add_run_rows(out: Comparison, head: dict, runs: list[Measurement]) -> None:
    """One backend's finished runs as rows of `out`: the serving row, its requests and KV timeline."""
    for repeat, m in enumerate(runs):
        out.rows.append({**head, "repeat": repeat} | m.row)
        out.request_rows += [{**head, "repeat": repeat, **r} for r in m.requests]
        out.kv_rows += [{**head, "repeat": repeat, **r} for r in m.kv]


def run_peer(
    scenario: Scenario,
    model: ResolvedModel,
    requests: list[Request],
    device,
    dtype,
    repeats: int,
    warmup: bool,
    runs: list[Measurement],
) -> None:
    """`repeats` measurements of the Hugging Face peer on the requests, each appended to `runs` as
    it finishes (throughput only: it reports no per-token times)."""
    peer = hf_peer(scenario, model, device, dtype)
    if warmup:
        peer.drive(warmup_requests(requests))
    for _ in range(repeats):
        duration, outputs = peer.drive(requests)
        row = throughput_summary([len(r.prompt_token_ids) for r in requests], list(map(len, outputs)), duration)
        runs.append(Measurement(row, outputs, [], []))


def _add_cross_backend_columns(
    rows: list[dict], measured: dict[tuple[str, str], list[Measurement]], greedy: bool
) -> None:
    """Each (backend, speculation) run's spread: min, max and the interval of the median output
    throughput (noise.py: 95 % from 6 runs, min-max below; none under 3 runs), and, with two or more, the ranking
    ("best", "tied" where the intervals overlap, else the ratio), throughput relative to the best
    median and, for greedy scenarios, the share of tokens identical to the baseline (reference
    without speculation if run, else the first)."""
    if not measured:
        return
    spreads = {key: spread([m.row["output_throughput"] for m in runs]) for key, runs in measured.items()}
    ranked = rankings(spreads) if len(measured) > 1 else {}
    best = max(s["median"] for s in spreads.values())
    baseline = measured.get(("reference", "off"), next(iter(measured.values())))[0].outputs
    runs = {key: iter(runs) for key, runs in measured.items()}
    for row in rows:
        if row["status"] != "ok":
            continue
        key = row["backend"], row.get("speculative", "off")
        m, s = next(runs[key]), spreads[key]
        row |= {f"output_throughput_{stat}": s[stat] for stat in ("min", "max", "ci_low", "ci_high")}
        if len(measured) < 2:
            continue
        row["ranking"] = ranked[key]
        row["throughput_vs_best"] = s["median"] / best
        row["identical_token_share"] = identical_token_share(m.outputs, baseline) if greedy else np.nan
