"""The GPU suite's ledger: what each draw measured, on which code, so that the next draw
(`gpu-suite --next`) takes the most valuable steps without a result on the code as it is now.

Every suite run writes `ledger.csv` beside its summary (one row per step that ran: status,
seconds, the hash of the source the step depends on, the commit, the date). Committed under
`reports/<gpu>/runN/`, the ledgers are what `--next` reads. A step has a result when a ledger
holds it `ok` or `failed` with the same code hash (a step that failed on this code fails again;
one that was cut or skipped has no result). The hash is over the files themselves, not git: the
device machine gets a copy of the working tree without its history."""

import csv
import hashlib
import re
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCE_SUFFIXES = (".py", ".toml")
LEDGER = "ledger.csv"
COLUMNS = ["step", "status", "seconds", "code_hash", "commit", "date"]
RESULT_STATUSES = ("ok", "failed")  # cut and skipped steps have no result: they run again


@dataclass(slots=True)
class LedgerRow:
    step: str
    status: str
    seconds: float
    code_hash: str
    commit: str
    date: str


def code_hash(paths: tuple[str, ...], root: Path = REPO) -> str:
    """sha256 (first 16 hex digits) over the source files under `paths` (relative to `root`), by
    relative path and content: the same tree gives the same hash on any machine."""
    digest = hashlib.sha256()
    for rel in paths:
        base = root / rel
        files = [base] if base.is_file() else sorted(base.rglob("*")) if base.is_dir() else []
        for f in files:
            if f.suffix in SOURCE_SUFFIXES and "__pycache__" not in f.parts:
                try:
                    content = f.read_bytes()
                except (FileNotFoundError, IsADirectoryError):  # gone since listed (an editor's temporary file)
                    continue
                digest.update(f.relative_to(root).as_posix().encode() + b"\0" + content + b"\0")
    return digest.hexdigest()[:16]


def gpu_slug(device_name: str) -> str:
    """reports/'s directory name for a card: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def write_ledger(rows: list[LedgerRow], work: Path) -> Path:
    path = work / LEDGER
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for r in rows:
            writer.writerow([getattr(r, c) for c in COLUMNS])
    return path


def read_ledgers(reports: Path) -> list[LedgerRow]:
    """Every ledger row committed under `reports` (a card's directory: its runs' ledger.csv files)."""
    rows = []
    for path in sorted(reports.rglob(LEDGER)) if reports.is_dir() else []:
        with path.open(newline="") as f:
            for r in csv.DictReader(f):
                rows.append(
                    LedgerRow(r["step"], r["status"], float(r["seconds"] or 0), r["code_hash"], r["commit"], r["date"])
                )
    return rows


def measured(rows: list[LedgerRow], step: str, current_hash: str) -> LedgerRow | None:
    """The latest row with a result for `step` on the code as it is now (None: the step should run)."""
    hits = [r for r in rows if r.step == step and r.code_hash == current_hash and r.status in RESULT_STATUSES]
    return max(hits, key=lambda r: r.date) if hits else None


def today() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
