"""Probing never crashes: broken or half-installed packages on the path (FA4's empty `flash_attn`
namespace package, a module that raises at import, a third-party backend that fails to load)
leave every command and test collection working, each broken part saying why."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pagedbench.backends import registry

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    """A site directory holding what breaks naive probing:
    - flash_attn/cute/ and no flash_attn/__init__.py (how flash-attn-4 installs), whose
      __init__ raises RuntimeError (FA4 importing on a machine without a CUDA driver);
    - flash_attn_interface.py raising OSError (FA3 built against a missing CUDA library);
    - a distribution registering backend `broken` under `pagedbench.backends`, whose module raises."""
    site = tmp_path_factory.mktemp("site")
    (site / "flash_attn" / "cute").mkdir(parents=True)
    (site / "flash_attn" / "cute" / "__init__.py").write_text("raise RuntimeError('cutlass: no CUDA driver found')\n")
    (site / "flash_attn_interface.py").write_text("raise OSError('libcudart.so.12: cannot open shared object file')\n")
    (site / "broken_backend.py").write_text("1 / 0\n")
    dist = site / "broken_backend-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-backend\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[pagedbench.backends]\nbroken = broken_backend:Backend\n")
    return site


def run(planted: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(planted), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_commands_work_and_say_why(planted, tmp_path):
    script = textwrap.dedent(f"""
        from pagedbench.entrypoints.cli.main import main
        for argv in (["backends", "--device", "cpu"],
                     ["kernels", "--device", "cpu", "--backends", "sdpa,flash-attn,broken", "--phases", "decode",
                      "--batch-sizes", "2", "--context-lens", "32", "--block-sizes", "16", "--heads", "4/2",
                      "--warmup", "0", "--repeats", "1", "--out", {str(tmp_path / "k")!r}],
                     ["compare", "--device", "cpu", "--backends", "sdpa,flash-attn,broken", "--num-prompts", "2",
                      "--input-len", "8", "--output-len", "2", "--no-warmup", "--out", {str(tmp_path / "c")!r}]):
            print("exit", main(argv), flush=True)
    """)
    result = run(planted, "-c", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("exit 0") == 3, result.stdout + result.stderr
    backends_out = " ".join(result.stdout.split("exit 0")[0].split("\n\n")[0].split())  # a backend a line, wrapped
    assert "sdpa: available, " in backends_out
    flash = backends_out[backends_out.index("flash-attn: ") : backends_out.index("flashinfer: ")]
    assert flash.startswith("flash-attn: unavailable, ")
    assert "fa3: import flash_attn_interface: OSError: libcudart.so.12: cannot open shared object file" in flash
    assert "fa4: import flash_attn.cute: RuntimeError: cutlass: no CUDA driver found" in flash
    assert "fa2: flash_attn is an empty namespace package" in flash
    broken = backends_out[backends_out.index("broken: ") : backends_out.index("flash-attn: ")]
    assert broken.strip() == (
        "broken: unavailable, none; failed to load broken_backend:Backend: ZeroDivisionError: division by zero"
    ), broken
    assert (tmp_path / "k" / "kernels.csv").exists() and any((tmp_path / "c").glob("compare-*.csv"))
    import pandas as pd

    kernels = pd.read_csv(tmp_path / "k" / "kernels.csv").set_index("backend")
    assert kernels.loc["sdpa", "status"] == "ok" and kernels.loc["broken", "status"] == "unavailable"
    assert "ZeroDivisionError" in kernels.loc["broken", "reason"]
    serving = pd.read_csv(tmp_path / "c" / "compare-synthetic.csv")
    status = dict(zip(serving["backend"], serving["status"]))
    assert status == {"sdpa": "ok", "flash-attn": "unavailable", "broken": "unavailable"}


@pytest.mark.slow
def test_test_collection_survives(planted):
    result = run(
        planted,
        "-m",
        "pytest",
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/test_backends.py",  # (parametrized by every registered backend)
        "tests/test_flash_attn.py",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "tests collected" in result.stdout and "ERROR" not in result.stdout
    assert "test_backends.py::test_random_ragged_batches_match_the_oracle[broken" in result.stdout  # named, not lost


def test_broken_backend_in_process(monkeypatch):
    """The same, without a subprocess: a stand-in class that is unavailable, names the error,
    and refuses to be built; the engine reports it as one ValueError."""
    from importlib.metadata import EntryPoint

    from pagedbench.config import EngineConfig
    from pagedbench.engine.llm_engine import LLMEngine

    ep = EntryPoint("broken", "tests.no_such_module:Backend", "pagedbench.backends")
    monkeypatch.setattr(registry, "entry_points", lambda group: [ep])
    monkeypatch.delitem(registry._loaded, "broken", raising=False)
    cls = registry.get_backend("broken")
    provider, reason = registry.probe(cls, "cpu", None, 64, 16)
    assert provider == "none"
    assert (
        reason
        == "failed to load tests.no_such_module:Backend: ModuleNotFoundError: No module named 'tests.no_such_module'"
    )
    with pytest.raises(ValueError, match="backend 'broken' is unavailable here: failed to load"):
        LLMEngine(EngineConfig(model="tiny-llama", backend="broken", device="cpu"))
    registry._loaded.pop("broken")


def test_a_backend_whose_probe_raises_is_unavailable():
    from pagedbench.backends.sdpa import SDPABackend

    class Exploding(SDPABackend):
        name = "exploding"

        @classmethod
        def unavailable_reason(cls, *args, **kwargs):
            raise KeyError("cuda")

        @classmethod
        def provider(cls, **settings):
            raise RuntimeError("no version")

    assert registry.probe(Exploding, "cpu", None, 64, 16) == (
        "none (RuntimeError: no version)",
        "probing failed: KeyError: 'cuda'",
    )
