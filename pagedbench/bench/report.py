"""Reports: tidy CSVs (the schema lives here), a markdown summary and PNG plots; re-rendered
from CSVs of any number of runs and machines by `pagedbench report`."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from pagedbench.bench.metrics import LATENCIES, STATISTICS  # noqa: E402
from pagedbench.bench.scenario import ENGINE_FIELDS  # noqa: E402
from pagedbench.bench.serve_client import PERCENTILES  # noqa: E402
from pagedbench.engine.stats import TIME_COLUMNS  # noqa: E402

ENVIRONMENT = [
    "kind",
    "command",
    "timestamp",
    "git_sha",
    "torch_version",
    "device",
    "device_name",
    "cpu_threads",
    "load_average",
    "dtype",
    "backend",
    "provider",
    "status",
    "reason",
]
SERVING_COLUMNS = ENVIRONMENT + [
    "scenario",
    "scenario_hash",
    "scale",
    "prompts",
    *[f for f in ENGINE_FIELDS if f != "speculative_config"],
    "speculative",
    "structured",
    "arrival",
    "request_rate",
    "temperature",
    "n",
    "repeat",
    "num_requests",
    "total_input_tokens",
    "total_output_tokens",
    "duration_s",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *[f"{stat}_{name}_ms" for name in LATENCIES for stat in STATISTICS],
    "steps",
    "preemptions",
    "peak_kv_blocks",
    "peak_kv_utilization",
    "peak_running_seqs",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "peak_shared_blocks",
    "block_copies",
    "mean_kv_utilization",
    "mean_wasted_slots",
    "peak_wasted_slots",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "spec_acceptance_rate",
    "spec_mean_acceptance_length",
    "spec_acceptance_per_position",
    *TIME_COLUMNS,
    "time_grammar_fill_s",
    "time_grammar_apply_s",
    "grammar_share",
    "grammar_rows",
    "time_grammar_compile_s",
    "time_device_s",
    "time_attention_s",
    "attention_share",
    "num_experts",
    "experts_per_token",
    "time_moe_s",
    "moe_share",
    "engine_overhead_share",
    "time_backend_compile_s",
    "cuda_graphs",
    "throughput_vs_best",
    "identical_token_share",
]
REQUEST_COLUMNS = [
    "kind",
    "command",
    "device_name",
    "dtype",
    "model",
    "backend",
    "provider",
    "scenario",
    "scenario_hash",
    "scale",
    "repeat",
    "request",
    "input_len",
    "output_len",
    "ttft_ms",
    "tpot_ms",
    "e2el_ms",
]
KV_COLUMNS = REQUEST_COLUMNS[: REQUEST_COLUMNS.index("repeat") + 1] + [
    "num_blocks",
    "step",
    "time_s",
    "used_blocks",
    "kv_utilization",
    "wasted_slots",
]
KERNEL_COLUMNS = ENVIRONMENT + [
    "variant",  # plain, window-1024, softcap-50, sinks (kernels.VARIANTS)
    "phase",
    "query_len",
    "kv_cache_dtype",
    "batch_size",
    "context_len",
    "block_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "num_query_tokens",
    "kv_bytes",
    "flops",
    "warmup",
    "repeats",
    "prepare_min_ms",
    "prepare_median_ms",
    "forward_min_ms",
    "forward_median_ms",
    "bandwidth_gbps",
    "peak_bandwidth_gbps",
    "peak_bandwidth_source",
    "pct_of_peak_bandwidth",
    "copy_bandwidth_gbps",
    "pct_of_copy_bandwidth",
    "vs_dense",
    "tflops",
    "tile_efficiency",
]
CHECK_COLUMNS = ENVIRONMENT + [
    "case",
    "batch",
    "heads",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "block_size",
    "variant",  # plain, or the AttentionVariant the case runs (window, soft-cap, sinks)
    "num_seqs",
    "num_query_tokens",
    "max_abs_error",
    "mean_abs_error",
    "placement_diff",
    "tolerance",
    "top1_agreement",
]
SERVE_LATENCIES = [f"{stat}_{name}_ms" for name in LATENCIES for stat in PERCENTILES]  # bench-serve's
BENCH_SERVE_COLUMNS = [  # one row per (server, request rate) of `pagedbench bench-serve`
    "kind",
    "timestamp",
    "backend",  # --label, or what the server's /v1/models card says, or its URL
    "base_url",
    "model",
    "scenario",
    "scale",
    "num_prompts",
    "request_rate",
    "max_concurrency",
    "slos_ms",
    "completed",
    "failed",
    "duration_s",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *SERVE_LATENCIES,
    "goodput",
]
SCHEMAS = {
    "serving": SERVING_COLUMNS,
    "requests": REQUEST_COLUMNS,
    "kv": KV_COLUMNS,
    "kernels": KERNEL_COLUMNS,
    "check": CHECK_COLUMNS,
    "bench-serve": BENCH_SERVE_COLUMNS,
}


def tidy(rows: list[dict], kind: str, command: str) -> pd.DataFrame:
    """Rows as a frame with exactly the schema's columns (missing ones empty)."""
    frame = pd.DataFrame([{**row, "kind": kind, "command": command} for row in rows]).reindex(columns=SCHEMAS[kind])
    ints = {k for row in rows for k, v in row.items() if isinstance(v, int) and not isinstance(v, bool)}
    return frame.astype({k: "Int64" for k in ints & set(frame)})  # ints stay ints next to empty cells


