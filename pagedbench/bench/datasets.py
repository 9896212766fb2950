"""A user's own workload, with vLLM's benchmark names (`--dataset-name`, `--dataset-path`):

- `sharegpt`: ShareGPT-format JSON (a list) or JSONL; per record, the first human turn is the
  prompt and the reply after it sets the output length, tokenized with the model's tokenizer; vLLM's
  filters drop prompts or replies under 4 tokens, prompts over 1,024 and pairs over 2,048.
- `custom`: vLLM's custom JSONL, `{"prompt": "...", "output_tokens": 128}` per line.
- `trace`: arrivals and lengths, CSV or JSONL: BurstGPT's columns (`Timestamp`, `Request tokens`,
  `Response tokens`), Azure's LLM inference trace (`TIMESTAMP`, `ContextTokens`,
  `GeneratedTokens`) or `timestamp, input_len, output_len`; prompts are synthetic tokens of the
  given lengths and arrivals follow the timestamps (seconds after the first).

Every bad file is a one-line ValueError naming the file, the record and the field.
"""

import csv
import datetime
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATASET_NAMES = ("sharegpt", "custom", "trace")
# vLLM's sharegpt filter (benchmarks' is_valid_sequence defaults)
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
# (timestamp, input length, output length) column names of the trace layouts read
TRACE_LAYOUTS = (
    ("Timestamp", "Request tokens", "Response tokens"),  # BurstGPT
    ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),  # Azure LLM inference trace
    ("timestamp", "input_len", "output_len"),
)


@dataclass(slots=True)
class DatasetRequest:
    prompt_token_ids: list[int]
    output_len: int
    arrival_time: float | None = None  # seconds after the first request (a trace), else the scenario's


def _fail(path: Path, where: str, message: str):
    raise ValueError(f"dataset {str(path)!r}: {where}: {message}")


def _records(path: Path) -> list[tuple[str, dict]]:
    """(where, record) of a JSON list or JSONL file; `where` names the record for errors."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset {str(path)!r} does not exist")
    text = path.read_text()
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            _fail(path, f"line {e.lineno}", f"not valid JSON: {e.msg}")
        return [(f"record {i}", r) for i, r in enumerate(data)]
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append((f"line {i}", json.loads(line)))
            except json.JSONDecodeError as e:
                _fail(path, f"line {i}", f"not valid JSON: {e.msg}")
    return out


def load_sharegpt(path: Path, tokenizer, num_prompts: int, rng: np.random.Generator) -> list[DatasetRequest]:
    """`num_prompts` conversations drawn (seeded) among those vLLM's filters keep."""
    records = _records(path)
    order = rng.permutation(len(records))
    out = []
    for i in order:
        where, record = records[i]
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(turns, list):
            _fail(path, where, "conversations must be a list of {from, value} turns")
        if len(turns) < 2:
            continue  # vLLM's loader skips conversations without a reply
        for j, turn in enumerate(turns[:2]):
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                _fail(path, where, f"conversations[{j}].value must be a string")
        prompt = tokenizer.encode(turns[0]["value"], add_special_tokens=False)
        reply = len(tokenizer.encode(turns[1]["value"], add_special_tokens=False))
        if (
            len(prompt) < MIN_LEN
            or reply < MIN_LEN
            or len(prompt) > MAX_PROMPT_LEN
            or len(prompt) + reply > MAX_TOTAL_LEN
        ):
            continue
        out.append(DatasetRequest(prompt, reply))
        if len(out) == num_prompts:
            break
    if not out:
        _fail(path, "every record", f"filtered out (prompt and reply of {MIN_LEN}+ tokens, prompt <= {MAX_PROMPT_LEN}, "
              f"together <= {MAX_TOTAL_LEN})")  # fmt: skip
    return out


def load_custom(path: Path, tokenizer, num_prompts: int) -> list[DatasetRequest]:
    """vLLM's custom JSONL: the first `num_prompts` records, in file order."""
    out = []
    for where, record in _records(path)[:num_prompts]:
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            _fail(path, where, "prompt must be a string")
        tokens = record.get("output_tokens")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            _fail(path, where, f"output_tokens must be an integer >= 1, got {tokens!r}")
        prompt = tokenizer.encode(record["prompt"], add_special_tokens=False)
        if not prompt:
            _fail(path, where, "prompt is empty after tokenization")
        out.append(DatasetRequest(prompt, tokens))
    return out


def _timestamp(value: str | float) -> float:
    """Seconds: a number as it is, or an ISO date-time (Azure's trace)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        text = str(value).strip().replace("Z", "+00:00")
        if "." in text:  # Azure writes 7 fractional digits; Python reads 6
            head, _, tail = text.partition(".")
            digits = "".join(c for c in tail if c.isdigit())
            text = f"{head}.{digits[:6]}{tail[len(digits) :]}"
        return datetime.datetime.fromisoformat(text).timestamp()


def load_trace(path: Path, num_prompts: int, vocab_size: int, rng: np.random.Generator) -> list[DatasetRequest]:
    """The first `num_prompts` rows of a trace, arrivals relative to the first, random tokens."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset {str(path)!r} does not exist")
    if path.suffix.lower() == ".csv":
        with path.open(newline="") as f:
            rows = [(f"row {i}", r) for i, r in enumerate(csv.DictReader(f), 2)]
    else:
        rows = _records(path)
    if not rows:
        _fail(path, "the file", "has no rows")
    names = set(rows[0][1]) if isinstance(rows[0][1], dict) else set()
    layout = next((cols for cols in TRACE_LAYOUTS if set(cols) <= names), None)
    if layout is None:
        known = "; ".join(", ".join(cols) for cols in TRACE_LAYOUTS)
        _fail(path, "columns", f"need one layout of: {known} (got {', '.join(sorted(names)) or 'none'})")
    out, start = [], None
    for where, row in rows[:num_prompts]:
        try:
            t = _timestamp(row[layout[0]])
        except (ValueError, OverflowError):
            _fail(path, where, f"{layout[0]} is not a time: {row[layout[0]]!r}")
        lengths = []
        for col in layout[1:]:
            try:
                value = int(float(row[col]))
            except (TypeError, ValueError):
                _fail(path, where, f"{col} must be an integer, got {row[col]!r}")
            lengths.append(value)
        if lengths[0] < 1 or lengths[1] < 1:  # BurstGPT logs failed requests with 0 response tokens
            continue
        start = t if start is None else start
        if t < start:
            _fail(path, where, f"{layout[0]} goes back in time ({t - start:.3f} s before the first row)")
        prompt = rng.integers(0, vocab_size, size=lengths[0]).tolist()
        out.append(DatasetRequest(prompt, lengths[1], t - start))
    if not out:
        _fail(path, "every row", "has zero tokens")
    return out


def load_dataset(
    name: str, path: str | Path, num_prompts: int, vocab_size: int, tokenizer, seed: int
) -> list[DatasetRequest]:
    """The requests of dataset `name` in `path` (at most `num_prompts`)."""
    if name not in DATASET_NAMES:
        raise ValueError(f"dataset_name must be one of {', '.join(DATASET_NAMES)}, got {name!r}")
    path, rng = Path(path), np.random.default_rng(seed)
    if name == "trace":
        return load_trace(path, num_prompts, vocab_size, rng)
    if tokenizer is None:
        raise ValueError(f"dataset {name!r} is text: the model needs a tokenizer (a model directory or GGUF file)")
    if name == "sharegpt":
        return load_sharegpt(path, tokenizer, num_prompts, rng)
    return load_custom(path, tokenizer, num_prompts)
