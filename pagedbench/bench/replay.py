"""`pagedbench kernels --replay <steps.jsonl>`: a run's recorded steps (bench/step_record.py)
rebuilt exactly -- the same page ids in a cache of the same number of pages, the same lengths, the
CUDA-graph padding where the engine had it -- and each backend's plan() and forward() timed on
them, per kind of layer (in a CUDA graph where the engine replayed one, on CUDA), so backends are
ranked at the shapes a workload really served. Beside the engine's own attention time for the same
steps (recorded with them) the ratio says how far the isolated timing carries into the engine."""

import dataclasses
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import torch

from pagedbench.backends.base import AttentionMetadata, AttentionVariant
from pagedbench.backends.registry import resolve
from pagedbench.bench.environment import environment
from pagedbench.bench.kernels import _graphed, kv_bytes_per_slot, quantized_pages, visible_kv_tokens
from pagedbench.bench.problems import AttentionBatch
from pagedbench.bench.step_record import RecordedStep, read_recording
from pagedbench.bench.timing import copy_bandwidth, time_call, time_cold, time_kernel
from pagedbench.device.dtypes import resolve_device_dtype
from pagedbench.engine.sequence import Sequence
from pagedbench.sample.sampling_params import SamplingParams
from pagedbench.worker.cuda_graphs import pad_decode_batch
from pagedbench.worker.step_batch import StepBatch, step_batch

VARIANT_FIELDS = [f.name for f in dataclasses.fields(AttentionVariant)]


@dataclasses.dataclass(slots=True)
class ReplayOptions:
    warmup: int = 1
    repeats: int = 3
    device: str | None = None  # default: the recording's device where it exists here, else this one's
    dtype: str | None = None  # default: the recording's
    # Caches cold before each forward, as a layer finds them in the engine after the rest of the model
    # (CUDA: L2 flushed, as kernels' time_kernel always does; CPU: the last-level cache overwritten).
    cold: bool = True


def replay_batch(header: dict, step: RecordedStep) -> StepBatch:
    """The step's host arrays as the engine's model runner laid them out (step_batch over sequences
    of the recorded lengths and pages), padded to its CUDA-graph bucket where it replayed one."""
    seqs = []
    for i, (q, ctx, pages) in enumerate(zip(step.query_lens, step.context_lens, step.pages)):
        seq = Sequence(str(i), None, [0] * (ctx + q), SamplingParams())
        seq.num_computed_tokens, seq.block_table = ctx, pages.tolist()
        seqs.append(seq)
    batch = step_batch(seqs, step.query_lens, header["block_size"], header["num_cache_blocks"])
    if step.graph is not None:
        batch = pad_decode_batch(batch, step.graph, header["graph_width"], header["pad_block"])
    return batch


def replay_metadata(header: dict, step: RecordedStep, device: torch.device) -> AttentionMetadata:
    """The step's AttentionMetadata on `device` (a graph's: the longest sequence it was captured for)."""
    meta = replay_batch(header, step).to(device).metadata
    if step.graph is not None:
        meta = dataclasses.replace(meta, max_seq_len=header["graph_max_seq_len"])
    return meta


@dataclasses.dataclass(slots=True)
class LayerKind:
    """One kind of layer of the recording: its shape, variant, a random cache and queries."""

    spec: dict
    variant: AttentionVariant
    pages: tuple  # (K pages, V pages, scales or None) as stored
    q: torch.Tensor  # [max tokens, H, D]
    sinks: dict

    @classmethod
    def build(cls, spec: dict, header: dict, max_tokens: int, device, dtype) -> "LayerKind":
        variant = AttentionVariant(**{name: spec[name] for name in VARIANT_FIELDS})
        gen = torch.Generator().manual_seed(0)
        shape = (header["num_cache_blocks"], header["block_size"], spec["num_kv_heads"], spec["head_dim"])
        k = torch.randn(shape, generator=gen).to(device, dtype)
        v = k[..., : variant.value_dim] if variant.value_dim is not None else torch.randn(shape, generator=gen)
        batch = AttentionBatch(None, k, v.to(device, dtype), None)
        q = torch.randn(max_tokens, spec["num_heads"], spec["head_dim"], generator=gen).to(device, dtype)
        sinks = {"sinks": torch.randn(spec["num_heads"], generator=gen).to(device)} if variant.sinks else {}
        return cls(spec, variant, quantized_pages(batch, header["kv_cache_dtype"]), q, sinks)

    def kv_bytes(self, step: RecordedStep, header: dict, dtype: torch.dtype) -> float:
        """Bytes of K/V one layer's forward must read at this step (the keys its queries see, as stored)."""
        spec = [(c, q) for c, q in zip(step.context_lens, step.query_lens)]
        planes = 1 if self.variant.value_dim is not None else 2
        per_slot = self.spec["num_kv_heads"] * self.spec["head_dim"] * dtype.itemsize
        per_slot *= kv_bytes_per_slot(header["kv_cache_dtype"], dtype, SimpleNamespace(head_dim=self.spec["head_dim"]))
        return planes * visible_kv_tokens(spec, self.variant.sliding_window) * per_slot