class CsvLog(list):
    """A list of result rows that also appends each row to `<out_dir>/<stem>.csv` as it arrives,
    so a long command cut short keeps what it measured (`pagedbench report` renders it)."""

    def __init__(self, out_dir: str | Path, stem: str, kind: str, command: str):
        super().__init__()
        self.path, self.kind, self.command = Path(out_dir) / f"{stem}.csv", kind, command
        self.path.unlink(missing_ok=True)

    def append(self, row: dict) -> None:
        super().append(row)
        tidy([row], self.kind, self.command).to_csv(self.path, mode="a", header=not self.path.exists(), index=False)

    def extend(self, rows) -> None:
        for row in rows:
            self.append(row)

    def __iadd__(self, rows):
        self.extend(rows)
        return self


class EnvCsvLog(CsvLog):
    """A CsvLog whose rows get the environment columns `env` (row values win)."""

    def __init__(self, env: dict, *args):
        super().__init__(*args)
        self.env = env

    def append(self, row: dict) -> None:
        super().append({**self.env, **row})


def write_reports(frames: dict[str, pd.DataFrame], out_dir: str | Path, stem: str) -> list[Path]:
    """The first frame as `<stem>.csv`, the others as `<stem>-<kind>.csv`, then markdown and plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (kind, frame) in enumerate(frames.items()):
        paths.append(out / (f"{stem}.csv" if i == 0 else f"{stem}-{kind}.csv"))
        frame.to_csv(paths[-1], index=False)
    return paths + render(pd.concat(frames.values(), ignore_index=True), out, stem)


def load_csvs(paths: list[str]) -> pd.DataFrame:
    """CSVs written by run / compare / kernels (any mix, any machines), with their sibling
    per-request and KV-timeline CSVs (`<stem>-requests.csv`, `<stem>-kv.csv`) when present."""
    files = [Path(p) for p in paths]
    for p in list(files):
        for sibling in (p.with_name(f"{p.stem}-requests.csv"), p.with_name(f"{p.stem}-kv.csv")):
            if sibling.is_file() and sibling not in files:
                files.append(sibling)
    frames = []
    for p in files:
        if not p.is_file():
            raise FileNotFoundError(f"no such CSV: {p}")
        frame = pd.read_csv(p)
        if "kind" not in frame and {"base_url", "request_rate"} <= set(frame):  # bench-serve before its kind column
            frame = frame.assign(kind="bench-serve", backend=frame["base_url"])
        if "kind" not in frame or not set(frame["kind"]) <= set(SCHEMAS):
            raise ValueError(f"{p} is not a pagedbench CSV (no 'kind' column of {', '.join(SCHEMAS)})")
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def render(df: pd.DataFrame, out_dir: Path, stem: str) -> list[Path]:
    """Markdown (`<stem>.md`) and PNGs for whatever kinds of rows `df` holds."""
    kinds = {kind: part.reindex(columns=SCHEMAS[kind]) for kind, part in df.groupby("kind")}
    sections, paths = [f"# pagedbench report: {stem}\n"], []
    for kind in ("serving", "kernels", "check"):
        if kind in kinds:
            sections.append(_environment_section(kinds[kind]))
    if "serving" in kinds:
        serving = kinds["serving"]
        sections.append(_serving_section(serving))
    if "serving" in kinds and (serving["status"] == "ok").any():
        paths.append(plot_throughput(serving, out_dir / f"{stem}-throughput.png"))
        if "requests" in kinds:
            paths.append(plot_latency_cdfs(kinds["requests"], out_dir / f"{stem}-latency-cdf.png"))
        if "kv" in kinds:
            paths.append(plot_kv_timeline(kinds["kv"], out_dir / f"{stem}-kv-utilization.png"))
    if "kernels" in kinds:
        sections.append(_kernel_section(kinds["kernels"]))
    if "kernels" in kinds and (kinds["kernels"]["status"] == "ok").any():
        paths.append(plot_kernel_bandwidth(kinds["kernels"], out_dir / f"{stem}-bandwidth.png"))
    if "check" in kinds:
        sections.append(_check_section(kinds["check"]))
    if "bench-serve" in kinds:
        sections.append(
            "## Online serving (bench-serve)\n\n" + markdown(bench_serve_table(kinds["bench-serve"])) + "\n"
        )
        paths.append(plot_rate_sweep(kinds["bench-serve"], out_dir / f"{stem}-latency-vs-throughput.png"))
    sections += [f"![{p.stem}]({p.name})\n" for p in paths]
    md = out_dir / f"{stem}.md"
    md.write_text("\n".join(sections))
    return [md] + paths


# ---- tables -------------------------------------------------------------------------------


def serving_summary(serving: pd.DataFrame) -> pd.DataFrame:
    """One row per device x scenario x backend that ran: medians over runs, display names."""
    ok = serving[serving["status"] == "ok"]
    keys = ["device_name", "dtype", "model", "scenario", "scale", "backend"]
    optional = (
        "n",
        "enable_prefix_caching",
        "tensor_parallel_size",
        "enforce_eager",
        "speculative",
        "structured",
    )  # older CSVs lack some
    keys += [col for col in optional if col in ok]
    numeric = ok.select_dtypes("number").columns.difference(keys)
    groups = ok.groupby(keys, sort=False, dropna=False)
    med = groups[list(numeric)].median().reset_index()
    med["runs"] = groups.size().values
    # vs best over the rows shown (a merged report compares across the CSVs it read)
    peers = [k for k in keys if k != "backend"]
    med["throughput_vs_best"] = med["output_throughput"] / med.groupby(peers, dropna=False)[
        "output_throughput"
    ].transform("max")
    return pd.DataFrame(
        {
            "backend": med["backend"],
            "device": med["device_name"],
            "dtype": med["dtype"],
            "model": med["model"],
            "scenario": med["scenario"],
            "scale": med["scale"],
            **_parallel(med),
            "runs": med["runs"],
            "requests": med["num_requests"].astype(int),
            "output tok/s": med["output_throughput"].round(1),
            "total tok/s": med["total_token_throughput"].round(1),
            "vs best": med["throughput_vs_best"].round(3),
            "TTFT mean/p99 ms": _pair(med, "ttft"),
            "TPOT mean/p99 ms": _pair(med, "tpot"),
            "ITL mean/p99 ms": _pair(med, "itl"),
            "E2EL mean ms": med["mean_e2el_ms"].round(1),
            "preemptions": med["preemptions"].round().astype("Int64"),  # empty for a peer
            "peak seqs": _column(med, "peak_running_seqs").round().astype("Int64"),
            "peak KV %": (100 * med["peak_kv_utilization"]).round(1),
            **_sharing(med),
            **_kv_storage(med),
            **_speculation(med),
            **_structured(med),
            "prepare %": _prepare_pct(med),
            "attention % of forward": _pct(med, "attention_share"),
            **_moe(med),
            "overhead %": _pct(med, "engine_overhead_share"),
            "identical tokens": med["identical_token_share"].round(4),
        }
    )


def console_table(serving: pd.DataFrame, cross_backend: bool) -> str:
    """The table run/compare print: one row per run, the throughput columns first."""
    ok = serving[serving["status"] == "ok"]
    table = pd.DataFrame(
        {
            "backend": ok["backend"],
            "device": ok["device_name"],
            "dtype": ok["dtype"],
            **_parallel(ok),
            "requests": ok["num_requests"].astype(int),
            "output tokens": ok["total_output_tokens"].astype(int),
            "duration s": ok["duration_s"].round(2),
            "output tok/s": ok["output_throughput"].round(1),
            "total tok/s": ok["total_token_throughput"].round(1),
            "mean TTFT ms": ok["mean_ttft_ms"].round(1),
            "mean TPOT ms": ok["mean_tpot_ms"].round(2),
            "steps": ok["steps"].astype("Int64"),  # empty for a peer: its internals are not ours to count
            "preemptions": ok["preemptions"].astype("Int64"),
            "peak seqs": _column(ok, "peak_running_seqs").astype("Int64"),
            **_sharing(ok),
            **_kv_storage(ok),
            **_speculation(ok),
            **_structured(ok),
            "prepare %": _prepare_pct(ok),
            "attention % of forward": _pct(ok, "attention_share"),
            **_moe(ok),
            "overhead %": _pct(ok, "engine_overhead_share"),
            **_graphs(ok),
        }
    )
    if cross_backend:
        table["vs best"] = ok["throughput_vs_best"].round(3)
        table["identical tokens"] = ok["identical_token_share"].round(4)
    return "\n".join([markdown(table), *not_run_lines(serving)])


def markdown(df: pd.DataFrame) -> str:
    """A markdown table with empty cells, not "nan", where a value is missing."""
    return df.astype(object).where(df.notna(), "").to_markdown(index=False)


def not_run_lines(df: pd.DataFrame) -> list[str]:
    """What the table does not say: backends that did not run and why, and timings with a caveat
    (an ok row with a reason: an interpreted backend)."""
    bad = df.loc[df["status"] != "ok", ["backend", "status", "reason"]].drop_duplicates()
    lines = [f"{backend}: {status}: {reason}" for backend, status, reason in bad.values]
    caveats = df.loc[(df["status"] == "ok") & (df["reason"].fillna("") != ""), ["backend", "reason"]].drop_duplicates()
    return lines + [f"{backend}: caveat: {reason}" for backend, reason in caveats.values]


def _parallel(df: pd.DataFrame) -> dict[str, pd.Series]:
    """Tensor-parallel size and each rank's KV budget, where some run was sharded."""
    if "tensor_parallel_size" not in df or not (df["tensor_parallel_size"].fillna(1) > 1).any():
        return {}
    return {"TP": df["tensor_parallel_size"].fillna(1).astype(int), "KV blocks/rank": df["num_blocks"].astype("Int64")}


