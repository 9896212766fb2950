"""Reports: tidy CSVs (schema in report_schema.py), a markdown summary (report_tables.py) and PNG
plots (report_plots.py); re-rendered from CSVs of any number of runs and machines by
`pagedbench report`."""

from pathlib import Path

import pandas as pd

from pagedbench.bench.report_plots import (
    plot_kernel_bandwidth,
    plot_kernel_page_sizes,
    plot_kv_timeline,
    plot_latency_cdfs,
    plot_rate_sweep,
    plot_throughput,
)
from pagedbench.bench.report_schema import RENAMED_COLUMNS, SCHEMAS
from pagedbench.bench.report_tables import (
    bench_serve_table,
    check_section,
    determinism_section,
    environment_section,
    kernel_section,
    markdown,
    serving_section,
)


def tidy(rows: list[dict], kind: str, command: str) -> pd.DataFrame:
    """Rows as a frame with exactly the schema's columns (missing ones empty)."""
    frame = pd.DataFrame([{**row, "kind": kind, "command": command} for row in rows]).reindex(columns=SCHEMAS[kind])
    ints = {k for row in rows for k, v in row.items() if isinstance(v, int) and not isinstance(v, bool)}
    return frame.astype({k: "Int64" for k in ints & set(frame)})  # ints stay ints next to empty cells


class CsvLog(list):
    """A list of result rows that also appends each row to `<out_dir>/<stem>.csv` as it arrives,
    so a long command cut short keeps what it measured (`pagedbench report` renders it)."""

    def __init__(self, out_dir: str | Path, stem: str, kind: str, command: str, repro=None):
        super().__init__()
        self.path, self.kind, self.command = Path(out_dir) / f"{stem}.csv", kind, command
        self.repro = repro  # row -> the command that reproduces it (bench/repro.py), its `repro` column
        self.path.unlink(missing_ok=True)

    def append(self, row: dict) -> None:
        if self.repro is not None:
            row["repro"] = self.repro(row)
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
        frame = pd.read_csv(p).rename(columns=RENAMED_COLUMNS)
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
            sections.append(environment_section(kinds[kind]))
    if "serving" in kinds:
        serving = kinds["serving"]
        sections.append(serving_section(serving))
    if "serving" in kinds and (serving["status"] == "ok").any():
        paths.append(plot_throughput(serving, out_dir / f"{stem}-throughput.png"))
        if "requests" in kinds:
            paths.append(plot_latency_cdfs(kinds["requests"], out_dir / f"{stem}-latency-cdf.png"))
        if "kv" in kinds:
            paths.append(plot_kv_timeline(kinds["kv"], out_dir / f"{stem}-kv-utilization.png"))
    if "kernels" in kinds:
        sections.append(kernel_section(kinds["kernels"]))
    if "kernels" in kinds and (kinds["kernels"]["status"] == "ok").any():
        paths.append(plot_kernel_bandwidth(kinds["kernels"], out_dir / f"{stem}-bandwidth.png"))
        if kinds["kernels"].loc[kinds["kernels"]["status"] == "ok", "block_size"].nunique() > 1:
            paths.append(plot_kernel_page_sizes(kinds["kernels"], out_dir / f"{stem}-page-size.png"))
    if "check" in kinds:
        sections.append(check_section(kinds["check"]))
    if "determinism" in kinds:
        sections.append(determinism_section(kinds["determinism"]))
    if "bench-serve" in kinds:
        sections.append(
            "## Online serving (bench-serve)\n\n" + markdown(bench_serve_table(kinds["bench-serve"])) + "\n"
        )
        paths.append(plot_rate_sweep(kinds["bench-serve"], out_dir / f"{stem}-latency-vs-throughput.png"))
    sections += [f"![{p.stem}]({p.name})\n" for p in paths]
    md = out_dir / f"{stem}.md"
    md.write_text("\n".join(sections))
    return [md] + paths