def time_kind(backend, kind: LayerKind, meta: AttentionMetadata, graphed: bool, options: ReplayOptions, device):
    """(plan seconds, forward seconds, tile efficiency) of one layer of `kind` at one step."""
    k, v, scales = kind.pages
    extra = {**kind.sinks, **({} if scales is None else {"kv_scales": scales})}
    q = kind.q[: meta.num_tokens]

    def forward(state):
        return backend.forward(q, k, v, state, **extra)

    state = backend.plan(meta)
    forward(state)  # a JIT-compiling first call is never timed
    plan = time_call(lambda: backend.plan(meta), device, options.warmup, options.repeats)
    state = backend.plan(meta)
    timed = lambda: forward(state)
    if graphed:
        timed, _ = _graphed(forward, state, backend)
    times = (time_cold if options.cold else time_kernel)(timed, device, options.warmup, options.repeats)
    efficiency = getattr(backend, "tile_efficiency", None)
    return plan, times, efficiency(state) if efficiency else float("nan")


def replay_backend(name: str, header: dict, steps, kinds: list[LayerKind], options, device, dtype) -> dict:
    """One backend over every recorded step: a row per step (and its unavailable reason, if any)."""
    built = []
    for kind in kinds:
        found = resolve(
            name, device, dtype, kind.spec["head_dim"], header["block_size"], num_heads=kind.spec["num_heads"],
            num_kv_heads=kind.spec["num_kv_heads"], kv_cache_dtype=header["kv_cache_dtype"], **kind.variant.settings(),
        )  # fmt: skip
        if found.reason:
            return {"provider": found.provider, "reason": found.reason, "steps": []}
        args = (kind.spec["num_heads"], kind.spec["num_kv_heads"], kind.spec["head_dim"], kind.spec["scale"])
        extra = {} if kind.variant == AttentionVariant() else {"variant": kind.variant}
        built.append(found.cls(*args, header["block_size"], device, dtype, **extra))
    rows, start = [], time.perf_counter()
    for step in steps:
        meta = replay_metadata(header, step, device)
        graphed = step.graph is not None and device.type == "cuda"
        row = {"step": step.index, "num_seqs": len(step.query_lens), "num_query_tokens": sum(step.query_lens),
               "graph": step.graph, "engine_attention_ms": step.attention_ms, "plan_ms": 0.0,
               "replay_attention_ms": 0.0, "replay_attention_min_ms": 0.0, "kv_bytes": 0.0}  # fmt: skip
        efficiencies = []
        for backend, kind in zip(built, kinds):
            plan, forward, efficiency = time_kind(backend, kind, meta, graphed, options, device)
            layers = kind.spec["layers"]
            row["plan_ms"] += 1e3 * statistics.median(plan)
            row["replay_attention_ms"] += 1e3 * layers * statistics.median(forward)
            row["replay_attention_min_ms"] += 1e3 * layers * min(forward)
            row["kv_bytes"] += layers * kind.kv_bytes(step, header, dtype)
            efficiencies.append(efficiency)
        row["tile_efficiency"] = float(np.nanmean(efficiencies)) if not np.isnan(efficiencies).all() else np.nan
        rows.append(row)
    return {"provider": found.provider, "reason": built[0].timing_caveat(device) or "", "steps": rows,
            "seconds": time.perf_counter() - start}  # fmt: skip


def run_replay(paths: list[str], backends: list[str], options: ReplayOptions) -> tuple[list[dict], list[dict]]:
    """(a summary row per recording x backend, a row per recording x backend x step)."""
    summary, per_step = [], []
    for path in paths:
        header, steps = read_recording(path)
        if not steps:
            raise ValueError(f"{path} holds no steps")
        if any(kind["topk"] is not None for kind in header["layer_kinds"]):
            raise ValueError(f"{path}: sparse attention (DSA) is not replayed: its selections are not recorded")
        device, dtype = replay_device(header, options)
        columns = {**environment(device, dtype), "copy_bandwidth_gbps": copy_bandwidth(device)}
        max_tokens = max(max(sum(s.query_lens), s.graph or 0) for s in steps)
        kinds = [LayerKind.build(spec, header, max_tokens, device, dtype) for spec in header["layer_kinds"]]
        run_ms = run_report_attention_ms(Path(path), header)
        for name in backends:
            result = replay_backend(name, header, steps, kinds, options, device, dtype)
            head = {**columns, "recording": Path(path).name, "recorded_backend": header["backend"],
                    "model": header["model"], "backend": name, "provider": result["provider"]}  # fmt: skip
            per_step += [{**head, **row} for row in result["steps"]]
            same = name == header["backend"]  # the engine's times are the recorded backend's
            summary.append({**head, **summarize(result, header, columns, same, run_ms)})
    return summary, per_step