def _sharing(df: pd.DataFrame) -> dict[str, pd.Series]:
    """Shared KV pages: prefix caching on/off, its hit rate (% of prompt tokens found cached),
    peak KV blocks in use and peak blocks read by several sequences (cached prefixes, forks)."""
    if "prefix_cache_queries" not in df:  # an older CSV
        return {}
    caching = df["enable_prefix_caching"].map({True: "on", False: "off"}) if "enable_prefix_caching" in df else None
    hit_pct = 100 * df["prefix_cache_hits"] / df["prefix_cache_queries"].where(df["prefix_cache_queries"] > 0)
    columns = {"prefix caching": caching, "cache hit %": hit_pct.round(1)}
    columns |= {
        "peak KV blocks": df["peak_kv_blocks"].round().astype("Int64"),
        "shared blocks": df["peak_shared_blocks"].round().astype("Int64"),
    }
    return {name: col for name, col in columns.items() if col is not None}


def _speculation(df: pd.DataFrame) -> dict[str, pd.Series]:
    """Speculative decoding, where some run had it: its setting, the share of proposed tokens
    accepted and the tokens emitted per verifying step (vLLM's mean acceptance length)."""
    if "speculative" not in df or not (_spec_labels(df) != "off").any():
        return {}
    return {
        "speculative": _spec_labels(df),
        "accepted %": (100 * df["spec_acceptance_rate"]).round(1),
        "mean accepted length": df["spec_mean_acceptance_length"].round(2),
    }


