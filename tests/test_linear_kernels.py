"""Hybrid models' gated delta rule as a swappable kernel (linear_attention_kernel, model/delta_rule.py):
torch (transformers' torch forms, a sequence at a time) and fla (flash-linear-attention's Triton
kernels, a step's sequences in one varlen call; Triton's interpreter on CPU). Greedy tokens equal
Hugging Face's through fla, check's gated DeltaNet cases pass for both against a float64 oracle,
fla is refused in one line where it cannot run, and reports name the kernel."""

from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from pagedbench import LLM, SamplingParams
from pagedbench.bench.check_linear import build_linear_cases, run_linear_case
from pagedbench.model import delta_rule
from tests.conftest import hf_greedy

CPU = torch.device("cpu")
PROMPTS = [[5, 17, 33, 42, 8, 9, 100, 7], list(range(10, 50))]
MAX_TOKENS = 6


def require(kernel: str) -> None:
    """Skip, saying why, where `kernel` cannot run on this CPU (fla not installed, say)."""
    reason = delta_rule.fla_unavailable_reason("cpu") if kernel == "fla" else None
    if reason:
        pytest.skip(f"fla cannot run here: {reason}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "setting",
    [
        dict(num_blocks=14, block_size=4, max_num_batched_tokens=16, max_model_len=48),  # recompute
        dict(num_blocks=14, block_size=4, max_num_batched_tokens=16, max_model_len=48, preemption_mode="swap"),
        dict(num_blocks=64, block_size=4, max_num_batched_tokens=16, tensor_parallel_size=2),
    ],
    ids=["recompute", "swap", "chunked-tp2"],
)
def test_fla_greedy_tokens_under_preemption_chunks_and_tensor_parallelism(hybrid_models, setting):
    """fla under a tight KV budget (preempted, then recomputed from a snapshot or swapped out with its
    state moved to a CPU slot and back), and in 16-token chunks at TP 2 (the long prompt over three steps
    beside the other's decodes, each rank's key heads through fla's varlen kernels): HF's greedy tokens
    (fla's kernels through Triton's interpreter), and every state slot back."""
    require("fla")
    path, hf = hybrid_models["qwen3.5"]
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    llm = LLM(path, backend="sdpa", device="cpu", dtype="float32", linear_attention_kernel="fla", **setting)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        if "preemption_mode" in setting:
            assert llm.engine.stats.swap_outs > 0
        elif "max_model_len" in setting:
            assert sum(o.metrics.num_preemptions for o in outs) > 0
        runner = llm.engine.runner
        assert getattr(runner, "local", runner).linear_states.kernel == "fla"
        bm = llm.engine.block_manager
        assert bm.state_slots.num_free == bm.num_state_slots
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kernel", ["torch", "fla"])
def test_check_cases_pass_against_the_float64_oracle(kernel):
    """Chunked prefill with a snapshot a later prompt resumes from, decodes, a ragged batch: fp32."""
    require(kernel)
    rows = [row for case in build_linear_cases([torch.float32]) for row in run_linear_case(case, [kernel], CPU)]
    assert [r["batch"] for r in rows] == ["chunked prefill", "decode", "ragged batch"]
    for row in rows:
        assert row["status"] == "pass", row
        assert row["backend"] == f"gdn-{kernel}" and row["linear_attention_kernel"] == kernel
        assert row["max_abs_error"] < 1e-4 and row["max_abs_error"] <= row["tolerance"]


def test_check_command_runs_only_the_named_kernels(tmp_path, capsys):
    from pagedbench.entrypoints.cli.main import main

    args = ["check", "--backends", "gdn-torch", "--device", "cpu", "--dtypes", "fp32", "--out", str(tmp_path)]
    assert main(args) == 0
    rows = pd.read_csv(tmp_path / "check.csv")
    assert set(rows["backend"]) == {"gdn-torch"} and (rows["status"] == "pass").all() and len(rows) == 3
    assert set(rows["linear_attention_kernel"]) == {"torch"} and "gdn-torch" in capsys.readouterr().out
    assert main([*args[:2], "gdn-nope", *args[3:]]) == 2  # a one-line error naming the kernels


