"""A user's own workload, with vLLM's benchmark names (`--dataset-name`, `--dataset-path`):

- `sharegpt`: ShareGPT-format JSON (a list) or JSONL; per record, the first human turn is the
  prompt and the reply after it sets the output length, tokenized with the model's tokenizer; vLLM's
  filters drop prompts or replies under 4 tokens, prompts over 1,024 and pairs over 2,048.
- `custom`: vLLM's custom JSONL, `{"prompt": "...", "output_tokens": 128}` per line.
- `trace`: arrivals and lengths, CSV or JSONL: BurstGPT's columns (`Timestamp`, `Request tokens`,
  `Response tokens`), Azure's LLM inference trace (`TIMESTAMP`, `ContextTokens`,
  `GeneratedTokens`) or `timestamp, input_len, output_len`; prompts are synthetic tokens of the
  given lengths and arrivals follow the timestamps (seconds after the first). Rows of zero tokens
  (BurstGPT's failed requests) are skipped.

One contract for all three, checked row by row before any prompt is built: the file is one file
with rows; lengths are integers >= 1; a request (prompt + output) fits max_model_len, or is an
error naming its row -- skipped and counted instead with `skip_long` (--skip-long-requests), never
cut short; timestamps are finite and never go back; at least one row is kept. Every bad file is a
one-line ValueError naming the file, the row's line and the field.
"""

import csv
import datetime
import json
import logging
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

DATASET_NAMES = ("sharegpt", "custom", "trace")
# vLLM's sharegpt filter (benchmarks' is_valid_sequence defaults)
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
# (timestamp, input length, output length) column names of the trace layouts read
TRACE_LAYOUTS = (
    ("Timestamp", "Request tokens", "Response tokens"),  # BurstGPT
    ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),  # Azure LLM inference trace
    ("timestamp", "input_len", "output_len"),
)
MAX_REQUEST_TOKENS = 1 << 22  # 4M tokens: past every model's context; the limit where no engine's is given
_SPACE = re.compile(r"\s*")


@dataclass(slots=True)
class DatasetRequest:
    prompt_token_ids: list[int]
    output_len: int
    arrival_time: float | None = None  # seconds after the first request (a trace), else the scenario's


def _fail(path: Path, where: str, message: str):
    raise ValueError(f"dataset {str(path)!r}: {where}: {message}")


class _Kept:
    """The requests a loader keeps: at most `num_prompts`, each within `max_model_len` (a longer
    one is an error naming its row, or, with `skip_long`, skipped and counted)."""

    def __init__(self, path: Path, num_prompts: int, max_model_len: int | None, skip_long: bool):
        self.path, self.num_prompts, self.skip_long = path, num_prompts, skip_long
        self.max_model_len = MAX_REQUEST_TOKENS if max_model_len is None else max_model_len
        self.requests: list[DatasetRequest] = []
        self.filtered = self.too_long = 0

    @property
    def full(self) -> bool:
        return len(self.requests) >= self.num_prompts

    def fits(self, where: str, prompt_len: int, output_len: int) -> bool:
        """Whether a request of these lengths fits max_model_len; checked before its prompt is built."""
        if prompt_len + output_len <= self.max_model_len:
            return True
        if not self.skip_long:
            _fail(self.path, where, f"prompt {prompt_len:,} + output {output_len:,} tokens is longer than "
                  f"max_model_len {self.max_model_len:,} (--skip-long-requests skips such rows)")  # fmt: skip
        self.too_long += 1
        return False

    def done(self, filter_rule: str) -> list[DatasetRequest]:
        """The kept requests; none is an error saying why every row was dropped."""
        dropped = [f"{self.filtered} {filter_rule}"] if self.filtered else []
        if self.too_long:
            dropped.append(f"{self.too_long} longer than max_model_len {self.max_model_len:,}")
            if self.requests:
                logger.warning(
                    "dataset %r: rows longer than max_model_len %s skipped (--skip-long-requests): %d; kept: %d",
                    str(self.path), f"{self.max_model_len:,}", self.too_long, len(self.requests),
                )  # fmt: skip
        if not self.requests:
            _fail(self.path, "every row", f"filtered out ({'; '.join(dropped)}): nothing to run")
        return self.requests