def _moe(df: pd.DataFrame) -> dict[str, pd.Series]:
    """MoE layers' share of the forward, for runs of a model that has them."""
    share = _column(df, "moe_share")
    if not share.notna().any():
        return {}
    experts = (
        _column(df, "num_experts").astype("Int64").astype(str)
        + " top "
        + _column(df, "experts_per_token").astype("Int64").astype(str)
    )
    return {"experts": experts, "MoE % of forward": (100 * share).round(1)}


def _structured(df: pd.DataFrame) -> dict[str, pd.Series]:
    """Structured outputs, where some run had them: the constraint, and the grammar masks' cost per
    step (bitmask fill on the host + apply on the device) and as a share of step wall time."""
    if "structured" not in df:
        return {}
    label = df["structured"].astype(object).fillna("off").astype(str)
    if not (label != "off").any():
        return {}
    mask_s = _column(df, "time_grammar_fill_s") + _column(df, "time_grammar_apply_s")
    return {
        "structured": label,
        "mask ms/step": (1e3 * mask_s / _column(df, "steps")).round(2),
        "mask % of step": (100 * _column(df, "grammar_share")).round(1),
    }


def _kv_storage(df: pd.DataFrame) -> dict[str, pd.Series]:
    """How K/V pages were stored, where some run quantized them (kv_cache_dtype)."""
    if "kv_cache_dtype" not in df:
        return {}
    kv = df["kv_cache_dtype"].astype(object).fillna("auto").astype(str)
    return {"KV pages": kv} if (kv != "auto").any() else {}


