"""The reports' tables: the serving summary, the console table, kernel and check sections, and the
markdown they are written in."""

import textwrap

import numpy as np
import pandas as pd

from pagedbench.bench.noise import (
    LEVEL,
    MIN_RUNS_FOR_INTERVAL,
    NO_INTERVAL,
    RUNS_FOR_LEVEL,
    interval_text,
    median_interval_level,
    rankings,
    spread,
)
from pagedbench.bench.report_schema import REPRO, SERVE_LATENCIES
from pagedbench.engine.stats import TIME_COLUMNS

VERSION_COLUMNS = ["triton_version", "flash_attn_version", "flashinfer_version", "cuda_version", "driver_version"]
# Summary keys that say how a backend ran, not what it computed: rows differing only in them are ranked together.
HOW_IT_RAN = ("enforce_eager", "compile", "speculative", "moe_kernel")


def serving_summary(serving: pd.DataFrame) -> pd.DataFrame:
    """One row per device x scenario x backend that ran: medians over runs, display names."""
    ok = serving[serving["status"] == "ok"]
    keys = ["device_name", "dtype", "model", "scenario", "scale", "backend"]
    optional = (
        "n",
        "enable_prefix_caching",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "enforce_eager",
        "compile",
        "speculative",
        "structured",
        "moe_kernel",
    )  # older CSVs lack some
    keys += [col for col in optional if col in ok]
    numeric = ok.select_dtypes("number").columns.difference(keys)
    groups = ok.groupby(keys, sort=False, dropna=False)
    med = groups[list(numeric)].median().copy().reset_index().copy()  # consolidated: the columns below add blocks
    med["runs"] = groups.size().values
    for text in ("replica_requests", "cuda_graphs"):  # a run's words, the same in every run of a group
        if text in ok:
            med[text] = groups[text].first().values
    # vs best over the rows shown (a merged report compares across the CSVs it read): rows of one
    # workload are compared however each ran (compiled, eager, speculating, a peer library), as compare ranks them
    peers = [k for k in keys if k != "backend" and k not in HOW_IT_RAN]
    med["throughput_vs_best"] = med["output_throughput"] / med.groupby(peers, dropna=False)[
        "output_throughput"
    ].transform("max")
    # Each group's spread over its runs (noise.py), ranked among the rows it is compared with.
    spreads = [spread(g["output_throughput"]) for _, g in groups]
    med["ci"] = [interval_text(sp["ci_low"], sp["ci_high"], level=sp["level"]) for sp in spreads]
    med["range"] = [interval_text(sp["min"], sp["max"]) for sp in spreads]
    med["rank"] = ""
    for _, idx in med.groupby(peers, dropna=False, sort=False).groups.items():
        if len(idx) > 1:
            for i, label in rankings({i: spreads[i] for i in idx}).items():
                med.loc[i, "rank"] = label
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
            "output tokens": med["total_output_tokens"].round().astype("Int64"),  # (the median run's)
            "output tok/s": med["output_throughput"].round(1),
            "95% CI": med["ci"],
            "min–max": med["range"],
            "rank": med["rank"],
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
            "plan %": _plan_pct(med),
            "attention % of forward": _pct(med, "attention_share"),
            **_moe(med),
            **_linear(med),
            **_indexer(med),
            "overhead %": _pct(med, "engine_overhead_share"),
            **_launches(med),
            **_graphs(med),
            "identical tokens": med["identical_token_share"].round(4),
        }
    )


def console_table(serving: pd.DataFrame, cross_backend: bool) -> str:
    """The table run/compare print: one row per backend (serving_summary: the median over its runs,
    the interval, min–max and how many runs), the throughput columns first, as many others as fit."""
    if not (serving["status"] == "ok").any():
        return "\n".join(not_run_lines(serving))
    table = serving_summary(serving)
    if cross_backend:
        table["rank"] = table["rank"].replace(NO_INTERVAL, f"< {MIN_RUNS_FOR_INTERVAL} runs")
    else:
        table = table.drop(columns=["rank", "vs best", "identical tokens"])
    if table["runs"].max() == 1:
        table = table.drop(columns=["min–max"])
    empty = [c for c in table.columns if table[c].astype(object).isna().all() or (table[c].astype(str) == "").all()]
    return "\n".join([*fit_terminal(table.drop(columns=empty), CONSOLE_FIRST), *not_run_lines(serving)])


TERMINAL_COLUMNS = 120
# What a terminal shows first; the rest follow while the table fits (the markdown report has them all).
CONSOLE_FIRST = ["backend", "output tok/s", "95% CI", "min–max", "runs", "rank", "vs best", "identical tokens"]
CONSOLE_FIRST += ["TTFT mean/p99 ms", "TPOT mean/p99 ms"]


