"""The reports' PNG plots: throughput, latency CDFs, KV use over time, bench-serve's rate sweep
and kernel bandwidth; runs are compared only within one scenario, scale, model, device and dtype."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from pagedbench.bench.noise import RUNS_FOR_LEVEL, spread  # noqa: E402
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


FACET_KEYS = ["device_name", "model"]  # a merged report's runs: one panel per device and model


def plot_throughput(serving: pd.DataFrame, path: Path) -> Path:
    """Median output throughput per backend, with the median's interval as a whisker where there
    are runs enough for one (noise.py: order statistics, min-max under 6 runs). Runs of several
    devices or models (a merged report) get a panel each, with its own axis: a CPU's tok/s is never
    drawn beside an H200's."""
    ok = serving[serving["status"] == "ok"]
    keys = [k for k in FACET_KEYS if k in ok and ok[k].nunique(dropna=False) > 1]
    panels = list(ok.groupby(keys, sort=False)) if keys else [((), ok)]
    heights = [1.0 + 0.4 * _labels(part).nunique() for _, part in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 0.5 + sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})  # fmt: skip
    for ax, (key, part) in zip(axes[:, 0], panels):
        _throughput_bars(ax, part)
        if keys:
            ax.set_title(", ".join(str(k) for k in (key if isinstance(key, tuple) else (key,))), fontsize="small")
    fig.suptitle(_title("Output throughput by backend", ok), fontsize="medium")
    return _save(fig, path)


def _throughput_bars(ax, ok: pd.DataFrame) -> None:
    groups = ok.groupby(_labels(ok), sort=False)["output_throughput"]
    spreads = {label: spread(values) for label, values in groups}
    labels = list(spreads)[::-1]
    medians = np.array([spreads[k]["median"] for k in labels])
    low = np.array([spreads[k]["ci_low"] for k in labels])
    high = np.array([spreads[k]["ci_high"] for k in labels])
    ax.barh(labels, medians, color="tab:blue")
    known = np.isfinite(low)  # a bar without an interval (too few runs) gets no whisker, not a zero-width one
    errors = np.vstack([medians - low, high - medians])[:, known]
    if known.any():
        ax.errorbar(medians[known], np.flatnonzero(known), xerr=errors, fmt="none", ecolor="black", capsize=4)
    ends = np.where(np.isfinite(high), high, medians)
    for y, (value, end) in enumerate(zip(medians, ends)):
        ax.text(end, y, f" {value:.0f}" if value >= 10 else f" {value:.2g}", va="center")
    positive = medians[medians > 0]
    if len(positive) > 1 and positive.max() / positive.min() > 100:  # decades apart: a log axis shows both
        ax.set_xscale("log")
        ax.set_xlim(positive.min() / 2, 3 * np.nanmax(ends))
    else:
        ax.set_xlim(0, 1.2 * max(np.nanmax(ends), 1))  # room for the value beside the longest bar
    with_ci = np.isfinite(low).any()
    interval = f", whiskers: the median's interval, min–max under {RUNS_FOR_LEVEL} runs)"
    ax.set_xlabel("output tokens/s (median over runs" + (interval if with_ci else ")"))


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
    handles, labels = axes[0].get_legend_handles_labels()  # below the panels: over them it hides the curves
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0), ncol=min(len(labels), 4), fontsize="small")
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


def _kernel_measure(rows: pd.DataFrame) -> tuple[str, str]:
    """(column, axis label): % of the device's copy bandwidth where every row has it, else GB/s."""
    if "pct_of_copy_bandwidth" in rows and rows["pct_of_copy_bandwidth"].notna().all():
        return "pct_of_copy_bandwidth", "% of copy bandwidth (KV read)"
    return "bandwidth_gbps", "KV bytes read / time (GB/s)"


def _kernel_labels(rows: pd.DataFrame, *, pages: bool = True) -> pd.Series:
    """backend (and variant, CUDA graphs, page size, heads where they vary among `rows`)."""
    label = _labels(rows)
    if "variant" in rows and rows["variant"].nunique(dropna=False) > 1:  # e.g. dense latent beside sparse
        label = label + " · " + rows["variant"].astype(str)
    if "cuda_graphs" in rows and rows["cuda_graphs"].nunique(dropna=False) > 1:
        label = label + rows["cuda_graphs"].map({True: " · graphed"}).fillna("")
    if "cascade" in rows and rows["cascade"].nunique(dropna=False) > 1:  # kernels --variants cascade: flat, cascaded
        label = label + " · cascade " + rows["cascade"].astype(str)
    if pages and rows["block_size"].nunique() > 1:
        label = label + " · page " + rows["block_size"].astype("Int64").astype(str)
    heads = rows["num_heads"].astype("Int64").astype(str) + "/" + rows["num_kv_heads"].astype("Int64").astype(str)
    if heads.nunique() > 1:
        label = label + " · heads " + heads
    return label