def _spec_labels(df: pd.DataFrame) -> pd.Series:
    """The speculative setting of each row ("off" where none, or in a CSV from before it)."""
    return df["speculative"].astype(object).fillna("off").astype(str)


def _graphs(df: pd.DataFrame) -> dict[str, pd.Series]:
    """CUDA graphs on/off, where some run had them (the CSV's cuda_graphs column says why not)."""
    if "cuda_graphs" not in df or not df["cuda_graphs"].astype(str).str.startswith("on").any():
        return {}
    return {"CUDA graphs": df["cuda_graphs"].astype(str).str.split(":").str[0]}


def _pct(df: pd.DataFrame, share: str) -> pd.Series:
    return (100 * _column(df, share)).round(1)


def _prepare_pct(df: pd.DataFrame) -> pd.Series:
    """backend.prepare()'s share of the engine step time, in %."""
    return (100 * df["time_backend_prepare_s"] / df[TIME_COLUMNS].sum(axis=1).replace(0, np.nan)).round(2)


def _pair(df: pd.DataFrame, name: str) -> pd.Series:
    return df[f"mean_{name}_ms"].round(2).astype(str) + " / " + df[f"p99_{name}_ms"].round(2).astype(str)


def _environment_section(df: pd.DataFrame) -> str:
    cols = ["device_name", "cpu_threads", "load_average", "torch_version", "git_sha", "dtype", "backend", "provider"]
    env = df[cols].drop_duplicates().copy()
    env["git_sha"] = env["git_sha"].astype(str).str.replace(r"^(\w{12})\w*", r"\1", regex=True)
    return f"## Environment ({df['kind'].iloc[0]})\n\n{markdown(env)}\n"