def replay_device(header: dict, options: ReplayOptions) -> tuple[torch.device, torch.dtype]:
    recorded = torch.device(header["device"])
    here = recorded.type == "cpu" or recorded.type == "cuda" and torch.cuda.is_available()
    device = options.device or (header["device"] if here else None)
    return resolve_device_dtype(device, options.dtype or header["dtype"])


def run_report_attention_ms(path: Path, header: dict) -> float | None:
    """The engine's attention ms per step over its whole run, from the run report beside the recording
    (its first run of the recorded backend: time_attention_s / steps; graph steps count no attention)."""
    report = path.parent / header.get("report", "")
    if not header.get("report") or not report.is_file():
        return None
    rows = pd.read_csv(report)
    rows = rows[(rows["backend"] == header["backend"]) & (rows["status"] == "ok")]
    if rows.empty or not rows["steps"].iloc[0]:
        return None
    return 1e3 * float(rows["time_attention_s"].iloc[0]) / float(rows["steps"].iloc[0])


def summarize(result: dict, header: dict, columns: dict, same: bool, run_ms: float | None) -> dict:
    """A backend's replay over the steps: means per step and, for the recorded backend (`same`), the
    engine's beside it on the steps it timed and over its whole run (`run_ms`, from its report)."""
    layers = sum(kind["layers"] for kind in header["layer_kinds"])
    base = {"status": "unavailable" if not result["steps"] else "ok", "reason": result["reason"], "layers": layers,
            "steps_seen": header.get("steps_seen"), "steps": len(result["steps"])}  # fmt: skip
    if not result["steps"]:
        return base
    steps = pd.DataFrame(result["steps"])
    replay = steps["replay_attention_ms"]
    timed = steps.dropna(subset=["engine_attention_ms"])
    engine_ms = timed["engine_attention_ms"].mean() if len(timed) else np.nan
    bandwidth = steps["kv_bytes"].sum() / (replay.sum() / 1e3) / 1e9
    return {
        **base,
        "graphed_steps": int(steps["graph"].notna().sum()),
        "plan_ms_per_step": steps["plan_ms"].mean(),
        "replay_layer_ms_per_step": replay.mean() / layers,
        "replay_attention_ms_per_step": replay.mean(),
        "replay_attention_min_ms_per_step": steps["replay_attention_min_ms"].mean(),
        "engine_attention_ms_per_step": engine_ms if same else np.nan,
        "engine_over_replay": timed["engine_attention_ms"].sum() / timed["replay_attention_ms"].sum()
        if len(timed) and same
        else np.nan,
        "run_attention_ms_per_step": run_ms if same and run_ms is not None else np.nan,
        "bandwidth_gbps": bandwidth,
        "pct_of_copy_bandwidth": 100 * bandwidth / columns["copy_bandwidth_gbps"],
        "tile_efficiency": steps["tile_efficiency"].mean(),
        "replay_seconds": result["seconds"],
    }


TABLE_COLUMNS = [
    "recording",
    "backend",
    "steps",
    "plan_ms_per_step",
    "replay_layer_ms_per_step",
    "replay_attention_ms_per_step",
    "engine_attention_ms_per_step",
    "engine_over_replay",
    "run_attention_ms_per_step",
    "pct_of_copy_bandwidth",
    "tile_efficiency",
    "replay_seconds",
]


def replay_table(summary: pd.DataFrame) -> pd.DataFrame:
    """The markdown table's rows: the backends that ran, fastest first within each recording."""
    ok = summary[summary["status"] == "ok"].sort_values(["recording", "replay_attention_ms_per_step"])
    return ok.reindex(columns=TABLE_COLUMNS).round(4)


def write_replay_reports(summary: list[dict], per_step: list[dict], out_dir: str | Path, stem: str) -> list[Path]:
    """`<stem>.csv` (a row per recording x backend), `<stem>-steps.csv` (per step), `<stem>.md`, `<stem>.png`."""
    from pagedbench.bench.report_plots import plot_replay
    from pagedbench.bench.report_tables import markdown

    out = Path(out_dir)
    frame = pd.DataFrame([{"kind": "replay", "command": "kernels", **row} for row in summary])
    paths = [out / f"{stem}.csv", out / f"{stem}-steps.csv", out / f"{stem}.md"]
    frame.to_csv(paths[0], index=False)
    pd.DataFrame(per_step).to_csv(paths[1], index=False)
    lines = [f"# pagedbench kernels --replay: {stem}\n", markdown(replay_table(frame)), ""]
    lines += [f"- {r.backend}: {r.status}: {r.reason}" for r in frame.itertuples() if r.status != "ok" or r.reason]
    if (frame["status"] == "ok").any():
        paths.append(plot_replay(frame[frame["status"] == "ok"], out / f"{stem}.png"))
        lines.append(f"\n![{stem}]({paths[-1].name})")
    paths[2].write_text("\n".join(lines) + "\n")
    return paths