def test_fla_refused_in_one_line_when_it_cannot_run(hybrid_models, no_fla, tmp_path, capsys):
    path, _ = hybrid_models["qwen3.5"]
    reason = delta_rule.fla_unavailable_reason("cpu")
    assert reason == "fla not installed (pip install 'pagedbench[fla]')"
    with pytest.raises(ValueError, match=r"^linear_attention_kernel fla: fla not installed") as raised:
        LLM(path, device="cpu", num_blocks=32, linear_attention_kernel="fla")
    assert "\n" not in str(raised.value)
    assert "not mps" in delta_rule.fla_unavailable_reason("mps")
    with pytest.raises(ValueError, match="linear_attention_kernel must be 'torch' or 'fla'"):
        LLM(path, device="cpu", num_blocks=32, linear_attention_kernel="cuda")
    # check skips fla's cases, saying why
    row = run_linear_case(build_linear_cases([torch.float32])[0], ["fla"], CPU)[0]
    assert row["status"] == "skipped" and row["reason"] == reason


def test_the_torch_kernel_is_transformers_torch_form_even_with_fla_installed():
    """With fla installed, transformers' torch_* functions call fla's kernels (its hub fallback):
    the torch kernel takes their torch bodies."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    chunked, recurrent = delta_rule.torch_delta_rule()
    assert chunked.__module__ == recurrent.__module__ == hf.__name__
    assert chunked.__name__ == "torch_chunk_gated_delta_rule" and not hasattr(chunked, "__wrapped__")


def test_reports_name_the_kernel_of_hybrid_models_only(hybrid_models):
    from pagedbench.bench.compare import linear_kernel_column
    from pagedbench.bench.report_schema import CHECK_COLUMNS, KERNEL_COLUMNS, SERVING_COLUMNS, SETTING_COLUMNS
    from pagedbench.config import EngineConfig
    from pagedbench.model.config import ModelConfig

    assert "linear_attention_kernel" in SETTING_COLUMNS and SERVING_COLUMNS.count("linear_attention_kernel") == 1
    assert "linear_attention_kernel" in KERNEL_COLUMNS and "linear_attention_kernel" in CHECK_COLUMNS
    hybrid = ModelConfig.from_dir(Path(hybrid_models["qwen3.5"][0]))
    dense = SimpleNamespace(linear=None)
    config = EngineConfig(linear_attention_kernel="fla")
    assert linear_kernel_column(SimpleNamespace(model_config=hybrid, config=config)) == {
        "linear_attention_kernel": "fla"
    }
    assert linear_kernel_column(SimpleNamespace(model_config=dense, config=config)) == {"linear_attention_kernel": ""}


@pytest.mark.slow
def test_run_rows_name_the_kernel(hybrid_models, tmp_path):
    from pagedbench.entrypoints.cli.main import main

    path, _ = hybrid_models["qwen3.5"]
    args = ["run", "--model", path, "--scenario", "synthetic", "--scale", "0.0625", "--backend", "sdpa"]
    assert main([*args, "--linear-attention-kernel", "torch", "--repeats", "1", "--out", str(tmp_path)]) == 0
    row = pd.read_csv(tmp_path / "run-synthetic.csv").iloc[0]
    assert row["linear_attention_kernel"] == "torch" and row["linear_attention_share"] > 0


@pytest.mark.parametrize("kernel", ["torch", "fla"])
def test_kernels_times_the_deltanet_layer_per_kernel(kernel):
    """`kernels --variants gdn`: a row per kernel that names it; fla on CPU timed once, with its caveat."""
    require(kernel)
    from pagedbench.bench.kernels import KernelGrid, run_kernels

    grid = KernelGrid(
        batch_sizes=[2], context_lens=[8], block_sizes=[16], heads=[(4, 2)], head_dim=16, phases=["mixed"],
        max_kv_tokens=1 << 12, max_query_tokens=1 << 12, warmup=1, repeats=2, variants=["gdn"],
        linear_kernels=[kernel],
    )  # fmt: skip
    (row,) = run_kernels([], grid, "cpu", "float32")
    assert row["backend"] == f"gdn-{kernel}" and row["linear_attention_kernel"] == kernel and row["status"] == "ok"
    assert row["forward_median_ms"] > 0 and row["num_query_tokens"] == 2 + 8
    assert (row["repeats"] == 1 and "interpreter" in row["reason"]) if kernel == "fla" else row["reason"] == ""