def _serving_section(serving: pd.DataFrame) -> str:
    parts = ["## Serving\n"]
    scen = serving[
        [
            "scenario",
            "scenario_hash",
            "scale",
            "model",
            "num_blocks",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "arrival",
            "request_rate",
        ]
    ].drop_duplicates(["scenario", "scenario_hash"])
    scen = scen.assign(scenario_hash=scen["scenario_hash"].astype(str).str.slice(0, 12))
    parts.append(markdown(scen) + "\n")
    if (serving["status"] == "ok").any():
        parts.append(markdown(serving_summary(serving)) + "\n")
        ok = serving[serving["status"] == "ok"]
        keys = ["device_name", "scenario", "scale", "model", "backend"]  # never pooled across workloads
        split = ok.groupby(keys, sort=False, dropna=False)[TIME_COLUMNS].sum()
        split = (100 * split.div(split.sum(axis=1), axis=0)).round(1)
        split.columns = [c.removeprefix("time_").removesuffix("_s") + " %" for c in split.columns]
        parts.append("Share of engine step time:\n\n" + markdown(split.reset_index()) + "\n")
    parts += _unavailable_lines(serving)
    return "\n".join(parts)


def _column(df: pd.DataFrame, name: str) -> pd.Series:
    """A numeric column, or NaN where the CSV predates it."""
    return pd.to_numeric(df[name], errors="coerce") if name in df else pd.Series(float("nan"), index=df.index)


def kernel_table(kernels: pd.DataFrame) -> pd.DataFrame:
    ok = kernels[kernels["status"] == "ok"]
    return pd.DataFrame(
        {
            "backend": ok["backend"],
            "device": ok["device_name"],
            "variant": ok["variant"] if "variant" in ok else "plain",  # CSVs before variants are plain
            "phase": ok["phase"],
            "query len": _column(ok, "query_len").fillna(1).astype("Int64"),  # CSVs before it: 1
            "KV pages": ok["kv_cache_dtype"].astype(object).fillna("auto") if "kv_cache_dtype" in ok else "auto",
            "batch": ok["batch_size"],
            "context": ok["context_len"],
            "block": ok["block_size"],
            "heads": ok["num_heads"].astype("Int64").astype(str) + "/" + ok["num_kv_heads"].astype("Int64").astype(str),
            "head_dim": ok["head_dim"],
            "prepare ms": ok["prepare_median_ms"].round(3),
            "forward ms (median)": ok["forward_median_ms"].round(3),
            "forward ms (min)": ok["forward_min_ms"].round(3),
            "GB/s": ok["bandwidth_gbps"].round(1),
            "% peak": ok["pct_of_peak_bandwidth"].round(1),
            "% copy": _column(ok, "pct_of_copy_bandwidth").round(1),
            "x dense": _column(ok, "vs_dense").round(2),
            "TFLOP/s": ok["tflops"].round(3),
            "tile eff.": _column(ok, "tile_efficiency").round(3),
        }
    )


def bench_serve_table(df: pd.DataFrame) -> pd.DataFrame:
    """bench-serve rows as printed: server, rate, throughput, goodput and latency statistics."""
    columns = ["backend", "request_rate", "completed", "failed", "request_throughput", "output_throughput", "goodput"]
    return df[columns + SERVE_LATENCIES].round(2)


