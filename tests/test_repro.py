"""Every report row's `repro` command: run again, it measures the same row (same settings, same
grid point); how settings and knobs become flags."""

import glob
import shlex

import pandas as pd
import pytest

from pagedbench.bench.report_schema import SETTING_COLUMNS
from pagedbench.bench.report_tables import console_table
from pagedbench.bench.repro import flag, kernel_repro, knob_settings, scenario_flags
from pagedbench.bench.scenario import LengthRange, load_scenario
from pagedbench.entrypoints.cli.main import main
from pagedbench.entrypoints.cli.run import WORKLOAD_OVERRIDES

KERNEL_GRID = ["variant", "phase", "query_len", "batch_size", "context_len", "block_size", "num_heads"]
KERNEL_GRID += ["num_kv_heads", "head_dim", "kv_cache_dtype", "backend", "device", "dtype", "warmup", "repeats"]
KERNEL_GRID += ["cache_blocks", "placement"]
CHECK_GRID = ["case", "batch", "heads", "head_dim", "block_size", "variant", "backend", "dtype", "device"]


def report(out, suffix=".csv") -> pd.DataFrame:
    (path,) = [p for p in glob.glob(f"{out}/*{suffix}") if not p.endswith(("-requests.csv", "-kv.csv"))]
    return pd.read_csv(path)


def rerun(repro: str, out) -> pd.DataFrame:
    words = shlex.split(repro)
    assert words[0] == "pagedbench"
    assert main([*words[1:], "--out", str(out)]) in (0, 1)  # check exits 1 where a case fails
    return report(out)


def test_flags_of_settings():
    assert flag("enable_prefix_caching", False) == ["--no-enable-prefix-caching"]
    assert flag("speculative_config", {"method": "ngram", "num_speculative_tokens": 3}) == [
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3}',
    ]
    assert flag("input_len", LengthRange(8, 8)) == ["--input-len", "8"]


def test_scenario_flags_name_only_what_differs():
    base = load_scenario("synthetic").scaled(0.5)
    changed = base.replace(block_size=32, output_len=LengthRange(4, 4))
    words = scenario_flags("synthetic", 0.5, changed, WORKLOAD_OVERRIDES)
    assert words[:4] == ["--scenario", "synthetic", "--scale", "0.5"]
    assert "--block-size" in words and words[words.index("--block-size") + 1] == "32"
    assert words[words.index("--output-len") + 1] == "4"
    assert "--max-num-seqs" not in words and "--input-len" not in words  # the scenario's own
    assert scenario_flags("synthetic", 0.5, base, WORKLOAD_OVERRIDES) == [
        "--scenario", "synthetic", "--scale", "0.5", "--model", base.engine.model, "--seed", str(base.engine.seed),
    ]  # fmt: skip


def test_flash_attn_row_names_its_provider(monkeypatch):
    monkeypatch.delenv("PAGEDBENCH_FLASH_PROVIDER", raising=False)
    monkeypatch.setenv("PAGEDBENCH_FLEX_TUNE", "0")
    assert knob_settings("flash-attn", "flash_attn_interface (FA3) 3.0.0") == [
        "PAGEDBENCH_FLEX_TUNE=0",
        "PAGEDBENCH_FLASH_PROVIDER=fa3",
    ]
    assert knob_settings("flash-attn", "flash_attn 2.8.3") == [
        "PAGEDBENCH_FLEX_TUNE=0",
        "PAGEDBENCH_FLASH_PROVIDER=fa2",
    ]
    assert knob_settings("sdpa", "torch SDPA") == ["PAGEDBENCH_FLEX_TUNE=0"]


