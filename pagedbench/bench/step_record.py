"""`run --record-steps N`: up to N of a run's steps, sampled evenly, written beside its report as
`<stem>-steps.jsonl` for `kernels --replay` (bench/replay.py) to rebuild and time through any backend.

The first line is a header: the attention shape of each kind of layer (heads, KV heads, head dim,
window, soft-cap, sinks, how many layers), dtypes, page size, the cache's pages, the backend. Then a
line per recorded step: per sequence its query and context length and its pages; whether the step
replayed a CUDA graph (its padded batch) and the engine's own attention time for it (eager steps of
a timed run). Pages are written against the previous line: a sequence whose page list extends a row
of that line names the row and adds its new pages, run-length encoded (first, count); otherwise its
whole list is encoded. Steps are kept by a stride that doubles whenever N + 1 are held (every other
one dropped), so memory stays bounded and the kept steps stay evenly spread over a run of unknown length.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedbench.device.dtypes import dtype_name

FORMAT = "pagedbench-steps"
VERSION = 1


@dataclass(slots=True)
class RecordedStep:
    """One step as recorded: lengths and each sequence's pages (zeros after the last trimmed)."""

    index: int  # the step's number in the run (from 0)
    query_lens: list[int]
    context_lens: list[int]
    pages: list[np.ndarray]  # per sequence, int32 page ids
    graph: int | None = None  # the CUDA-graph bucket the step was padded to (None: eager)
    attention_ms: float | None = None  # the engine's attention time in this step, every layer
    _spans: tuple | None = None  # (the timer's live span list, first index, end index) until written

    def to_json(self, previous: "RecordedStep | None") -> dict:
        return {
            "step": self.index,
            "q": self.query_lens,
            "ctx": self.context_lens,
            "pages": encode_pages(self.pages, previous.pages if previous is not None else []),
            "graph": self.graph,
            "attention_ms": None if self.attention_ms is None else round(self.attention_ms, 4),
        }


def row_pages(block_table: np.ndarray) -> list[np.ndarray]:
    """Each row's pages up to its last nonzero entry (a table's rows are zero-padded: replaying the
    trimmed rows zero-padded gives the same table)."""
    out = []
    for row in block_table:
        nonzero = np.flatnonzero(row)
        out.append(row[: nonzero[-1] + 1 if len(nonzero) else 0].astype(np.int32))
    return out


def run_length(pages: np.ndarray) -> list[int]:
    """[first, count, first, count, ...]: runs of page ids one apart, rising (count n > 0: first ..
    first + n - 1) or falling (n < 0: first .. first + n + 1; the block pool hands out pages from the top)."""
    runs: list[int] = []
    for page in pages.tolist():
        if runs:
            first, count = runs[-2], runs[-1]
            if count > 0 and page == first + count:
                runs[-1] += 1
                continue
            if count == 1 and page == first - 1 or count < 0 and page == first + count:
                runs[-1] = -2 if count == 1 else count - 1
                continue
        runs += [page, 1]
    return runs


def expand_runs(runs: list[int]) -> np.ndarray:
    if not runs:
        return np.zeros(0, dtype=np.int32)
    parts = [np.arange(a, a + n) if n > 0 else np.arange(a, a + n, -1) for a, n in zip(runs[::2], runs[1::2])]
    return np.concatenate(parts).astype(np.int32)


def encode_pages(pages: list[np.ndarray], previous: list[np.ndarray]) -> list[list[int]]:
    """Per sequence [row of the previous line whose pages it extends, or -1, *runs of the rest]."""
    by_first: dict[int, list[int]] = {}
    for i, rows in enumerate(previous):
        if len(rows):
            by_first.setdefault(int(rows[0]), []).append(i)
    encoded = []
    for rows in pages:
        ref = -1
        for i in by_first.get(int(rows[0]), []) if len(rows) else []:
            old = previous[i]
            longer = ref < 0 or len(old) > len(previous[ref])
            if longer and len(old) <= len(rows) and np.array_equal(old, rows[: len(old)]):
                ref = i
        rest = rows if ref < 0 else rows[len(previous[ref]) :]
        encoded.append([ref, *run_length(rest)])
    return encoded