def _kernel_section(kernels: pd.DataFrame) -> str:
    peaks = (
        kernels[["device_name", "peak_bandwidth_gbps", "peak_bandwidth_source"]].dropna().drop_duplicates("device_name")
    )
    parts = [
        "## Attention kernels\n",
        "Peak bandwidth used for % peak:\n\n" + markdown(peaks) + "\n",
        markdown(kernel_table(kernels)) + "\n",
    ]
    return "\n".join(parts + _unavailable_lines(kernels))


def _check_section(check: pd.DataFrame) -> str:
    from pagedbench.bench.check import TOLERANCE_FACTOR, TOLERANCE_FLOOR, summary
    from pagedbench.device.dtypes import dtype_name

    floors = ", ".join(f"{dtype_name(d)} {f:g}" for d, f in TOLERANCE_FLOOR.items())
    table = check[
        ["backend", "case", "status", "max_abs_error", "mean_abs_error", "placement_diff", "tolerance", "reason"]
    ]
    return (
        f"## Correctness check\n\nEach backend against a dense per-sequence oracle (fp64 on CPU, fp32 on GPU). "
        f"Tolerance = {TOLERANCE_FACTOR:g} x the error of the naive computation in the case's dtype + a floor "
        f"({floors}); placement_diff is the change in output when the same problem sits on another random page "
        f"layout, held to the same tolerance.\n\n{summary(check.to_dict('records'))}\n\n{markdown(table)}\n"
    )


def _unavailable_lines(df: pd.DataFrame) -> list[str]:
    bad = df[df["status"] != "ok"][["device_name", "backend", "status", "reason"]].drop_duplicates()
    return ["Not run:\n\n" + markdown(bad) + "\n"] if len(bad) else []


# ---- plots --------------------------------------------------------------------------------


GROUP_KEYS = ["scenario", "scale", "model", "device_name", "dtype"]  # runs compared only within one of each


def _labels(df: pd.DataFrame) -> pd.Series:
    """backend, plus whichever of scenario, scale, model, device and dtype vary among the rows."""
    label = df["backend"].astype(str)
    for col in GROUP_KEYS:
        if col in df and df[col].nunique(dropna=False) > 1:
            label = label + " · " + (f"{col} " if col == "scale" else "") + df[col].astype(str)
    if "enable_prefix_caching" in df and df["enable_prefix_caching"].nunique() > 1:
        label = label + df["enable_prefix_caching"].map({True: "", False: " · no prefix caching"})
    if "tensor_parallel_size" in df and df["tensor_parallel_size"].nunique(dropna=False) > 1:
        label = label + " · tp " + df["tensor_parallel_size"].fillna(1).astype(int).astype(str)
    if "enforce_eager" in df and df["enforce_eager"].nunique() > 1:
        label = label + df["enforce_eager"].map({True: " · eager", False: ""})
    if "kv_cache_dtype" in df and df["kv_cache_dtype"].astype(object).fillna("auto").nunique() > 1:
        label = label + " · KV " + df["kv_cache_dtype"].astype(object).fillna("auto").astype(str)
    if "speculative" in df and _spec_labels(df).nunique() > 1:
        label = label + " · spec " + _spec_labels(df)
    return label


def _title(what: str, df: pd.DataFrame) -> str:
    """`what`, then the settings every row shares (scenario, scale, model, device, dtype)."""
    shared = [
        f"{'scale ' if col == 'scale' else ''}{df[col].iloc[0]}"
        for col in GROUP_KEYS
        if col in df and len(df) and df[col].nunique(dropna=False) == 1
    ]
    return what + (f"\n{', '.join(shared)}" if shared else "")