def _open(path: Path) -> None:
    """A clear error unless `path` is one readable file."""
    if path.is_dir():
        raise ValueError(f"dataset {str(path)!r} is a directory: --dataset-path takes one file (JSON, JSONL or CSV)")
    if not path.is_file():
        raise FileNotFoundError(f"dataset {str(path)!r} does not exist")


def _rows(path: Path) -> Iterator[tuple[str, object]]:
    """(where, record) of each row of a CSV, JSON list or JSONL file, as read; `where` names its
    line. A file without a row is an error."""
    _open(path)
    if path.suffix.lower() == ".csv":
        rows = _csv_rows(path)
    else:
        text = path.read_text()
        rows = _json_list(path, text) if text.lstrip().startswith("[") else _jsonl(path, text)
    empty = True
    for row in rows:
        empty = False
        yield row
    if empty:
        _fail(path, "the file", "has no rows (an empty dataset)")


def _csv_rows(path: Path) -> Iterator[tuple[str, dict]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        for row in reader:
            yield f"line {reader.line_num}", row


def _jsonl(path: Path, text: str) -> Iterator[tuple[str, object]]:
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield f"line {i}", json.loads(line)
            except json.JSONDecodeError as e:
                _fail(path, f"line {i}", f"not valid JSON: {e.msg}")


def _json_list(path: Path, text: str) -> Iterator[tuple[str, object]]:
    """A JSON list's records one by one, each named by the line it starts on and its index."""
    decoder, pos = json.JSONDecoder(), _SPACE.match(text, text.index("[") + 1).end()
    line, counted, i = 1, 0, 0
    while not text.startswith("]", pos):
        line, counted = line + text.count("\n", counted, pos), pos
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            _fail(path, f"line {e.lineno}", f"not valid JSON: {e.msg}")
        yield f"line {line}, record {i}", record
        pos, i = _SPACE.match(text, pos).end(), i + 1
        if text.startswith(",", pos):
            pos = _SPACE.match(text, pos + 1).end()
        elif not text.startswith("]", pos):
            _fail(path, f"line {line + text.count(chr(10), counted, pos)}", "not valid JSON: expected ',' or ']'")
    if text[pos + 1 :].strip():
        _fail(path, f"line {text.count(chr(10), 0, pos) + 1}", "not valid JSON: extra data after the list")


def _tokens(path: Path, where: str, field: str, value, minimum: int = 1) -> int:
    """A token count: an integer (a JSON number or a CSV cell; 8.0 reads as 8, 8.5 is refused) >= `minimum`."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            number = None
    if isinstance(number, float) and math.isfinite(number) and number.is_integer():
        number = int(number)
    if isinstance(number, bool) or not isinstance(number, int) or number < minimum:
        _fail(path, where, f"{field} must be an integer >= {minimum}, got {value!r}")
    return number


def load_sharegpt(
    path: Path, tokenizer, num_prompts: int, rng: np.random.Generator, max_model_len=None, skip_long=False
) -> list[DatasetRequest]:
    """`num_prompts` conversations drawn (seeded) among those vLLM's filters keep."""
    records = list(_rows(path))
    kept = _Kept(path, num_prompts, max_model_len, skip_long)
    for i in rng.permutation(len(records)):
        where, record = records[i]
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(turns, list):
            _fail(path, where, "conversations must be a list of {from, value} turns")
        if len(turns) < 2:
            kept.filtered += 1  # vLLM's loader skips conversations without a reply
            continue
        for j, turn in enumerate(turns[:2]):
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                _fail(path, where, f"conversations[{j}].value must be a string")
        prompt = tokenizer.encode(turns[0]["value"], add_special_tokens=False)
        reply = len(tokenizer.encode(turns[1]["value"], add_special_tokens=False))
        if min(len(prompt), reply) < MIN_LEN or len(prompt) > MAX_PROMPT_LEN or len(prompt) + reply > MAX_TOTAL_LEN:
            kept.filtered += 1
        elif kept.fits(where, len(prompt), reply):
            kept.requests.append(DatasetRequest(prompt, reply))
        if kept.full:
            break
    return kept.done(f"by vLLM's filter (a reply, prompt and reply of {MIN_LEN}+ tokens, prompt <= "
                     f"{MAX_PROMPT_LEN}, together <= {MAX_TOTAL_LEN})")  # fmt: skip


def load_custom(path: Path, tokenizer, num_prompts: int, max_model_len=None, skip_long=False) -> list[DatasetRequest]:
    """vLLM's custom JSONL: the first `num_prompts` records kept, in file order."""
    kept = _Kept(path, num_prompts, max_model_len, skip_long)
    for where, record in _rows(path):
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            _fail(path, where, "prompt must be a string")
        tokens = _tokens(path, where, "output_tokens", record.get("output_tokens"))
        prompt = tokenizer.encode(record["prompt"], add_special_tokens=False)
        if not prompt:
            _fail(path, where, "prompt is empty after tokenization")
        if kept.fits(where, len(prompt), tokens):
            kept.requests.append(DatasetRequest(prompt, tokens))
        if kept.full:
            break
    return kept.done("")


def _timestamp(path: Path, where: str, field: str, value: str | float) -> float:
    """Seconds, finite: a number as it is, or an ISO date-time (Azure's trace)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        text = str(value).strip().replace("Z", "+00:00")
        if "." in text:  # Azure writes 7 fractional digits; Python reads 6
            head, _, tail = text.partition(".")
            digits = "".join(c for c in tail if c.isdigit())
            text = f"{head}.{digits[:6]}{tail[len(digits) :]}"
        try:
            seconds = datetime.datetime.fromisoformat(text).timestamp()
        except (ValueError, OverflowError):
            seconds = math.nan
    if not math.isfinite(seconds):
        _fail(path, where, f"{field} must be a finite time (seconds or an ISO date-time), got {value!r}")
    return seconds


def _trace_layout(path: Path, row) -> tuple[str, str, str]:
    names = set(row) if isinstance(row, dict) else set()
    layout = next((cols for cols in TRACE_LAYOUTS if set(cols) <= names), None)
    if layout is None:
        known = "; ".join(", ".join(cols) for cols in TRACE_LAYOUTS)
        _fail(path, "columns", f"need one layout of: {known} (got {', '.join(sorted(names)) or 'none'})")
    return layout


def load_trace(
    path: Path, num_prompts: int, vocab_size: int, rng: np.random.Generator, max_model_len=None, skip_long=False
) -> list[DatasetRequest]:
    """The first `num_prompts` rows of a trace kept, arrivals relative to the first, random tokens."""
    kept, layout, start, last = _Kept(path, num_prompts, max_model_len, skip_long), None, None, -math.inf
    for where, row in _rows(path):
        layout = layout or _trace_layout(path, row)
        t = _timestamp(path, where, layout[0], row.get(layout[0]))
        if t < last:
            _fail(path, where, f"{layout[0]} goes back in time ({last - t:.3f} s before the row above's): "
                  "timestamps must not decrease")  # fmt: skip
        last = t
        prompt_len, output_len = (_tokens(path, where, col, row.get(col), minimum=0) for col in layout[1:])
        if prompt_len == 0 or output_len == 0:  # BurstGPT logs failed requests with 0 response tokens
            kept.filtered += 1
        elif kept.fits(where, prompt_len, output_len):
            start = t if start is None else start
            prompt = rng.integers(0, vocab_size, size=prompt_len).tolist()
            kept.requests.append(DatasetRequest(prompt, output_len, t - start))
        if kept.full:
            break
    return kept.done("of zero tokens")


def load_dataset(
    name: str,
    path: str | Path,
    num_prompts: int,
    vocab_size: int,
    tokenizer,
    seed: int,
    max_model_len: int | None = None,
    skip_long: bool = False,
) -> list[DatasetRequest]:
    """The requests of dataset `name` in `path` (at most `num_prompts`, each within `max_model_len`,
    the engine's; a longer one is an error, or skipped with `skip_long`)."""
    if name not in DATASET_NAMES:
        raise ValueError(f"dataset_name must be one of {', '.join(DATASET_NAMES)}, got {name!r}")
    path, rng, limits = Path(path), np.random.default_rng(seed), (max_model_len, skip_long)
    if name == "trace":
        return load_trace(path, num_prompts, vocab_size, rng, *limits)
    if tokenizer is None:
        raise ValueError(f"dataset {name!r} is text: the model needs a tokenizer (a model directory or GGUF file)")
    if name == "sharegpt":
        return load_sharegpt(path, tokenizer, num_prompts, rng, *limits)
    return load_custom(path, tokenizer, num_prompts, *limits)
