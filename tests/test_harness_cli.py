"""`pagedbench compare / run / kernels` end to end on the tiny preset at a tiny scale: the CSV
schema, identical greedy tokens between reference and sdpa, online arrivals, one-line errors."""

import os
import re
import subprocess
import sys

import pandas as pd
import pytest
import torch
from pagedbench.backends import registry
from pagedbench.backends.sdpa import SDPABackend

from pagedbench.bench.noise import NO_INTERVAL
from pagedbench.bench.report_schema import KERNEL_COLUMNS, SERVING_COLUMNS
from pagedbench.engine.stats import TIME_COLUMNS
from pagedbench.entrypoints.cli.main import main

# Columns that scripts and notebooks read: the schema (report.py) must keep them.
RELIED_ON = {
    "serving": {
        "backend",
        "provider",
        "device_name",
        "load_average",
        "scenario_hash",
        "num_blocks",
        "output_throughput",
    }
    | {"median_ttft_ms", "p99_tpot_ms", "preemptions", "time_forward_s", "identical_token_share", "reason"},
    "kernels": {"backend", "phase", "batch_size", "context_len", "block_size", "head_dim", "forward_min_ms"}
    | {"bandwidth_gbps", "pct_of_peak_bandwidth", "tile_efficiency"},
}


class TeapotBackend(SDPABackend):
    name = "teapot"

    @classmethod
    def unavailable_reason(cls, device, dtype, head_dim, block_size, **kwargs):
        return "needs a teapot"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Functional tests: one intra-op thread keeps them fast when other processes share the
    cores (two threads then wait on each other's time slices)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def compared(tmp_path_factory, one_thread):
    """reference, sdpa and an unavailable backend on `mixed` (greedy, fp32) at scale 0.02."""
    out = tmp_path_factory.mktemp("compare")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(registry._loaded, "teapot", TeapotBackend)
        code = main(
            [
                "compare",
                "--backends",
                "reference,sdpa,teapot",
                "--scenario",
                "mixed",
                "--scale",
                "0.02",
                "--model",
                "tiny-llama",
                "--device",
                "cpu",
                "--dtype",
                "fp32",
                "--repeats",
                "2",
                "--out",
                str(out),
            ]
        )
    assert code == 0
    return out, pd.read_csv(out / "compare-mixed.csv")


def test_compare_csv_has_exactly_the_schema(compared):
    out, df = compared
    assert list(df.columns) == SERVING_COLUMNS and RELIED_ON["serving"] <= set(SERVING_COLUMNS)
    ok = df[df["status"] == "ok"]
    assert list(ok["backend"]) == ["reference", "reference", "sdpa", "sdpa"] and list(ok["repeat"]) == [0, 1, 0, 1]
    spec = {"spec_acceptance_rate", "spec_mean_acceptance_length", "spec_acceptance_per_position"}
    moe = {"num_experts", "experts_per_token", "moe_kernel", "time_moe_s", "moe_share"}
    moe |= {"time_linear_attention_s", "linear_attention_share", "linear_attention_kernel"}  # empty: no DeltaNet
    moe |= {"time_indexer_s", "indexer_share"}  # empty without a sparse (DeepSeek-V3.2) model's indexer
    moe |= {"mamba_block_size"}  # empty without a hybrid's state snapshots (their count and bytes are 0)
    interval = {"output_throughput_ci_low", "output_throughput_ci_high"}  # 2 runs: none (noise.py)
    own = {"dataset_name", "dataset_path"}  # empty without a dataset of the user's
    own |= {"busy_share", "cuda_version", "driver_version"}  # empty on a CPU (no device timer, no CUDA)
    own |= {"flash_attn_version", "flashinfer_version"}  # empty where not installed
    own |= {"identical_alone"}  # empty without --alone-check
    own |= {"tokenizer", "pipeline_layer_partition", "num_state_snapshots", "structured_outputs_config"}  # unset
    assert (
        ok[sorted(set(SERVING_COLUMNS) - {"reason", "request_rate"} - spec - moe - interval - own)].notna().all().all()
    )
    assert ok[sorted(interval)].isna().all().all() and (ok["ranking"] == NO_INTERVAL).all()
    assert (ok["speculative"] == "off").all() and ok[sorted(spec)].isna().all().all()  # empty without speculation
    assert ok[sorted(moe)].isna().all().all()  # a dense, attention-only model
    assert ok["scenario_hash"].nunique() == 1 and ok["num_blocks"].nunique() == 1  # one KV budget for all
    assert (ok["num_requests"] == 5).all() and ok["total_output_tokens"].nunique() == 1


def test_compare_lists_unavailable_backend_with_its_reason(compared):
    out, df = compared
    teapot = df[df["backend"] == "teapot"]
    assert list(teapot["status"]) == ["unavailable"] and list(teapot["reason"]) == ["needs a teapot"]
    assert "needs a teapot" in (out / "compare-mixed.md").read_text()


def test_greedy_tokens_identical_between_reference_and_sdpa(compared):
    _, df = compared
    ok = df[df["status"] == "ok"]
    assert (ok["identical_token_share"] == 1.0).all()
    assert ok["throughput_vs_best"].max() == 1.0


def test_compare_writes_markdown_and_plots(compared):
    out, _ = compared
    for name in (
        "compare-mixed.md",
        "compare-mixed-throughput.png",
        "compare-mixed-latency-cdf.png",
        "compare-mixed-requests.csv",
        "compare-mixed-kv.csv",
        "compare-mixed-kv-utilization.png",
    ):
        assert (out / name).stat().st_size > 0
    requests = pd.read_csv(out / "compare-mixed-requests.csv")
    assert len(requests) == 2 * 2 * 5 and requests["ttft_ms"].gt(0).all()
    kv = pd.read_csv(out / "compare-mixed-kv.csv")
    assert set(kv["backend"]) == {"reference", "sdpa"} and kv["kv_utilization"].between(0, 1).all()
    assert kv.groupby(["backend", "repeat"])["step"].is_monotonic_increasing.all() and kv["used_blocks"].max() > 0


def test_online_run_adds_requests_at_their_arrival_times(tmp_path, capsys):
    assert (
        main(
            [
                "run",
                "--scenario",
                "online",
                "--scale",
                "0.03",
                "--model",
                "tiny-llama",
                "--no-warmup",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert "| sdpa " in capsys.readouterr().out
    from pagedbench.bench.scenario import build_requests, load_scenario

    last_arrival = build_requests(load_scenario("online").scaled(0.03), 32000)[-1].arrival_time
    row = pd.read_csv(tmp_path / "run-online.csv").iloc[0]
    assert row["arrival"] == "poisson" and row["num_requests"] == 6 and row["duration_s"] >= last_arrival


def test_kernels_csv_schema_and_report(tmp_path, capsys):
    assert (
        main(
            [
                "kernels",
                "--backends",
                "reference,sdpa",
                "--batch-sizes",
                "2",
                "--context-lens",
                "40",
                "--heads",
                "4/2",
                "--head-dim",
                "16",
                "--warmup",
                "0",
                "--repeats",
                "2",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert "| sdpa " in capsys.readouterr().out
    df = pd.read_csv(tmp_path / "kernels.csv")
    assert list(df.columns) == KERNEL_COLUMNS and RELIED_ON["kernels"] <= set(KERNEL_COLUMNS)
    assert sorted(df["phase"].unique()) == ["decode", "mixed", "prefill"] and (df["status"] == "ok").all()
    assert (df["bandwidth_gbps"] > 0).all() and (df["forward_min_ms"] <= df["forward_median_ms"]).all()
    assert (tmp_path / "kernels-bandwidth.png").stat().st_size > 0
    # Yardsticks at every point: the unpaged SDPA row, and the measured copy bandwidth.
    dense = df[df["backend"] == "dense-sdpa"]
    assert len(dense) == 3 and (dense["vs_dense"] == 1).all()
    paged = df[df["backend"] != "dense-sdpa"]
    assert (paged["vs_dense"] > 0).all() and (df["copy_bandwidth_gbps"] > 0).all()
    assert (df["pct_of_copy_bandwidth"] - 100 * df["bandwidth_gbps"] / df["copy_bandwidth_gbps"]).abs().max() < 1e-6


@pytest.mark.parametrize("cached,new", [(0, 1), (7, 1), (0, 9), (7, 9)])
def test_dense_yardstick_attends_causally_bottom_right(cached, new):
    from pagedbench.bench.kernels import dense_calls

    ((q, k, v, mask, causal),) = dense_calls([(cached, new)] * 2, 4, 2, 8, torch.float32, torch.device("cpu"))
    assert q.shape == (2, 4, new, 8) and k.shape == (2, 2, cached + new, 8)
    got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    kk, vv = (t.repeat_interleave(2, dim=1) for t in (k, v))
    scores = q @ kk.transpose(-1, -2) / 8**0.5
    visible = torch.arange(cached + new)[None, :] <= cached + torch.arange(new)[:, None]
    expected = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ vv
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "args,message",
    [
        (["kernels", "--heads", "3/2"], "query heads must be a multiple of KV heads"),
        (["kernels", "--batch-sizes", "1,x"], "batch_sizes must be integers"),
        (["kernels", "--heads", "16"], "heads must be 2 integers separated by '/'"),
        (["run", "--repeats", "0"], "repeats must be >= 1"),
        (["run", "--scenario", "long-context", "--model", "tiny-llama", "--scale", "0.5"], "longest request needs"),
        (["run", "--scenario", "nope"], "neither a file nor a built-in scenario"),
        (["run", "--scale", "-2"], "scale must be a positive number"),
        (["run", "--num-blocks", "0"], "num_blocks must be > 0"),
    ],
)
def test_more_errors_in_process(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pagedbench: error: ") and message in err and "\n" not in err


@pytest.mark.slow
def test_cli_errors_are_one_line_without_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('description = "x"\nnum_prompts = 2\ninput_len = 4\noutput_len = 2\nkv_tokens = 64\nwarp = 9\n')
    cases = [
        (["run", "--scenario", str(bad)], "warp is not a scenario field"),
        (["compare", "--backends", "sdpa,nope", "--scenario", "mixed"], "unknown backend 'nope'"),
        (["run", "--scale", "0"], "scale must be a positive number"),
    ]
    # OMP_NUM_THREADS set: no thread-choice notice, which three processes starting at once (each
    # seeing the others' cores busy) would otherwise print beside the error.
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pagedbench", *args, "--out", str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args, _ in cases
    ]
    for proc, (args, message) in zip(procs, cases):
        _, stderr = proc.communicate(timeout=120)
        lines = stderr.strip().splitlines()
        assert proc.returncode != 0 and "Traceback" not in stderr, (args, stderr)
        assert len(lines) == 1 and message in lines[0], (args, stderr)


def test_a_cut_kernels_run_keeps_its_rows(monkeypatch, tmp_path, capsys):
    """Ctrl-C or SIGTERM (a time limit) mid-grid: the rows measured so far stay in the CSV, rendered."""
    from pagedbench.bench import kernels

    timed = []

    def time_then_stop(*args):
        if len(timed) == 3:
            raise KeyboardInterrupt
        timed.append(args)
        return {"forward_median_ms": 1.0}

    monkeypatch.setattr(kernels, "_time_backend", time_then_stop)
    code = main(
        [
            "kernels",
            "--backends",
            "reference,sdpa",
            "--phases",
            "decode",
            "--batch-sizes",
            "1,2",
            "--context-lens",
            "16,32",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 130 and "interrupted after 5 rows" in capsys.readouterr().err  # 3 timed + 2 dense yardsticks
    rows = pd.read_csv(tmp_path / "kernels.csv")
    assert len(rows) == 5 and (rows["status"] == "ok").all() and (tmp_path / "kernels.md").exists()
    assert (rows["backend"] == "dense-sdpa").sum() == 2


def test_device_time_columns(compared):
    """Device time (forward + sampler spans), attention's share of the eager forward, and the
    engine overhead: consistent with the step wall time of the same run."""
    _, df = compared
    ok = df[df["status"] == "ok"]
    wall = ok[TIME_COLUMNS].sum(axis=1)
    assert ((ok["time_device_s"] > 0) & (ok["time_device_s"] <= wall)).all()
    assert ((ok["time_attention_s"] > 0) & (ok["time_attention_s"] < ok["time_forward_s"])).all()
    assert ok["attention_share"].between(0, 1, inclusive="neither").all()
    assert (ok["engine_overhead_share"] - (1 - ok["time_device_s"] / wall)).abs().max() < 1e-9


def test_device_timer_is_off_unless_enabled():
    """An engine that serves forever must not collect spans nobody reads."""
    from pagedbench.device.timer import DeviceTimer

    timer = DeviceTimer(torch.device("cpu"))
    timer.span("forward", timer.mark())
    assert timer.totals() == {}
    timer.enabled = True
    start = timer.mark()
    timer.span("forward", start)
    timer.span("forward", start)
    assert set(timer.totals()) == {"forward"} and timer.totals()["forward"] >= 0


def test_enforce_eager_is_a_run_setting_outside_the_workload_hash(tmp_path, compared):
    """`--enforce-eager` (graphs on and off on the same requests) is recorded, not hashed."""
    _, df = compared
    ok = df[df["status"] == "ok"]
    assert (ok["cuda_graphs"] == "off: no CUDA device (device is cpu)").all() and not ok["enforce_eager"].any()
    code = main(
        ["run", "--scenario", "mixed", "--scale", "0.02", "--model", "tiny-llama", "--device", "cpu"]
        + ["--dtype", "fp32", "--no-warmup", "--enforce-eager", "--out", str(tmp_path)]
    )
    assert code == 0
    eager = pd.read_csv(tmp_path / "run-mixed.csv")
    assert eager["enforce_eager"].all() and (eager["cuda_graphs"] == "off: enforce_eager").all()
    assert eager["scenario_hash"].iloc[0] == ok["scenario_hash"].iloc[0]


def test_kernels_variants_count_only_the_keys_a_window_reaches():
    """A window-1024 decode at context 2048 must read half the keys (its bytes and FLOPs say so);
    variant rows have no unpaged yardstick (plain SDPA computes something else)."""
    from dataclasses import replace

    from pagedbench.bench.kernels import GRID_PRESETS, run_kernels

    grid = replace(
        GRID_PRESETS["cpu"], batch_sizes=[1], context_lens=[2048], phases=["decode"], heads=[(4, 2)], head_dim=16,
        warmup=0, repeats=1, variants=["plain", "window-1024", "softcap-50", "sinks"],
    )  # fmt: skip
    df = pd.DataFrame(run_kernels(["sdpa"], grid, "cpu", "float32"))
    sdpa = df[df["backend"] == "sdpa"].set_index("variant")
    assert (sdpa["status"] == "ok").all() and set(sdpa.index) == {"plain", "window-1024", "softcap-50", "sinks"}
    assert sdpa.loc["window-1024", "kv_bytes"] * 2 == sdpa.loc["plain", "kv_bytes"]
    assert sdpa.loc["window-1024", "flops"] * 2 == sdpa.loc["plain", "flops"]
    assert list(df.loc[df["backend"] == "dense-sdpa", "variant"]) == ["plain"]
    assert sdpa.loc["plain", "vs_dense"] > 0 and sdpa.drop("plain")["vs_dense"].isna().all()


def test_interpreted_backends_are_timed_only_when_named(tmp_path, capsys):
    """On CPU, Triton runs in its interpreter: `kernels` without --backends leaves it out and says
    why; named, it is timed once and its rows carry the caveat."""
    from pagedbench.backends.registry import get_backend

    if get_backend("triton").unavailable_reason("cpu", torch.float32, 16, 16):
        pytest.skip("triton not installed")
    grid = ["--batch-sizes", "1", "--context-lens", "16", "--heads", "2/1", "--head-dim", "16", "--phases", "decode"]
    assert main(["kernels", *grid, "--warmup", "0", "--repeats", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "triton not timed by default on cpu: Triton interpreter" in out
    assert "triton" not in set(pd.read_csv(tmp_path / "kernels.csv")["backend"])
    assert main(["kernels", *grid, "--backends", "triton,sdpa", "--out", str(tmp_path), "--overwrite"]) == 0
    rows = pd.read_csv(tmp_path / "kernels.csv").set_index("backend")
    assert rows.loc["triton", "status"] == "ok" and "interpreter" in rows.loc["triton", "reason"]
    assert rows.loc["triton", "repeats"] == 1 and "triton: caveat: Triton interpreter" in capsys.readouterr().out


def test_backends_prints_the_capability_table(capsys):
    assert main(["backends", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "| sliding window" in out and "| soft-cap" in out and "| sinks" in out
    assert "reference: dtypes float32, bfloat16, float16; KV block sizes" in out
    table = [line for line in out.splitlines() if line.startswith("| CUDA graphs")][0]
    assert table.count("✓") >= 2 and "✗ " in table  # flex and triton capture; reference and sdpa say why (numbered)
    assert re.search(r"^\d+\. it attends one sequence at a time", out, re.M)


def test_nothing_measured_is_not_success(tmp_path, capsys):
    """compare where no backend runs writes its report and exits 1; --backends naming none is a
    one-line error (exit 2)."""
    args = ["compare", "--num-prompts", "1", "--input-len", "4", "--output-len", "2", "--out", str(tmp_path)]
    assert main([*args, "--backends", "flash-attn"]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("pagedbench: error: no backend ran: flash-attn: no CUDA device") and len(err.splitlines()) == 1
    )
    assert (tmp_path / "compare-synthetic.csv").exists()
    assert main([*args, "--backends", " , "]) == 2
    assert capsys.readouterr().err == "pagedbench: error: --backends ' , ' names no backend\n"


def test_bench_serve_with_every_request_failed_exits_1(tmp_path, capsys):
    args = ["bench-serve", "--base-url", "http://127.0.0.1:9", "--model", "tiny-llama", "--num-prompts", "2"]
    assert main([*args, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "pagedbench: error: every request to http://127.0.0.1:9 failed: nothing was measured"
    assert (tmp_path / "bench-serve-online.csv").exists()  # the report of what happened is kept


def test_a_second_run_never_replaces_the_first(tmp_path, capsys):
    """Same command, same --out: the second writes kernels-2.*, the third kernels-3.*; --overwrite
    replaces kernels.* on purpose."""
    grid = ["kernels", "--backends", "sdpa", "--batch-sizes", "1", "--context-lens", "16", "--heads", "2/1"]
    grid += ["--head-dim", "16", "--phases", "decode", "--warmup", "0", "--repeats", "1", "--out", str(tmp_path)]
    assert main(grid) == 0
    first = (tmp_path / "kernels.csv").read_bytes()
    assert main(grid) == 0 and main(grid) == 0
    assert (tmp_path / "kernels.csv").read_bytes() == first
    assert (tmp_path / "kernels-2.csv").exists() and (tmp_path / "kernels-3.md").exists()
    assert "kernels.csv is an earlier run's; writing kernels-2.*" in capsys.readouterr().out
    assert main([*grid, "--overwrite"]) == 0 and not (tmp_path / "kernels-4.csv").exists()


def test_a_second_compare_leaves_the_first_in_place(tmp_path):
    args = ["compare", "--backends", "sdpa", "--num-prompts", "1", "--input-len", "4", "--output-len", "2"]
    args += ["--no-warmup", "--out", str(tmp_path)]
    assert main(args) == 0
    first = {p.name: p.read_bytes() for p in tmp_path.glob("compare-synthetic*")}
    assert main(args) == 0
    assert {p.name: p.read_bytes() for p in tmp_path.glob("compare-synthetic*") if p.name in first} == first
    assert (tmp_path / "compare-synthetic-2.csv").exists() and (tmp_path / "compare-synthetic-2-requests.csv").exists()


def test_threads_sets_and_records_torch_threads(tmp_path, capsys):
    before = torch.get_num_threads()
    grid = ["kernels", "--backends", "sdpa", "--batch-sizes", "1", "--context-lens", "16", "--heads", "2/1"]
    grid += ["--head-dim", "16", "--phases", "decode", "--warmup", "0", "--repeats", "1", "--out", str(tmp_path)]
    try:
        assert main([*grid, "--threads", "1"]) == 0
        assert (pd.read_csv(tmp_path / "kernels.csv")["cpu_threads"] == 1).all()
    finally:
        torch.set_num_threads(before)
    assert main([*grid, "--threads", "0"]) == 2
    assert capsys.readouterr().err.startswith("pagedbench: error: --threads must be in 1..")


def test_a_swallowed_sigterm_is_raised_again(monkeypatch, tmp_path, capsys):
    """SIGTERM becomes a KeyboardInterrupt wherever the main thread is; one raised inside a finalizer
    (torch.compile's weakref callbacks) is swallowed, so it is raised again until the command stops."""
    import os
    import signal
    import time

    from pagedbench.bench import kernels

    timed, swallowed = [], []

    def time_then_swallow(*args):
        if len(timed) == 1:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            except KeyboardInterrupt:
                swallowed.append(True)  # as a finalizer would; the next one must still stop the run
            time.sleep(10)
        timed.append(args)
        return {"forward_median_ms": 1.0}

    monkeypatch.setattr(kernels, "_time_backend", time_then_swallow)
    start = time.monotonic()
    args = ["kernels", "--backends", "reference", "--phases", "decode", "--batch-sizes", "1,2", "--context-lens", "16"]
    code = main([*args, "--out", str(tmp_path)])
    assert code == 130 and swallowed and time.monotonic() - start < 8
    assert "interrupted after" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_timer_on_cuda_times_the_device_not_one_launch():
    """time_kernel queues its calls (no sync between them): one per repeat, each the GPU time of
    a known copy, which at 2 x 1 GiB cannot beat any GPU's memory."""
    from pagedbench.bench.timing import time_kernel

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = time_kernel(lambda: dst.copy_(src), torch.device("cuda"), warmup=1, repeats=5)
    assert len(times) == 5 and all(2 * src.numel() / t < 20e12 for t in times)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["kernels", "--backends", "flash-attn", "--batch-sizes", "2", "--context-lens", "32", "--phases", "decode"],
            "pagedbench: error: kernels timed no backend, only the dense yardstick: flash-attn: unavailable: no CUDA",
        ),
        (
            ["kernels", "--backends", "flex", "--kv-cache-dtype", "int8", "--batch-sizes", "2", "--context-lens", "32"],
            "pagedbench: error: kernels timed no backend, only the dense yardstick: flex: unavailable: kv_cache_dtype",
        ),
        (
            ["check", "--backends", "flash-attn"],
            "pagedbench: error: check ran no case, every one was skipped: flash-at",
        ),
        (
            ["check", "--backends", "flex", "--kv-cache-dtype", "int8"],
            "pagedbench: error: check measured no KV quality: flex int8: kv_cache_dtype int8: ",
        ),
    ],
    ids=["kernels-unavailable", "kernels-kv-unreadable", "check-all-skipped", "check-kv-unreadable"],
)
def test_measuring_nothing_exits_1_with_one_line(args, message, tmp_path, capsys):
    """Every measuring command that measured nothing it was asked for says why in one line and
    exits 1 (its report is still written)."""
    assert main([*args, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(message), err
    assert list(tmp_path.iterdir())  # the report of what happened is kept


def test_check_kv_skips_an_unavailable_backend_among_others(tmp_path, capsys):
    """`check --kv-cache-dtype` over several backends skips one that cannot run here with its
    reason, as plain check does, and measures the rest (exit 0)."""
    args = ["check", "--kv-cache-dtype", "int8", "--backends", "sdpa,flash-attn", "--out", str(tmp_path)]
    assert main(args) == 0
    frame = pd.read_csv(next(tmp_path.glob("check-kv*.csv")))
    status = dict(zip(frame["backend"], frame["status"]))
    assert status == {"sdpa": "ok", "flash-attn": "unavailable"}
    assert frame.loc[frame["backend"] == "flash-attn", "reason"].str.startswith("kv_cache_dtype int8: ").all()


def test_a_cut_compare_keeps_finished_runs_and_names_the_cut_backends(monkeypatch, tmp_path, capsys):
    """Ctrl-C in a backend's second run: its first run and every earlier backend's runs stay in the
    reports, and the terminal, the .md and the exit message name what was cut and what never ran."""
    from pagedbench.bench import compare as compare_module

    measure = compare_module.measure

    def measure_then_stop(engine, requests, desc):
        if desc == "reference run 2/3":
            raise KeyboardInterrupt
        return measure(engine, requests, desc)

    monkeypatch.setattr(compare_module, "measure", measure_then_stop)
    args = ["compare", "--backends", "sdpa,reference,flex", "--num-prompts", "2", "--input-len", "8", "--output-len"]
    code = main([*args, "2", "--repeats", "3", "--no-warmup", "--device", "cpu", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 130 and "cut: reference: interrupted after 1 of 3 runs" in err
    rows = pd.read_csv(tmp_path / "compare-synthetic.csv")
    ok = rows[rows["status"] == "ok"]
    assert list(ok["backend"]) == ["sdpa"] * 3 + ["reference"] and ok["ranking"].notna().all()
    cut = rows[rows["status"] == "cut"].set_index("backend")["reason"]
    assert cut.to_dict() == {
        "reference": "interrupted after 1 of 3 runs",
        "flex": "not run: reference interrupted before it",
    }
    assert "reference: cut: interrupted after 1 of 3 runs" in out and "flex: cut: not run" in out
    md = (tmp_path / "compare-synthetic.md").read_text()
    assert "Not run or cut short" in md and "interrupted after 1 of 3 runs" in md
    assert len(pd.read_csv(tmp_path / "compare-synthetic-requests.csv")) == 4 * 2  # 3 + 1 runs of 2 requests


def test_a_failing_backend_keeps_the_runs_before_it(monkeypatch, tmp_path, capsys):
    """A backend's RuntimeError stops the compare like Ctrl-C: reports first, then the error itself."""
    from pagedbench.bench import compare as compare_module

    measure = compare_module.measure

    def measure_then_fail(engine, requests, desc):
        if desc == "reference run 1/2":
            raise RuntimeError("out of teapots")
        return measure(engine, requests, desc)

    monkeypatch.setattr(compare_module, "measure", measure_then_fail)
    args = ["compare", "--backends", "sdpa,reference", "--num-prompts", "1", "--input-len", "8", "--output-len", "2"]
    with pytest.raises(RuntimeError, match="out of teapots"):
        main([*args, "--repeats", "2", "--no-warmup", "--device", "cpu", "--out", str(tmp_path)])
    rows = pd.read_csv(tmp_path / "compare-synthetic.csv")
    assert list(rows["status"]) == ["ok", "ok", "cut"]
    assert rows["reason"].iloc[-1] == "failed after 0 of 2 runs: RuntimeError: out of teapots"
    assert "reference: cut: failed after 0 of 2 runs: RuntimeError: out of teapots" in capsys.readouterr().out


def fits_a_terminal(text: str, tmp_path) -> list[str]:
    """The lines of a command's output wider than 120 columns (a line naming a written file excepted)."""
    return [line for line in text.splitlines() if len(line) > 120 and str(tmp_path) not in line]


@pytest.mark.slow  # whole commands
def test_every_commands_terminal_output_fits_120_columns_width(tmp_path, capsys):
    """kernels, profile, kv-calc and check --loglikelihood as run, bench-serve's table from its rows:
    settings every row shares on a line above, the first columns, a line naming those left out."""
    from pagedbench.bench.report_schema import BENCH_SERVE_COLUMNS, SERVE_LATENCIES
    from pagedbench.entrypoints.cli.serve import _write_bench_serve

    grid = ["--phases", "decode,prefill", "--batch-sizes", "1,2", "--context-lens", "16", "--heads", "2/1"]
    commands = [
        ["kernels", "--backends", "sdpa", *grid, "--head-dim", "16", "--repeats", "3", "--out", str(tmp_path / "k")],
        ["profile", "--batch-sizes", "2", "--context", "16", "--steps", "1", "--warmup", "1"],
        ["kv-calc", "qwen3.5-0.8b", "--kv-cache-dtype", "auto,fp8,int8"],
        ["check", "--loglikelihood", "--backends", "sdpa", "--kv-cache-dtype", "auto,fp8", "--out", str(tmp_path)],
    ]
    for argv in commands:
        assert main(argv) == 0, argv
        out = capsys.readouterr().out
        assert "| " in out and not fits_a_terminal(out, tmp_path), (argv[0], fits_a_terminal(out, tmp_path))
    row = dict.fromkeys(BENCH_SERVE_COLUMNS, "") | {"backend": "http://127.0.0.1:8000/v1 (tiny-llama)"}
    row |= {"request_rate": 4.0, "completed": 32, "failed": 0, "request_throughput": 3.9, "output_throughput": 250.5}
    row |= {"goodput": 3.5} | {name: 12.345 for name in SERVE_LATENCIES}
    _write_bench_serve([row, row | {"request_rate": 8.0}], tmp_path / "bench-serve", "url", "tiny-llama", "mixed")
    out = capsys.readouterr().out
    assert re.search(r"\|\s+8(\.0)?\s+\|", out) and not fits_a_terminal(out, tmp_path), fits_a_terminal(out, tmp_path)
