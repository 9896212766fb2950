"""EngineConfig is the one typed source of engine settings: LLM(**kwargs), the serve command's
flags and validation all come from its fields."""

import argparse
import dataclasses

import pytest

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
