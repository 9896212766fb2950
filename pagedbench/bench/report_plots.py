"""The reports' PNG plots: throughput, latency CDFs, KV use over time, bench-serve's rate sweep
and kernel bandwidth; runs are compared only within one scenario, scale, model, device and dtype."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from pagedbench.bench.noise import spread  # noqa: E402
from pagedbench.bench.report_tables import spec_labels  # noqa: E402

GROUP_KEYS = ["scenario", "scale", "model", "device_name", "dtype"]  # runs compared only within one of each


def _labels(df: pd.DataFrame) -> pd.Series:
    """backend, plus whichever of scenario, scale, model, device and dtype vary among the rows."""
    label = df["backend"].astype(str)
    for col in GROUP_KEYS:
        if col in df and df[col].nunique(dropna=False) > 1:
            label = label + " · " + (f"{col} " if col == "scale" else "") + df[col].astype(str)
    if "enable_prefix_caching" in df and df["enable_prefix_caching"].nunique() > 1:
        label = label + df["enable_prefix_caching"].map({True: "", False: " · no prefix caching"})
    sizes = (("tensor_parallel_size", "tp"), ("pipeline_parallel_size", "pp"), ("data_parallel_size", "dp"))
    for column, short in sizes:
        if column in df and df[column].nunique(dropna=False) > 1:
            label = label + f" · {short} " + df[column].fillna(1).astype(int).astype(str)
    if "enforce_eager" in df and df["enforce_eager"].nunique() > 1:
        label = label + df["enforce_eager"].map({True: " · eager", False: ""})
    if "kv_cache_dtype" in df and df["kv_cache_dtype"].astype(object).fillna("auto").nunique() > 1:
        label = label + " · KV " + df["kv_cache_dtype"].astype(object).fillna("auto").astype(str)
    if "speculative" in df and spec_labels(df).nunique() > 1:
        label = label + " · spec " + spec_labels(df)
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
    """Median output throughput per backend, with the median's bootstrap 95 % interval as an error
    bar where there are runs enough for one (noise.py)."""
    ok = serving[serving["status"] == "ok"]
    groups = ok.groupby(_labels(ok), sort=False)["output_throughput"]
    spreads = {label: spread(values) for label, values in groups}
    labels = list(spreads)[::-1]
    medians = np.array([spreads[k]["median"] for k in labels])
    low = np.array([spreads[k]["ci_low"] for k in labels])
    high = np.array([spreads[k]["ci_high"] for k in labels])
    errors = np.nan_to_num(np.vstack([medians - low, high - medians]), nan=0.0)
    fig, ax = plt.subplots(figsize=(7, 1.5 + 0.4 * len(labels)))
    ax.barh(labels, medians, color="tab:blue", xerr=errors, capsize=4, error_kw={"ecolor": "black"})
    ends = np.where(np.isfinite(high), high, medians)
    for y, (value, end) in enumerate(zip(medians, ends)):
        ax.text(end, y, f" {value:.0f}" if value >= 10 else f" {value:.2g}", va="center")
    ax.set_xlim(0, 1.2 * max(np.nanmax(ends), 1))  # room for the value beside the longest bar
    with_ci = np.isfinite(low).any()
    ax.set_xlabel("output tokens/s (median over runs" + (", bars: 95% interval of the median)" if with_ci else ")"))
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