# The columns other commands' terminal tables show first (their reports have every column).
KERNEL_FIRST = ["backend", "variant", "phase", "batch", "context", "forward ms (median)", "95% CI ms", "GB/s", "% peak"]
BENCH_SERVE_FIRST = ["request_rate", "completed", "failed", "output_throughput", "goodput", "median_ttft_ms"]
BENCH_SERVE_FIRST += ["p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms"]


def terminal_table(table: pd.DataFrame, first: list[str], width: int = TERMINAL_COLUMNS) -> str:
    """`fit_terminal`'s lines as one text to print."""
    return "\n".join(fit_terminal(table, first, width))


def fit_terminal(table: pd.DataFrame, first: list[str], width: int = TERMINAL_COLUMNS) -> list[str]:
    """`table` as markdown lines no wider than `width`: settings every row shares on a line above,
    then `first`'s columns and as many of the others, in order, as fit; a last line names those
    left out (the report's markdown has them)."""
    shared = [c for c in table.columns if c not in first and table[c].astype(str).nunique() == 1]
    lines = [textwrap.fill(", ".join(f"{c} {table[c].iloc[0]}" for c in shared), width)] if shared else []
    order = [c for c in first if c in table] + [c for c in table.columns if c not in first and c not in shared]
    kept = []
    for column in order:
        if max(map(len, markdown(table[[*kept, column]]).splitlines())) <= width or not kept:
            kept.append(column)
    lines.append(markdown(table[kept]))
    left = [c for c in order if c not in kept]
    if left:
        lines.append(textwrap.fill(f"(in the .md report too: {', '.join(left)})", width))
    return lines


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
    """Tensor-, pipeline- and data-parallel sizes and each rank's KV budget, where some run was
    split (with pipeline stages, the mean number of steps in flight; with replicas, the requests
    each served)."""
    names = (("TP", "tensor_parallel_size"), ("PP", "pipeline_parallel_size"), ("DP", "data_parallel_size"))
    sizes = {label: df[column].fillna(1).astype(int) for label, column in names if column in df}
    if not any((size > 1).any() for size in sizes.values()):
        return {}
    columns = {label: size for label, size in sizes.items() if (size > 1).any()}
    if "PP" in columns and "mean_steps_in_flight" in df:
        columns["steps in flight"] = df["mean_steps_in_flight"].round(2)
    if "DP" in columns and "replica_requests" in df:
        columns["requests/replica"] = df["replica_requests"]
    return columns | {"KV blocks/rank": df["num_blocks"].astype("Int64")}


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
    if "speculative" not in df or not (spec_labels(df) != "off").any():
        return {}
    return {
        "speculative": spec_labels(df),
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
    if "moe_kernel" in df:  # what the experts' matmuls ran as (CSVs before it have none)
        experts = experts + df["moe_kernel"].fillna("").map(lambda kernel: f" ({kernel})" if kernel else "")
    return {"experts": experts, "MoE % of forward": (100 * share).round(1)}


def _linear(df: pd.DataFrame) -> dict[str, pd.Series]:
    """Hybrid models' DeltaNet layers' share of the forward (beside the attention backend's)."""
    share = _column(df, "linear_attention_share")
    return {"linear attention % of forward": (100 * share).round(1)} if share.notna().any() else {}


def _indexer(df: pd.DataFrame) -> dict[str, pd.Series]:
    """DeepSeek-V3.2's indexer (scoring and top-k) as a share of the forward, apart from attention."""
    share = _column(df, "indexer_share")
    return {"indexer % of forward": (100 * share).round(1)} if share.notna().any() else {}


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


def spec_labels(df: pd.DataFrame) -> pd.Series:
    """The speculative setting of each row ("off" where none, or in a CSV from before it)."""
    return df["speculative"].astype(object).fillna("off").astype(str)


def _launches(df: pd.DataFrame) -> dict[str, pd.Series]:
    """Whether the model ran compiled and what one decode step launched (kernels on CUDA, operations
    on CPU), where the CSV has them."""
    if "kernels_per_step" not in df:
        return {}
    out = {"kernels/step": df["kernels_per_step"].round().astype("Int64")}
    if "compile" in df:
        out = {"compiled": df["compile"].map({True: "yes", False: "no"})} | out
    return out


def _graphs(df: pd.DataFrame) -> dict[str, pd.Series]:
    """CUDA graphs on/off, where some run had them (the CSV's cuda_graphs column says why not)."""
    if "cuda_graphs" not in df or not df["cuda_graphs"].astype(str).str.startswith("on").any():
        return {}
    return {"CUDA graphs": df["cuda_graphs"].astype(str).str.split(":").str[0]}


def _pct(df: pd.DataFrame, share: str) -> pd.Series:
    return (100 * _column(df, share)).round(1)


def _plan_pct(df: pd.DataFrame) -> pd.Series:
    """backend.plan()'s share of the engine step time, in %."""
    return (100 * df["time_backend_plan_s"] / df[TIME_COLUMNS].sum(axis=1).replace(0, np.nan)).round(2)


def _pair(df: pd.DataFrame, name: str) -> pd.Series:
    return df[f"mean_{name}_ms"].round(2).astype(str) + " / " + df[f"p99_{name}_ms"].round(2).astype(str)


def environment_section(df: pd.DataFrame) -> str:
    cols = ["device_name", "cpu_threads", "load_average", "torch_version", "git_sha", "dtype", "backend", "provider"]
    env = df[cols].drop_duplicates().copy()
    env["git_sha"] = env["git_sha"].astype(str).str.replace(r"^(\w{12})\w*", r"\1", regex=True)
    # Library and driver versions, those any row names (CSVs before them have none), on one line.
    named = df[[c for c in VERSION_COLUMNS if c in df]].astype(object).fillna("").replace("", np.nan)
    found = [
        f"{c.removesuffix('_version')} {', '.join(map(str, named[c].dropna().unique()))}"
        for c in named
        if named[c].notna().any()
    ]
    libraries = f"Versions: {'; '.join(found)}.\n\n" if found else ""
    repro = "Every row's command to measure it again: the CSV's `repro` column (docs/benchmarks.md).\n"
    repro *= bool(REPRO in df and df[REPRO].notna().any())
    return f"## Environment ({df['kind'].iloc[0]})\n\n{markdown(env)}\n\n{libraries}{repro}"


def serving_section(serving: pd.DataFrame) -> str:
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
        summary = serving_summary(serving)
        parts.append(markdown(summary) + "\n")
        parts += _noise_notes(summary, serving)
        ok = serving[serving["status"] == "ok"]
        keys = ["device_name", "scenario", "scale", "model", "backend"]  # never pooled across workloads
        split = ok.groupby(keys, sort=False, dropna=False)[TIME_COLUMNS].sum()
        split = (100 * split.div(split.sum(axis=1), axis=0)).round(1)
        split.columns = [c.removeprefix("time_").removesuffix("_s") + " %" for c in split.columns]
        parts.append("Share of engine step time:\n\n" + markdown(split.reset_index()) + "\n")
    parts += _unavailable_lines(serving)
    return "\n".join(parts)


ATTENTION_TOO_SMALL = 0.05  # under this share of the forward, the backend cannot move end-to-end figures


def _noise_notes(summary: pd.DataFrame, serving: pd.DataFrame) -> list[str]:
    """What a reader must know before reading a ranking: the interval behind it, and whether the
    backend can matter at all."""
    notes = []
    if (summary["runs"] < MIN_RUNS_FOR_INTERVAL).any():
        notes.append(
            f"Rows with fewer than {MIN_RUNS_FOR_INTERVAL} runs have no interval: their ranking says so rather "
            f"than present run-to-run noise as a gap (`--repeats {MIN_RUNS_FOR_INTERVAL}` or more gives one).\n"
        )
    else:
        notes.append(
            "95% CI: the order-statistic interval of the median over the runs (distribution-free); backends whose "
            f'interval overlaps the best\'s rank "tied". Under {RUNS_FOR_LEVEL} runs no such interval reaches 95 %: '
            "the cell is min–max with its own confidence in parentheses (75% at 3 runs, 94% at 5).\n"
        )
    ok = serving[serving["status"] == "ok"]
    share = _column(ok, "attention_share")
    if share.notna().any() and share.max() < ATTENTION_TOO_SMALL:
        notes.append(
            f"Attention was at most {100 * share.max():.1f} % of the forward here: the end-to-end ranking cannot "
            "reflect the attention backend. Compare backends on attention alone with `pagedbench kernels`.\n"
        )
    return notes


def _column(df: pd.DataFrame, name: str) -> pd.Series:
    """A numeric column, or NaN where the CSV predates it."""
    return pd.to_numeric(df[name], errors="coerce") if name in df else pd.Series(float("nan"), index=df.index)


def kernel_table(kernels: pd.DataFrame) -> pd.DataFrame:
    ok = kernels[kernels["status"] == "ok"]
    return pd.DataFrame(
        {
            "backend": ok["backend"],
            "device": ok["device_name"],
            "variant": _variant_names(ok),
            "phase": ok["phase"],
            "query len": _column(ok, "query_len").fillna(1).astype("Int64"),  # CSVs before it: 1
            "KV pages": ok["kv_cache_dtype"].astype(object).fillna("auto") if "kv_cache_dtype" in ok else "auto",
            "batch": ok["batch_size"],
            "context": ok["context_len"],
            "block": ok["block_size"],
            "heads": ok["num_heads"].astype("Int64").astype(str) + "/" + ok["num_kv_heads"].astype("Int64").astype(str),
            "head_dim": ok["head_dim"],
            "plan ms": ok["plan_median_ms"].round(3),
            "forward ms (median)": ok["forward_median_ms"].round(3),
            "95% CI ms": [
                interval_text(lo, hi, 3, median_interval_level(int(n)) if np.isfinite(n) else LEVEL)
                for lo, hi, n in zip(
                    _column(ok, "forward_ci_low_ms"), _column(ok, "forward_ci_high_ms"), _column(ok, "repeats")
                )
            ],
            "forward ms (min)": ok["forward_min_ms"].round(3),
            "GB/s": ok["bandwidth_gbps"].round(1),
            "% peak": ok["pct_of_peak_bandwidth"].round(1),
            "% copy": _column(ok, "pct_of_copy_bandwidth").round(1),
            "x dense": _column(ok, "vs_dense").round(2),
            "TFLOP/s": ok["tflops"].round(3),
            "tile eff.": _column(ok, "tile_efficiency").round(3),
        }
        | _indexer_ms(ok)
    )


def _variant_names(df: pd.DataFrame) -> pd.Series | str:
    """Each row's variant (CSVs before variants: plain); a cascade row's with off/on and its suffix."""
    if "variant" not in df:
        return "plain"
    if "cascade" not in df:
        return df["variant"]
    cascade = df["cascade"].astype(object)
    suffix = _column(df, "suffix_len").astype("Int64").astype(str)
    return (df["variant"].astype(str) + " " + cascade.astype(str) + " +" + suffix).where(cascade.notna(), df["variant"])


def _indexer_ms(df: pd.DataFrame) -> dict[str, pd.Series]:
    """Sparse (dsa) rows: the indexer's selection time at the point, timed apart from attention."""
    ms = _column(df, "indexer_median_ms")
    return {"indexer ms": ms.round(3)} if ms.notna().any() else {}


def bench_serve_table(df: pd.DataFrame) -> pd.DataFrame:
    """bench-serve rows as printed: server, rate, throughput, goodput and latency statistics."""
    columns = ["backend", "request_rate", "completed", "failed", "request_throughput", "output_throughput", "goodput"]
    return df[columns + SERVE_LATENCIES].round(2)


def kernel_section(kernels: pd.DataFrame) -> str:
    peaks = (
        kernels[["device_name", "peak_bandwidth_gbps", "peak_bandwidth_source"]].dropna().drop_duplicates("device_name")
    )
    parts = [
        "## Attention kernels\n",
        "Peak bandwidth used for % peak:\n\n" + markdown(peaks) + "\n",
        markdown(kernel_table(kernels)) + "\n",
    ]
    return "\n".join(parts + _unavailable_lines(kernels))


def check_section(check: pd.DataFrame) -> str:
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
    return ["Not run or cut short:\n\n" + markdown(bad) + "\n"] if len(bad) else []


# ---- plots --------------------------------------------------------------------------------


# check --determinism: what a terminal shows first (the .md report has every column).
DETERMINISM_FIRST = ["backend", "dtype", "phase", "variant", "repeat", "batch", "broken by", "claims", "status"]


def determinism_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per row: ✓ where bitwise equal, else the max |Δ|; what broke invariance; the claim; the status."""

    def cell(equal, diff):
        return "" if pd.isna(equal) else "✓" if bool(equal) else f"{float(diff):.3g}"

    return pd.DataFrame(
        {
            "backend": df["backend"],
            "dtype": df["dtype"],
            "phase": df["phase"],
            "variant": df["variant"],
            "repeat": [cell(e, d) for e, d in zip(df["deterministic"], df["max_abs_diff_repeat"])],
            "batch": [cell(e, d) for e, d in zip(df["batch_invariant"], df["max_abs_diff_batch"])],
            "broken by": df["broken_by"],
            "claims": df["claimed_invariant"].map({True: "invariant", False: "no"}),
            "status": df["status"],
            "reason": df["reason"],
        }
    )


def determinism_section(df: pd.DataFrame) -> str:
    return "## Determinism and batch invariance (bitwise)\n\n" + markdown(determinism_table(df)) + "\n"