def test_kernel_row_command_is_its_grid_point():
    row = {"backend": "sdpa", "provider": "", "variant": "plain", "phase": "decode", "query_len": 1}
    row |= {"batch_size": 4, "context_len": 1024, "num_heads": 16, "num_kv_heads": 8, "head_dim": 64}
    row |= {"block_size": 16, "kv_cache_dtype": "auto", "warmup": 2, "repeats": 7, "device": "cpu", "dtype": "float32"}
    words = shlex.split(kernel_repro(row))
    assert words[:4] == ["pagedbench", "kernels", "--backends", "sdpa"]
    assert words[words.index("--heads") + 1] == "16/8"
    assert words[words.index("--max-kv-tokens") + 1] == str(4 * 1024)  # the point itself passes every limit
    assert "--cuda-graphs" not in words and "--cache-blocks" not in words  # a row without them: the defaults
    placed = shlex.split(kernel_repro({**row, "cache_blocks": 4096, "placement": "contiguous"}))
    assert placed[placed.index("--cache-blocks") + 1] == "4096"
    assert placed[placed.index("--placement") + 1] == "contiguous"
    gdn = {**row, "backend": "gdn-torch", "variant": "gdn", "linear_attention_kernel": "torch"}
    del gdn["block_size"], gdn["warmup"], gdn["repeats"]  # a DeltaNet row has no pages; an unavailable one no timing
    words = shlex.split(kernel_repro(gdn))
    assert words[2:4] == ["--linear-kernels", "torch"] and "--block-sizes" not in words and "--backends" not in words


@pytest.mark.slow
def test_run_row_reproduces_its_settings(tmp_path):
    first = tmp_path / "first"
    args = ["run", "--backend", "sdpa", "--scenario", "synthetic", "--scale", "0.05", "--num-prompts", "3"]
    args += ["--input-len", "8", "--output-len", "4", "--block-size", "8", "--no-enable-prefix-caching"]
    assert main([*args, "--device", "cpu", "--no-warmup", "--out", str(first)]) == 0
    row = report(first).iloc[0]
    assert "--block-size 8" in row["repro"] and "--no-enable-prefix-caching" in row["repro"]
    again = rerun(row["repro"], tmp_path / "again").iloc[0]
    same = [*SETTING_COLUMNS, "backend", "device", "dtype", "scenario", "scenario_hash", "scale", "num_requests"]
    assert again[same].to_dict() == pytest.approx(row[same].to_dict(), nan_ok=True)
    assert again["repro"] == row["repro"]
    md = (first / "run-synthetic.md").read_text()
    assert "`repro` column" in md and "pagedbench run --backend" not in md  # CSV only
    assert "repro" not in console_table(report(first), cross_backend=False)


@pytest.mark.slow
def test_kernels_row_reproduces_its_grid_point(tmp_path):
    args = ["kernels", "--backends", "sdpa", "--batch-sizes", "1,2", "--context-lens", "32", "--block-sizes", "16"]
    args += ["--heads", "2/1", "--head-dim", "16", "--phases", "decode", "--warmup", "0", "--repeats", "1"]
    args += ["--cache-blocks", "64", "--placement", "contiguous"]
    assert main([*args, "--device", "cpu", "--out", str(tmp_path / "first")]) == 0
    row = report(tmp_path / "first").query("backend == 'sdpa' and batch_size == 2").iloc[0]
    assert "--cache-blocks 64" in row["repro"] and "--placement contiguous" in row["repro"]
    again = rerun(row["repro"], tmp_path / "again")
    assert len(again) == 2  # the point's dense yardstick and its backend row
    assert again.query("backend == 'sdpa'").iloc[0][KERNEL_GRID].to_dict() == row[KERNEL_GRID].to_dict()


@pytest.mark.slow
def test_check_row_reproduces_its_case(tmp_path):
    args = ["check", "--backends", "sdpa", "--dtypes", "float32", "--quick", "--device", "cpu"]
    main([*args, "--out", str(tmp_path / "first")])
    row = report(tmp_path / "first").iloc[0]
    assert shlex.split(row["repro"])[:6] == ["pagedbench", "check", "--backends", "sdpa", "--dtypes", "float32"]
    again = rerun(row["repro"], tmp_path / "again")
    match = again[again["case"] == row["case"]].iloc[0]
    assert match[CHECK_GRID].to_dict() == pytest.approx(row[CHECK_GRID].to_dict(), nan_ok=True)
