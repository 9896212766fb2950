"""EngineConfig is the one typed source of engine settings: LLM(**kwargs), the serve command's
flags and validation all come from its fields."""

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pagedbench.config
from pagedbench import LLM, EngineConfig
from pagedbench.entrypoints.cli.main import build_parser


def test_every_field_is_a_flag_with_its_type_and_choices():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--block-size", "32", "--no-enable-prefix-caching", "--scheduling-policy", "priority"])
    config = EngineConfig.from_cli_args(args, model="m")
    assert (config.block_size, config.enable_prefix_caching, config.scheduling_policy) == (32, False, "priority")
    defaults = EngineConfig.from_cli_args(parser.parse_args([]), model="m")
    assert defaults == EngineConfig(model="m")  # the flags' defaults are the dataclass's
    with pytest.raises(SystemExit):
        parser.parse_args(["--preemption-mode", "drop"])
    serve = build_parser().parse_args(["serve", "tiny-llama", "--swap-space", "2", "--preemption-mode", "swap"])
    assert EngineConfig.from_cli_args(serve).swap_space == 2.0
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= set(vars(serve))


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(block_size="16"), TypeError, "block_size must be int, got '16'"),
        (dict(enable_prefix_caching="yes"), TypeError, "enable_prefix_caching must be bool"),
        (dict(max_num_seqs=0), ValueError, "max_num_seqs must be >= 1, got 0"),
        (dict(scheduling_policy="lifo"), ValueError, "scheduling_policy must be 'fcfs' or 'priority'"),
        (dict(gpu_memory_utilization=-0.5), ValueError, "gpu_memory_utilization must be >= 0"),
        (dict(max_num_batchd_tokens=8), TypeError, "unknown engine argument 'max_num_batchd_tokens'"),
    ],
)
def test_llm_refuses_bad_settings_naming_them(kwargs, error, message):
    with pytest.raises(error, match=message):
        LLM("tiny-llama", device="cpu", **kwargs)


# A setting defined once (one line in config.py's EngineConfig), then everything derived from it.
ONE_NEW_SETTING = r"""
import pathlib, sys, types
import pandas as pd
source = pathlib.Path(sys.argv[1]).read_text()
anchor = "    def validate(self) -> None:"
line = '    my_new_setting: int = setting(7, "a setting added in one place", minimum=0)\n\n'
module = types.ModuleType("pagedbench.config")
module.__file__ = sys.argv[1]
sys.modules["pagedbench.config"] = module
exec(compile(source.replace(anchor, line + anchor, 1), sys.argv[1], "exec"), module.__dict__)

from pagedbench import LLM
from pagedbench.bench.scenario import parse_scenario
from pagedbench.entrypoints.cli.main import build_parser, main

llm = LLM("tiny-llama", my_new_setting=3, num_blocks=8)
assert llm.llm_engine.config.my_new_setting == 3
parser = build_parser()
for command in (["run"], ["compare"], ["serve", "tiny-llama"], ["profile"]):
    args = parser.parse_args([*command, "--my-new-setting", "5"])
    assert args.my_new_setting == 5, command
base = {"description": "d", "num_prompts": 2, "input_len": 8, "output_len": 2, "kv_tokens": 256}
mine = parse_scenario(base | {"engine": {"model": "tiny-llama", "my_new_setting": 3}}, "mine")
assert mine.engine.my_new_setting == 3
assert mine.content_hash() != parse_scenario(base | {"engine": {"model": "tiny-llama"}}, "mine").content_hash()
try:
    parse_scenario(base | {"engine": {"my_new_setting": -1}}, "bad")
    raise AssertionError("a bad value passed")
except ValueError as e:
    assert str(e) == "scenario 'bad': my_new_setting must be >= 0, got -1", e
out = sys.argv[2]
argv = ["run", "--num-prompts", "2", "--output-len", "2", "--my-new-setting", "4", "--out", out, "--no-warmup"]
assert main(argv) == 0
row = pd.read_csv(next(pathlib.Path(out).glob("run-synthetic*.csv"))).iloc[0]
assert row["my_new_setting"] == 4, row
print("one setting, four places: ok")
"""


@pytest.mark.slow
def test_a_setting_added_once_reaches_llm_flags_scenarios_and_reports(tmp_path):
    """Adds one field to EngineConfig's source (in a fresh interpreter) and finds it in LLM(), in
    run/compare/serve/profile's flags, in a scenario's [engine] table (validated, hashed) and as a
    report column of a real run."""
    script = tmp_path / "one_setting.py"
    script.write_text(ONE_NEW_SETTING)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), pagedbench.config.__file__, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "one setting, four places: ok" in done.stdout


def test_every_environment_knob_is_defined_once_and_documented():
    """Every PAGEDBENCH_* name the code uses is a knob of envs.py (or an older name of one), read
    through it (no os.environ reads of them elsewhere), and docs/usage.md's table lists each."""
    import re

    from pagedbench import envs

    root = Path(pagedbench.config.__file__).parents[1]
    sources = [p for d in ("pagedbench", "backends") for p in (root / d).rglob("*.py") if p.name != "envs.py"]
    used = {name for p in sources for name in re.findall(r"PAGEDBENCH_[A-Z_]+", p.read_text())}
    assert used <= set(envs.KNOBS) | set(envs.RENAMED), used - set(envs.KNOBS)
    direct = [p.name for p in sources if re.search(r"environ(\.get)?[\[(]\s*[\"']PAGEDBENCH_", p.read_text())]
    assert not direct, f"read PAGEDBENCH_* knobs through envs.get: {direct}"
    docs = (root / "docs" / "usage.md").read_text()
    assert all(f"| `{name}` |" in docs for name in envs.KNOBS)


def test_a_knob_outside_its_choices_is_a_one_line_error(monkeypatch, caplog):
    from pagedbench import envs

    monkeypatch.setenv("PAGEDBENCH_FLEX_KERNEL", "cute")
    with pytest.raises(ValueError, match=r"^PAGEDBENCH_FLEX_KERNEL='cute' is not one of triton, flash$"):
        envs.get("PAGEDBENCH_FLEX_KERNEL")
    monkeypatch.setenv("PAGEDBENCH_FLEX_KERNEL", " Flash ")
    assert envs.get("PAGEDBENCH_FLEX_KERNEL") == "flash"
    monkeypatch.delenv("PAGEDBENCH_CACHE_DIR", raising=False)
    monkeypatch.setenv("PAGEDBENCH_CACHE", "/tmp/old-cache")
    with caplog.at_level("WARNING", logger="pagedbench.envs"):
        assert envs.cache_dir() == Path("/tmp/old-cache")
    assert "PAGEDBENCH_CACHE is deprecated: set PAGEDBENCH_CACHE_DIR instead" in caplog.text
