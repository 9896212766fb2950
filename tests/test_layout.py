"""The package's rooms: no import cycles, and no module imports from a room above its own
(entry points -> bench -> engine -> worker -> model / sample -> backends -> device / config)."""

import ast
import graphlib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {
    "pagedbench": ROOT / "pagedbench",
    "pagedbench.backends": ROOT / "backends",
    "pagedbench.scenarios": ROOT / "scenarios",
}
# A room may import only rooms of a lower rank. The package root (__init__, __main__) is the top.
RANK = {
    "config": 0,
    "envs": 0,
    "device": 0,
    "scenarios": 0,
    "backends": 1,
    "model": 2,
    "sample": 2,
    "worker": 3,
    "engine": 4,
    "bench": 5,
    "entrypoints": 6,
    "": 7,
    "__main__": 7,
}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = [*package.split("."), *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every pagedbench module `name` imports, at any depth of its code (lazy imports too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t == "pagedbench" or t.startswith("pagedbench.")}
    return out - {name}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


GRAPH = {name: imports(name, path, modules()) for name, path in modules().items()}


def test_every_room_is_ranked():
    assert {room(m) for m in GRAPH} <= set(RANK), "a new room needs its place in RANK"


def test_no_import_cycles():
    try:
        graphlib.TopologicalSorter(GRAPH).prepare()
    except graphlib.CycleError as e:
        pytest.fail(f"import cycle: {' -> '.join(e.args[1])}")


def test_rooms_import_only_downwards():
    upward = [
        f"{m} ({room(m) or 'root'}) imports {t} ({room(t) or 'root'})"
        for m, targets in GRAPH.items()
        for t in targets
        if room(t) != room(m) and RANK[room(t)] >= RANK[room(m)]
    ]
    assert not upward, "\n".join(upward)


def test_every_room_is_installed():
    """A plain `pip install .` ships only the packages pyproject lists."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {m for m, p in modules().items() if p.name == "__init__.py"}
    assert packages == listed


MAX_CLASS_LINES, MAX_FUNCTION_LINES = 250, 80


def is_triton_kernel(node: ast.AST) -> bool:
    """A Triton kernel (jit-decorated, or jitted later: it reads tl.program_id), exempt from the size rule."""
    if isinstance(node, ast.ClassDef):
        return False
    return any("jit" in ast.unparse(d) for d in node.decorator_list) or "tl.program_id" in ast.unparse(node)


def oversized() -> list[str]:
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or is_triton_kernel(node):
                continue
            lines = node.end_lineno - node.lineno + 1
            limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
            if lines > limit:
                found.append(f"{name}.{node.name}: {lines} lines (at most {limit})")
    return found


def test_no_class_over_250_lines_and_no_function_over_80():
    """The house's size rules over pagedbench/ and backends/ (docstrings count; Triton kernels exempt)."""
    assert not oversized(), "\n".join(oversized())


def test_the_size_rule_sees_a_long_function(tmp_path, monkeypatch):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n")
    monkeypatch.setitem(SOURCES, "pagedbench.scratch", tmp_path)
    assert "pagedbench.scratch.long.long: 81 lines (at most 80)" in oversized()