def plot_throughput(serving: pd.DataFrame, path: Path) -> Path:
    ok = serving[serving["status"] == "ok"]
    medians = ok.groupby(_labels(ok), sort=False)["output_throughput"].median()
    fig, ax = plt.subplots(figsize=(7, 1.5 + 0.4 * len(medians)))
    ax.barh(medians.index[::-1], medians.values[::-1], color="tab:blue")
    for y, value in enumerate(medians.values[::-1]):
        ax.text(value, y, f" {value:.0f}", va="center")
    ax.set_xlim(0, 1.15 * max(medians.max(), 1))  # room for the value beside the longest bar
    ax.set_xlabel("output tokens/s (median over runs)")
    ax.set_title(_title("Output throughput by backend", ok), fontsize="medium")
    return _save(fig, path)


def plot_latency_cdfs(requests: pd.DataFrame, path: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for label, group in requests.groupby(_labels(requests), sort=False):
        for ax, col in zip(axes, ("ttft_ms", "tpot_ms", "e2el_ms")):
            values = np.sort(group[col].dropna().to_numpy())
            ax.plot(values, np.arange(1, len(values) + 1) / max(len(values), 1), drawstyle="steps-post", label=label)
    for ax, name in zip(axes, ("TTFT", "TPOT", "E2E latency")):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle(_title("Latency CDFs per request", requests), fontsize="medium")
    return _save(fig, path)


def plot_kv_timeline(kv: pd.DataFrame, path: Path) -> Path:
    """KV utilization and empty last-page slots over each run's time (the first run per label)."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    first = kv[kv["repeat"] == kv["repeat"].min()]
    for label, group in first.groupby(_labels(first), sort=False):
        axes[0].plot(group["time_s"], 100 * group["kv_utilization"], label=label)
        axes[1].plot(group["time_s"], group["wasted_slots"], label=label)
    for ax, name in zip(axes, ("KV blocks in use (%)", "empty slots in last pages")):
        ax.set_xlabel("seconds into the run")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle(_title("KV cache over time", first), fontsize="medium")
    return _save(fig, path)


def plot_rate_sweep(df: pd.DataFrame, path: Path) -> Path:
    """bench-serve: median and p99 TTFT and TPOT against output throughput, one point per
    request rate, one line per backend (server)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for backend, group in df.groupby("backend", sort=False, dropna=False):
        group = group.sort_values("output_throughput")
        for ax, metric in zip(axes, ("ttft", "tpot")):
            for stat, style in (("median", "-o"), ("p99", "--x")):
                ax.plot(group["output_throughput"], group[f"{stat}_{metric}_ms"], style, label=f"{backend} {stat}")
    for ax, name in zip(axes, ("TTFT", "TPOT")):
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    rates = ", ".join(dict.fromkeys(str(r) for r in df["request_rate"]))
    fig.suptitle(f"Latency against throughput, request rates {rates}/s ({df['scenario'].iloc[0]})", fontsize="medium")
    return _save(fig, path)


def plot_kernel_bandwidth(kernels: pd.DataFrame, path: Path) -> Path:
    """Achieved KV bandwidth vs context length per phase, at each phase's largest batch."""
    ok = kernels[kernels["status"] == "ok"]
    phases = list(dict.fromkeys(ok["phase"]))
    fig, axes = plt.subplots(1, max(len(phases), 1), figsize=(4.5 * max(len(phases), 1), 3.8), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        rows = ok[ok["phase"] == phase]
        rows = rows[rows["batch_size"] == rows["batch_size"].max()]
        label = (
            _labels(rows)
            + " bs"
            + rows["block_size"].astype("Int64").astype(str)
            + " h"
            + rows["num_heads"].astype("Int64").astype(str)
            + "/"
            + rows["num_kv_heads"].astype("Int64").astype(str)
        )
        for name, group in rows.groupby(label, sort=False):
            group = group.sort_values("context_len")
            ax.plot(group["context_len"], group["bandwidth_gbps"], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{phase} (batch {int(rows['batch_size'].max())})")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("KV bytes read / time (GB/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.suptitle("Attention kernel bandwidth")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # nothing drawn outside the axes is cut
    plt.close(fig)
    return path
