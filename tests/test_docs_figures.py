"""Every measured figure in the README and docs/ comes from a committed report.

A table of figures (a header naming a rate, a bandwidth, a latency or a share) is preceded by
`<!-- source: path[, path ...] -->` naming committed reports; each number in the table must be
one of those reports' numbers at the precision the table shows it (a CSV's fractions also count
as percentages). A stale figure, or one measured and never committed, fails here."""

import math
import re
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCE = re.compile(r"<!--\s*source:\s*(.+?)\s*-->")
# what marks a table of measured figures, in its header or the lines that lead into it
FIGURES = re.compile(r"tok/s|GB/s|% copy|% of the copy|TTFT|TPOT|agreement|mean KL|accepted|ms/step", re.IGNORECASE)
NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?")


def tables(page: Path) -> list[tuple[int, list[str], list[str]]]:
    """(line number, source paths or [], table lines) of each markdown table of figures in a page."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and set(lines[i + 1]) <= set("|:- "):
            start = i
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            if FIGURES.search("\n".join(lines[max(0, start - 12) : start + 1])):
                before = "\n".join(lines[max(0, start - 15) : start])
                sources = [m for match in SOURCE.findall(before) for m in re.split(r"\s*,\s*", match)]
                found.append((start + 1, sources, lines[start + 2 : i]))
        i += 1
    return found


def numbers(text: str) -> list[str]:
    return [n.replace(",", "") for n in NUMBER.findall(text)]


def source_values(path: Path) -> set[float]:
    """Every number a report holds (a CSV's numeric cells, and its fractions as percentages)."""
    if path.suffix == ".csv":
        frame = pd.read_csv(path)
        values = set()
        for column in frame.select_dtypes("number"):
            for v in frame[column].dropna():
                values |= {float(v), 100 * float(v)}
        for v in frame.select_dtypes(exclude="number").to_numpy().ravel():
            values |= {float(n) for n in numbers(str(v))}
        return values
    return {float(n) for n in numbers(path.read_text())}


def shown(value: str, candidates: set[float]) -> bool:
    """Whether some candidate, rounded to the decimals `value` shows, is `value`."""
    decimals = len(value.split(".")[1]) if "." in value else 0
    target = float(value)
    tolerance = 0.5 * 10**-decimals + 1e-9
    return any(math.isfinite(c) and abs(c - target) <= tolerance for c in candidates)


PAGE_TABLES = [(page, line, sources, rows) for page in PAGES for line, sources, rows in tables(page)]


def test_the_pages_have_tables_of_figures():
    assert len(PAGE_TABLES) >= 5


@pytest.mark.parametrize(
    "page, line, sources, rows",
    PAGE_TABLES,
    ids=[f"{page.relative_to(ROOT)}:{line}" for page, line, _, _ in PAGE_TABLES],
)
def test_every_figure_has_its_committed_report(page, line, sources, rows):
    where = f"{page.relative_to(ROOT)}:{line}"
    assert sources, f"{where}: a table of figures without a <!-- source: report --> line above it"
    paths = [ROOT / s for s in sources]
    missing = [str(p.relative_to(ROOT)) for p in paths if not p.is_file()]
    assert not missing, f"{where}: its sources are not in the repository: {missing}"
    candidates = set().union(*(source_values(p) for p in paths))
    unsourced = [n for row in rows for n in numbers(row) if not shown(n, candidates)]
    assert not unsourced, f"{where}: figures found in none of {sources}: {unsourced}"


def test_a_stale_figure_fails(tmp_path):
    """The check can fail: a figure its report does not hold is found out."""
    report = tmp_path / "r.csv"
    pd.DataFrame({"backend": ["sdpa"], "output_throughput": [750.9], "hit": [0.834]}).to_csv(report, index=False)
    values = source_values(report)
    assert shown("751", values) and shown("750.9", values) and shown("83.4", values)
    assert not shown("903", values) and not shown("48.4", values) and not shown("751.2", values)