def decode_pages(encoded: list[list[int]], previous: list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for ref, *runs in encoded:
        rest = expand_runs(runs)
        out.append(rest if ref < 0 else np.concatenate([previous[ref], rest]))
    return out


class StepRecorder:
    """Called by the model runner with each step's inputs (`record`); keeps at most `limit` steps."""

    def __init__(self, limit: int, header: dict, timer=None):
        if limit < 1:
            raise ValueError(f"--record-steps must be >= 1, got {limit}")
        self.limit, self.header, self.timer = limit, header, timer
        self.stride, self.seen = 1, 0
        self.steps: list[RecordedStep] = []
        self._open: RecordedStep | None = None  # the last recorded step, while its attention spans grow

    def record(self, inputs, timer=None) -> None:
        """One step (StepInputs: its host arrays; `timer`: the DeviceTimer timing its layers, or None)."""
        self._close()
        index, self.seen = self.seen, self.seen + 1
        if index % self.stride:
            return
        batch = inputs.batch
        step = RecordedStep(
            index,
            np.diff(batch.query_start_loc).tolist(),
            batch.context_lens.tolist(),
            row_pages(batch.block_table),
            inputs.graph,
        )
        if timer is not None:
            spans = timer.spans("attention")
            step._spans = (spans, len(spans), None)
            self._open = step
        self.steps.append(step)
        if len(self.steps) > self.limit:
            self.stride *= 2
            self.steps = [s for s in self.steps if s.index % self.stride == 0]

    def _close(self) -> None:
        if self._open is not None:
            spans, start, _ = self._open._spans
            self._open._spans = (spans, start, len(spans))
            self._open = None

    def finish(self) -> None:
        """After the run: each timed step's attention time from its spans (on CUDA, after a sync)."""
        self._close()
        if self.timer is None:
            return
        if self.timer.cuda:
            import torch

            torch.cuda.synchronize()
        for step in self.steps:
            if step._spans is not None:
                spans, start, end = step._spans
                step.attention_ms = 1e3 * self.timer.seconds(spans[start:end])
                step._spans = None

    def write(self, path: Path) -> Path:
        self.finish()
        header = {**self.header, "steps_seen": self.seen, "steps_recorded": len(self.steps), "stride": self.stride}
        lines, previous = [json.dumps(header)], None
        for step in self.steps:
            lines.append(json.dumps(step.to_json(previous), separators=(",", ":")))
            previous = step
        path.write_text("\n".join(lines) + "\n")
        return path


def recording_header(engine, backend: str, report: str) -> dict:
    """What a replay needs beyond the steps: the layers' attention shapes by kind, dtypes, the cache."""
    runner = engine.executor.runner
    kinds: dict[tuple, dict] = {}
    for layer, b in enumerate(runner.backend.layer_backends):
        if runner.kv_caches[layer] is None:  # another pipeline stage's layer
            continue
        key = (b.num_heads, b.num_kv_heads, b.head_dim, b.scale, *b.variant.settings().values())
        kind = kinds.setdefault(key, {
            "num_heads": b.num_heads, "num_kv_heads": b.num_kv_heads, "head_dim": b.head_dim, "scale": b.scale,
            **b.variant.settings(), "layers": 0,
        })  # fmt: skip
        kind["layers"] += 1
    graphs = runner.graphs
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": engine.config.model,
        "backend": backend,
        "device": str(engine.device),
        "dtype": dtype_name(engine.dtype),
        "kv_cache_dtype": engine.config.kv_cache_dtype,
        "block_size": runner.block_size,
        "num_cache_blocks": runner.num_cache_blocks,
        "pad_block": runner.pad_block,
        "graph_width": None if graphs is None else graphs.width,
        "graph_max_seq_len": None if graphs is None else graphs.max_seq_len,
        "layer_kinds": list(kinds.values()),
        "report": report,
    }


def attach_recorder(engine, limit: int, backend: str, report: str) -> StepRecorder:
    """A recorder on `engine`'s model runner (a single-process engine: no data-parallel front)."""
    executor = getattr(engine, "executor", None)
    if executor is None or not hasattr(executor.runner, "step_recorder"):
        raise ValueError("--record-steps records a single-process engine's steps (no data parallelism)")
    recorder = StepRecorder(limit, recording_header(engine, backend, report), executor.timer)
    executor.runner.step_recorder = recorder
    return recorder


def detach_recorder(engine) -> None:
    engine.executor.runner.step_recorder = None


def read_recording(path: str | Path) -> tuple[dict, list[RecordedStep]]:
    """The header and steps of a `<stem>-steps.jsonl` (page lists decoded)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no such recording: {path}")
    lines = path.read_text().splitlines()
    header = json.loads(lines[0]) if lines else {}
    if header.get("format") != FORMAT:
        raise ValueError(f"{path} is not a pagedbench step recording (no '{FORMAT}' header)")
    steps, previous = [], []
    for line in lines[1:]:
        raw = json.loads(line)
        pages = decode_pages(raw["pages"], previous)
        steps.append(RecordedStep(raw["step"], raw["q"], raw["ctx"], pages, raw["graph"], raw["attention_ms"]))
        previous = pages
    return header, steps


@dataclass(slots=True)
class RecordSteps:
    """Where `run` / `compare` write their recordings: `<stem>-steps.jsonl` (compare: one per backend,
    `<stem>-<backend>-steps.jsonl`), beside the report `<stem>.csv`."""

    limit: int
    out_dir: Path
    stem: str
    per_backend: bool = False

    def path(self, backend: str) -> Path:
        name = f"{self.stem}-{backend}-steps.jsonl" if self.per_backend else f"{self.stem}-steps.jsonl"
        return Path(self.out_dir) / name

    def attach(self, engine, backend: str) -> StepRecorder:
        return attach_recorder(engine, self.limit, backend, f"{self.stem}.csv")