def _panels(rows: pd.DataFrame) -> list[tuple[str, int]]:
    return list(dict.fromkeys(zip(rows["phase"], rows["batch_size"].astype(int))))


def _panel_grid(count: int, width: float = 4.3, height: float = 3.4):
    cols = min(count, 3)
    nrows = -(-count // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(width * cols, height * nrows), squeeze=False)
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def plot_kernel_bandwidth(kernels: pd.DataFrame, path: Path) -> Path:
    """Achieved bandwidth against context length: a panel per phase and batch, a line per backend
    (and page size, graphs, heads where they vary); % of copy bandwidth where measured."""
    ok = kernels[kernels["status"] == "ok"]
    measure, axis = _kernel_measure(ok)
    panels = _panels(ok)
    fig, axes = _panel_grid(len(panels))
    for ax, (phase, batch) in zip(axes, panels):
        rows = ok[(ok["phase"] == phase) & (ok["batch_size"] == batch)]
        for name, group in rows.groupby(_kernel_labels(rows), sort=False):
            group = group.sort_values("context_len")
            ax.plot(group["context_len"], group[measure], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{phase}, batch {batch}")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(axis)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.suptitle(_title("Attention kernel bandwidth", ok))
    return _save(fig, path)


def plot_kernel_page_sizes(kernels: pd.DataFrame, path: Path) -> Path:
    """Achieved bandwidth against page size, at each phase and batch's longest context: a panel per
    phase and batch, a line per backend. What page size each backend needs."""
    ok = kernels[kernels["status"] == "ok"]
    ok = ok[ok["context_len"] == ok.groupby(["phase", "batch_size"])["context_len"].transform("max")]
    measure, axis = _kernel_measure(ok)
    panels = _panels(ok)
    fig, axes = _panel_grid(len(panels))
    for ax, (phase, batch) in zip(axes, panels):
        rows = ok[(ok["phase"] == phase) & (ok["batch_size"] == batch)]
        for name, group in rows.groupby(_kernel_labels(rows, pages=False), sort=False):
            group = group.sort_values("block_size")
            ax.plot(group["block_size"], group[measure], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(rows["block_size"].unique()), [str(int(b)) for b in sorted(rows["block_size"].unique())])
        ax.set_title(f"{phase}, batch {batch} x {int(rows['context_len'].max())} tokens")
        ax.set_xlabel("page size (tokens)")
        ax.set_ylabel(axis)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.suptitle(_title("Attention kernel bandwidth by page size", ok))
    return _save(fig, path)


def busy_share_plot(df: pd.DataFrame, path: Path, title: str) -> Path:
    """The host benchmark: busy share (device time / wall time) against batch, a line per async
    setting and output length."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (run_ahead, output_len), rows in df.groupby(["async_scheduling", "output_len"]):
        label = f"async {'on' if run_ahead else 'off'}, output {output_len}"
        ax.plot(rows["batch"], rows["busy_share"], marker="o", linestyle="-" if run_ahead else "--", label=label)
    ax.set(xlabel="batch (decoding sequences)", ylabel="busy share (device / wall)", ylim=(0, 1.05), title=title)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(df["batch"].unique()), [str(b) for b in sorted(df["batch"].unique())])
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # nothing drawn outside the axes is cut
    plt.close(fig)
    return path


def plot_replay(summary: pd.DataFrame, path: Path) -> Path:
    """`kernels --replay`: backends ranked by attention ms per recorded step (all layers), a panel per
    recording; the engine's own time for the recorded backend marked beside its bar."""
    panels = list(summary.groupby("recording", sort=False))
    fig, axes = _panel_grid(len(panels), width=5.6, height=0.5 * summary["backend"].nunique() + 1.8)
    for ax, (recording, rows) in zip(axes, panels):
        rows = rows.sort_values("replay_attention_ms_per_step", ascending=False)
        ax.barh(rows["backend"], rows["replay_attention_ms_per_step"], color="tab:blue", label="replay")
        engine = rows.dropna(subset=["engine_attention_ms_per_step"])
        ax.scatter(engine["engine_attention_ms_per_step"], engine["backend"], color="tab:red", zorder=3, label="engine")
        ax.set(xlabel="attention ms per step (all layers)", title=recording)
        ax.legend(fontsize="x-small")
    fig.suptitle(_title("Backends at the recorded steps", summary))
    return _save(fig, path)
