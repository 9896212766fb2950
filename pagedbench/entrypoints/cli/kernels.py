"""`pagedbench kernels`, `check` and `backends`: the attention backends on their own -- timed on a
grid, held to a dense oracle, and what each runs here."""

import argparse
import dataclasses
import functools
import sys
import textwrap
from pathlib import Path

import pandas as pd
import torch

from pagedbench.backends.base import KV_CACHE_DTYPES
from pagedbench.config import EngineConfig
from pagedbench.device.dtypes import dtype_name, resolve_device_dtype
from pagedbench.entrypoints.cli.common import (
    NothingMeasured,
    add_overwrite_flag,
    add_threads_flag,
    backend_names,
    int_list,
    keep_partial,
    positive_ints,
    prepare_out_dir,
    report_stem,
    timed_backend_names,
    warn_if_busy,
)


def cmd_kernels(args) -> None:
    from pagedbench.bench.kernels import DENSE, GDN, GRID_PRESETS, run_kernels
    from pagedbench.bench.ranks import reporting_rank
    from pagedbench.bench.report import CsvLog, tidy, write_reports
    from pagedbench.bench.report_tables import KERNEL_FIRST, fit_terminal, kernel_table, not_run_lines
    from pagedbench.bench.repro import kernel_repro

    prepare_out_dir(args.out)
    if args.replay:
        return cmd_replay(args)
    device, _ = resolve_device_dtype(args.device, args.dtype)
    warn_if_busy(device)
    grid = dataclasses.replace(GRID_PRESETS[args.preset or ("gpu" if device.type == "cuda" else "cpu")])
    for name in ("batch_sizes", "context_lens", "block_sizes", "query_lens", "suffix_lens"):
        if getattr(args, name):
            setattr(grid, name, int_list(getattr(args, name), name))
    if args.heads:
        grid.heads = [int_list(pair, "heads", sep="/", length=2) for pair in args.heads.split(",")]
    if args.phases:
        grid.phases = args.phases.split(",")
    if args.variants:
        grid.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if GDN in grid.variants:
        grid.linear_kernels = timed_linear_kernels(args.linear_kernels, device)
    if args.kv_cache_dtype:
        grid.kv_cache_dtypes = [k.strip() for k in args.kv_cache_dtype.split(",") if k.strip()]
    for name in ("head_dim", "max_kv_tokens", "max_query_tokens", "warmup", "repeats"):
        if getattr(args, name) is not None:
            setattr(grid, name, getattr(args, name))
    grid.cuda_graphs = args.cuda_graphs
    grid.batch_invariant = args.batch_invariant
    grid.cache_blocks, grid.placement = args.cache_blocks, args.placement
    stem = report_stem(args.out, "kernels", args.overwrite)
    # Under torchrun, rank 0 alone writes the CSV (the others hand it their rows).
    log = CsvLog(args.out, stem, "kernels", "kernels", kernel_repro) if reporting_rank() else []
    with keep_partial(log):
        run_kernels(
            timed_backend_names(args.backends, args.device, args.dtype), grid, args.device, args.dtype, rows=log
        )
    if not reporting_rank():  # under torchrun: rank 0 has every rank's rows
        return
    kernels = tidy(log, "kernels", "kernels")
    print("\n".join([*fit_terminal(kernel_table(kernels), KERNEL_FIRST), *not_run_lines(kernels)]))
    paths = write_reports({"kernels": kernels}, args.out, stem)
    print(f"reports: {', '.join(map(str, paths))}")
    if not ((kernels["backend"] != DENSE) & (kernels["status"] == "ok")).any():
        why = "; ".join(not_run_lines(kernels))
        raise NothingMeasured(f"kernels timed no backend, only the dense yardstick: {why}")


def cmd_replay(args) -> None:
    """`kernels --replay`: each recording's steps through each backend (bench/replay.py)."""
    from pagedbench.bench.replay import ReplayOptions, replay_table, run_replay, write_replay_reports
    from pagedbench.bench.report_tables import markdown

    paths = [p.strip() for p in args.replay.split(",") if p.strip()]
    if args.export_flashinfer_bench:
        return export_workloads(paths, args.export_flashinfer_bench)
    options = ReplayOptions(args.warmup if args.warmup is not None else 1, args.repeats or 3, args.device, args.dtype)
    options.cold = args.cold_caches
    if min(options.warmup, options.repeats - 1) < 0:
        raise ValueError("--warmup must be >= 0 and --repeats >= 1")
    summary, per_step = run_replay(paths, timed_backend_names(args.backends, args.device, args.dtype), options)
    stem = report_stem(args.out, "replay", args.overwrite)
    written = write_replay_reports(summary, per_step, args.out, stem)
    frame = pd.DataFrame(summary)
    print(markdown(replay_table(frame)))
    for row in frame[frame["status"] != "ok"].itertuples():
        print(f"not run: {row.backend}: {row.reason}")
    print(f"reports: {', '.join(map(str, written))}")
    if not (frame["status"] == "ok").any():
        raise NothingMeasured("kernels --replay timed no backend")


def export_workloads(paths: list[str], out_dir: str) -> None:
    """`kernels --replay ... --export-flashinfer-bench DIR` (bench/replay_export.py)."""
    from pagedbench.bench.replay_export import export_flashinfer_bench

    for path in paths:
        written, count = export_flashinfer_bench(path, out_dir)
        print(f"{path}: {count} decode steps as workloads in {written}")


def backends_or_kernels(text: str | None, kernels: list[str]) -> list[str]:
    """check's --backends: as named, or every registered backend and every gated DeltaNet kernel."""
    return backend_names(text) + (kernels if text is None else [])


def timed_linear_kernels(text: str | None, device: torch.device) -> list[str]:
    """--linear-kernels (variant gdn): as named, or by default each kernel whose timings here are a
    kernel's speed (fla interpreted on CPU is left out, saying so; named, it runs)."""
    from pagedbench.config import LINEAR_ATTENTION_KERNELS
    from pagedbench.model.delta_rule import timing_caveat

    if text is not None:
        return [k.strip() for k in text.split(",") if k.strip()]
    timed = []
    for kernel in LINEAR_ATTENTION_KERNELS:
        caveat = timing_caveat(kernel, device)
        if caveat:
            print(f"pagedbench: note: gdn-{kernel} not timed by default on {device.type}: {caveat} "
                  f"(--linear-kernels {kernel} times it)")  # fmt: skip
        else:
            timed.append(kernel)
    return timed


def cmd_check(args) -> int:
    from pagedbench.bench.check import TOLERANCE_FACTOR, TOLERANCE_FLOOR, engine_check, run_check, summary
    from pagedbench.bench.check_linear import linear_kernel_names, run_linear_check, split_backends
    from pagedbench.bench.environment import environment
    from pagedbench.bench.ranks import reporting_rank
    from pagedbench.bench.report import EnvCsvLog, tidy, write_reports
    from pagedbench.bench.repro import check_repro

    prepare_out_dir(args.out)
    if args.determinism:
        return check_determinism(args)
    if args.batch_sizes:
        raise ValueError("--batch-sizes sets check --determinism's batches; the grid's are fixed (--quick, --full)")
    if args.loglikelihood:
        return check_loglikelihood(args)
    if args.kv_cache_dtype:
        return check_kv_quality(args)
    if args.index_cache_dtype:
        return check_index_quality(args)
    device, _ = resolve_device_dtype(args.device, None)
    names = args.dtypes or ("fp32,bf16" if device.type == "cpu" else "bf16,fp16,fp32")
    dtypes = [resolve_device_dtype(args.device, name.strip())[1] for name in names.split(",") if name.strip()]
    env = environment(device, dtypes[0])
    # gdn-<kernel> names the gated DeltaNet cases' kernels (check_linear.py); by default every one runs
    backends, kernels = split_backends(backends_or_kernels(args.backends, linear_kernel_names()))
    stem = report_stem(args.out, "check", args.overwrite)
    repro = functools.partial(check_repro, grid_flags=check_grid_flags(args))
    log = EnvCsvLog(env, args.out, stem, "check", "check", repro) if reporting_rank() else []
    with keep_partial(log):
        if backends:
            run_check(backends, device, dtypes, full=args.full, rows=log)
        if not reporting_rank():  # under torchrun: rank 0 has every rank's rows (and runs the engine check)
            return 0
        if kernels:
            log += run_linear_check(kernels, device, dtypes)
        if args.engine or args.full:
            log += engine_check(backends, device, dtypes, model=args.model or "tiny-llama", compile=args.compile)
    rows = list(log)
    print(
        f"device {env['device_name']}, torch {torch.__version__}, {'full' if args.full else 'quick'} grid, "
        f"dtypes {', '.join(dtype_name(d) for d in dtypes)}"
    )
    print(
        f"tolerance: {TOLERANCE_FACTOR:g} x the error of the naive computation in each dtype + "
        + ", ".join(f"{dtype_name(d)} {f:g}" for d, f in TOLERANCE_FLOOR.items())
    )
    print(summary(rows))
    paths = write_reports({"check": tidy(rows, "check", "check")}, args.out, stem)
    print(f"reports: {', '.join(map(str, paths))}")
    if not any(row["status"] in ("pass", "fail") for row in rows):
        skipped = dict.fromkeys(f"{row['backend']}: {row['reason']}" for row in rows)
        raise NothingMeasured(f"check ran no case, every one was skipped: {'; '.join(skipped)}")
    failed = sum(row["status"] == "fail" for row in rows)
    if failed:
        print(f"pagedbench: check failed: {failed} case(s)", file=sys.stderr)
    return 1 if failed else 0


def check_grid_flags(args) -> list[str]:
    """The flags of this check that choose its cases (each row's repro keeps them)."""
    words = ["--full"] if args.full else []
    words += ["--engine"] if args.engine else []
    words += ["--model", args.model] if args.model else []
    words += [] if args.compile is None else ["--compile" if args.compile else "--no-compile"]
    return words


def check_determinism(args) -> int:
    """`check --determinism`: per backend, dtype, phase and variant, the same call twice bitwise equal,
    and each sequence's output bitwise the same alone, moved, and inside batches of other sizes."""
    from pagedbench.bench.check_determinism import run_determinism
    from pagedbench.bench.environment import environment
    from pagedbench.bench.report import EnvCsvLog, tidy, write_reports
    from pagedbench.bench.report_tables import DETERMINISM_FIRST, determinism_table, fit_terminal

    device, _ = resolve_device_dtype(args.device, None)
    names = args.dtypes or ("fp32,bf16" if device.type == "cpu" else "bf16,fp16,fp32")
    dtypes = [resolve_device_dtype(args.device, name.strip())[1] for name in names.split(",") if name.strip()]
    sizes = tuple(positive_ints(args.batch_sizes, "--batch-sizes")) if args.batch_sizes else None
    env = environment(device, dtypes[0])
    stem = report_stem(args.out, "check-determinism", args.overwrite)
    log = EnvCsvLog(env, args.out, stem, "determinism", "check")  # each row as it comes: a cut run keeps them
    with keep_partial(log):
        run_determinism(backend_names(args.backends), device, dtypes, batch_sizes=sizes, rows=log,
                        batch_invariant=bool(args.batch_invariant))  # fmt: skip
    frame = tidy(log, "determinism", "check")
    print(textwrap.fill(f"device {env['device_name']}, torch {torch.__version__}: bitwise, the same call twice, "
                        "and each sequence alone against itself on other pages and in other batches", 120))  # fmt: skip
    print("\n".join(fit_terminal(determinism_table(frame), DETERMINISM_FIRST)))
    paths = write_reports({"determinism": frame}, args.out, stem)
    print(f"reports: {', '.join(map(str, paths))}")
    if not (frame["status"] != "skipped").any():
        skipped = dict.fromkeys(f"{row.backend}: {row.reason}" for row in frame.itertuples())
        raise NothingMeasured(f"check --determinism ran nothing, every row was skipped: {'; '.join(skipped)}")
    failed = int((frame["status"] == "fail").sum())
    if failed:
        print(f"pagedbench: check --determinism failed: {failed} row(s)", file=sys.stderr)
    return 1 if failed else 0


def check_loglikelihood(args) -> int:
    """`check --loglikelihood`: multiple-choice log-likelihoods (lm-eval's scoring) per backend and
    page dtype against `reference` with unquantized pages."""
    from pagedbench.backends.base import kv_storage_dtype
    from pagedbench.bench.loglikelihood import loglikelihood_check
    from pagedbench.bench.report_tables import TERMINAL_COLUMNS, terminal_table

    kv_dtypes = [k.strip() for k in (args.kv_cache_dtype or "auto").split(",") if k.strip()]
    for kv in kv_dtypes:
        if kv != "auto":
            kv_storage_dtype(kv, torch.float32)  # an unknown name fails here, naming the known ones
    model = args.model or "py-byte-target"
    dtype = (args.dtypes or "fp32").split(",")[0]
    table = pd.DataFrame(loglikelihood_check(backend_names(args.backends), kv_dtypes, model, args.device, dtype))
    print(
        textwrap.fill(
            f"log-likelihood of multiple-choice continuations, {model} over held-out text, {dtype}: each backend "
            "and page dtype against reference with unquantized pages (mean |delta logprob| per choice token, "
            "chosen-answer agreement)",
            TERMINAL_COLUMNS,
        )
    )
    ok = table[table["status"] == "ok"].drop(columns=["model", "status", "reason"], errors="ignore")
    print(terminal_table(ok.round(6), ["backend", "kv_cache_dtype", "mean_abs_dlogprob", "argmax_agreement"]))
    for row in table[table["status"] != "ok"].itertuples():
        print(f"not run: {row.backend} {row.kv_cache_dtype}: {row.reason}")
    return write_quality_table(table, args, "check-loglikelihood", "log-likelihood")


def check_kv_quality(args) -> int:
    """`check --kv-cache-dtype`: each backend's quantized cache against its unquantized one."""
    from pagedbench.backends.base import kv_storage_dtype
    from pagedbench.bench.kv_quality import MILESTONE, kv_quality
    from pagedbench.bench.report_tables import terminal_table

    kv_dtypes = [k.strip() for k in args.kv_cache_dtype.split(",") if k.strip() and k.strip() != "auto"]
    for kv in kv_dtypes:
        kv_storage_dtype(kv, torch.float32)  # an unknown name fails here, naming the known ones
    model = args.model or "py-byte-target"
    dtype = (args.dtypes or "fp32").split(",")[0]
    rows = kv_quality(backend_names(args.backends), kv_dtypes, model, args.device, dtype)
    table = pd.DataFrame(rows)
    print(
        f"KV cache quality, {model} teacher-forced over held-out text, {dtype}: each backend's quantized pages "
        f"against its own unquantized ones (milestone: {MILESTONE})"
    )
    print(terminal_table(table.drop(columns=["model"]).round(5), ["backend", "kv_cache_dtype"]))
    return write_quality_table(table, args, "check-kv", "KV quality")


def check_index_quality(args) -> int:
    """`check --index-cache-dtype fp8`: a sparse (DeepSeek-V3.2) model's selections with fp8 index keys
    against 16-bit ones, per backend."""
    from pagedbench.bench.kv_quality import index_key_quality
    from pagedbench.bench.report_tables import terminal_table

    if args.index_cache_dtype != "fp8":
        raise ValueError(f"--index-cache-dtype {args.index_cache_dtype!r}: only fp8 is measured (against auto)")
    model = args.model or "deepseek-v3.2"
    dtype = (args.dtypes or "fp32").split(",")[0]
    rows = [index_key_quality(model, name, args.device, dtype) | {"status": "ok", "kv_cache_dtype": "auto"}
            for name in backend_names(args.backends or "sdpa")]  # fmt: skip
    table = pd.DataFrame(rows)
    print(
        f"Index-key quality, {model} teacher-forced over held-out text, {dtype}: the top-k each query keeps with "
        "fp8 index keys (a scale per token) against keys in the model's dtype, where its past exceeds the top-k"
    )
    shown = [
        "backend",
        "topk",
        "queries",
        "contested_queries",
        "topk_overlap",
        "min_topk_overlap",
        "mean_kl",
        "top1_agreement",
    ]
    print(terminal_table(table[shown].round(4), shown))
    return write_quality_table(table, args, "check-index", "index-key quality")


def write_quality_table(table: pd.DataFrame, args, stem: str, what: str) -> int:
    """A per-backend-and-page-dtype check's CSV in --out; NothingMeasured when no row ran."""
    path = Path(args.out) / f"{report_stem(args.out, stem, args.overwrite)}.csv"
    table.to_csv(path, index=False)
    print(f"reports: {path}")
    if not (table["status"] == "ok").any():
        unavailable = dict.fromkeys(f"{row.backend} {row.kv_cache_dtype}: {row.reason}" for row in table.itertuples())
        raise NothingMeasured(f"check measured no {what}: {'; '.join(unavailable)}")
    return 0


def cmd_backends(args) -> None:
    from pagedbench.backends.registry import list_backends, resolve

    device, dtype = resolve_device_dtype(args.device, args.dtype)
    rows = []
    for name in list_backends():
        _, _, provider, reason = resolve(name, device, dtype, args.head_dim, args.block_size)
        rows.append(
            {
                "backend": name,
                "provider": provider,
                "status": "unavailable" if reason else "available",
                "reason": reason or "",
            }
        )
    print(
        f"device {device}, dtype {dtype_name(dtype)}, head_dim {args.head_dim}, "
        f"block_size {args.block_size}, torch {torch.__version__}"
    )
    for row in rows:  # one backend a line, wrapped to a 120-column terminal
        line = f"{row['backend']}: {row['status']}, {row['provider']}" + (f"; {row['reason']}" if row["reason"] else "")
        print(textwrap.fill(line, 120, subsequent_indent="    "))
    from pagedbench.bench.capabilities import LISTED_COLUMNS, YES, capability_table

    table = capability_table(device, dtype, args.head_dim, args.block_size).drop(columns="provider")
    print("\nWhat each backend runs here (the reasons check and compare act on):")
    unavailable = {row["backend"] for row in rows if row["reason"]}
    for row in table.itertuples(index=False):  # the value lists, a backend a line
        cells = dict(zip(table.columns, row))
        listing = "; ".join(f"{column} {cells[column]}" for column in LISTED_COLUMNS)
        if cells["backend"] in unavailable:
            listing = "none here (why: above)"
        print(textwrap.fill(f"{cells['backend']}: {listing}", 120, subsequent_indent="    "))
    # The features, a backend a column: ✓, or ✗ and the reason numbered below (each distinct one once).
    reasons: dict[str, int] = {}
    features = table.drop(columns=list(LISTED_COLUMNS)).set_index("backend").T
    features = features.map(lambda cell: cell if cell == YES else f"✗ {reasons.setdefault(cell, len(reasons) + 1)}")
    print(features.rename_axis("feature").to_markdown())
    for reason, number in reasons.items():
        print(textwrap.fill(f"{number}. {reason}", 120, subsequent_indent="   "))


def register(sub) -> None:
    register_kernels(sub)
    register_check(sub)


def register_kernels(sub) -> None:
    kern = sub.add_parser(
        "kernels", help="attention microbenchmark: plan and forward per backend (variant gdn: DeltaNet layers)"
    )
    kern.add_argument("--backends", default=None, help="comma-separated (default: every registered backend)")
    kern.add_argument("--preset", choices=["cpu", "gpu"], default=None, help="grid (default: gpu on cuda, else cpu)")
    kern.add_argument("--batch-sizes", help="e.g. 1,8,32")
    kern.add_argument("--context-lens", help="e.g. 512,2048")
    kern.add_argument("--block-sizes", help="e.g. 16,128")
    kern.add_argument(
        "--kv-cache-dtype",
        help=f"page storage, one or more of {','.join(KV_CACHE_DTYPES)} (GB/s counts the bytes as stored)",
    )
    kern.add_argument(
        "--query-lens", help="query tokens per decoding sequence, e.g. 1,2,4,8 (k + 1 when verifying k speculated)"
    )
    kern.add_argument(
        "--suffix-lens", help="variant cascade: each sequence's own tokens after the shared prefix, e.g. 64,512"
    )
    kern.add_argument("--heads", help="query/KV heads, e.g. 16/8,32/8")
    kern.add_argument("--phases", help="among decode,prefill,mixed")
    kern.add_argument(
        "--variants",
        help="attention variants, among plain,window-1024,softcap-50,sinks,gpt-oss,latent-512,dsa (default: plain); "
        "gdn: a hybrid model's gated DeltaNet layer instead (--heads as value/key heads) per --linear-kernels; "
        "cascade: a group of --batch-sizes decodes sharing a --context-lens prefix, flat and cascaded",
    )
    kern.add_argument(
        "--linear-kernels",
        default=None,
        help="variant gdn: the gated delta rule's kernels, among torch,fla (default: both on cuda; torch on cpu, "
        "where fla runs in Triton's interpreter: named, it is timed once)",
    )
    kern.add_argument("--head-dim", type=int)
    kern.add_argument("--max-kv-tokens", type=int, help="skip grid points holding more KV tokens than this")
    kern.add_argument("--max-query-tokens", type=int, help="skip grid points with more query tokens than this")
    kern.add_argument("--warmup", type=int)
    kern.add_argument("--repeats", type=int)
    kern.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="time each forward captured in a CUDA graph and replayed, as the engine's decode graphs run it "
        "(rows say cuda_graphs; a backend that cannot be captured is timed eagerly and says why)",
    )
    kern.add_argument("--batch-invariant", action="store_true", help="each backend in its batch-invariant form "
                      "(EngineConfig.batch_invariant); one without it is unavailable, saying why")  # fmt: skip
    add_engine_shape_flags(kern)
    kern.add_argument("--device", default=None)
    kern.add_argument("--dtype", default=None)
    kern.add_argument("--out", default="reports", help="directory for the CSV, markdown and PNG reports")
    add_overwrite_flag(kern)
    add_threads_flag(kern)
    kern.set_defaults(func=cmd_kernels)


def add_engine_shape_flags(kern) -> None:
    """kernels' flags that make its problems the engine's: the cache's pages and where a problem's
    pages lie, or the steps a run recorded, replayed."""
    kern.add_argument(
        "--cache-blocks",
        type=int,
        default=None,
        help="pages in the cache each problem lives in (the engine's whole cache as the K/V view; default: "
        "the problem's pages and a few spare)",
    )
    kern.add_argument(
        "--placement",
        choices=["random", "contiguous"],
        default="random",
        help="where a problem's pages lie: random (fragmented, the default) or contiguous (in order, as the "
        "block manager allocates them)",
    )
    kern.add_argument(
        "--replay",
        default=None,
        metavar="STEPS_JSONL",
        help="instead of the grid: the steps `run/compare --record-steps` recorded (comma-separated files) "
        "rebuilt exactly and timed per backend (--warmup, default 1; --repeats, default 3)",
    )
    kern.add_argument(
        "--export-flashinfer-bench",
        default=None,
        metavar="DIR",
        help="with --replay, instead of timing: write the recordings' decode steps as flashinfer-bench workloads "
        "of its gqa_paged_decode_h*_kv*_d*_ps1 definition (DIR/workloads/gqa_paged/<definition>.jsonl, blobs "
        "under DIR/blob)",
    )
    kern.add_argument(
        "--cold-caches",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--replay on a CPU: read a buffer twice the last-level cache before each timed forward, as the rest "
        "of the model evicts it between a layer's attention calls in the engine (on CUDA the L2 is always flushed)",
    )


def register_check(sub) -> None:
    chk = sub.add_parser("check", help="every backend against a dense oracle on a grid of paged-attention problems")
    chk.add_argument(
        "--backends",
        default=None,
        help="comma-separated; gdn-torch and gdn-fla name the gated DeltaNet cases' kernels (hybrid models' "
        "linear_attention_kernel, against a float64 oracle) (default: every registered backend and both kernels)",
    )
    chk.add_argument("--device", default=None, help="cuda if available, else cpu")
    chk.add_argument(
        "--dtypes", default=None, help="comma-separated (default: fp32,bf16 on cpu; bf16,fp16,fp32 on cuda)"
    )
    grid = chk.add_mutually_exclusive_group()
    grid.add_argument("--quick", dest="full", action="store_false", help="the default: minutes on a CPU")
    grid.add_argument("--full", dest="full", action="store_true", help="every batch x heads x head_dim x page size")
    chk.add_argument(
        "--engine",
        action="store_true",
        help="also teacher-force the whole model through each backend and compare logits (in --full)",
    )
    engine = chk.add_argument_group(
        "engine settings: the model of --engine (unset: tiny-llama), --kv-cache-dtype and --loglikelihood "
        "(py-byte-target), --index-cache-dtype (deepseek-v3.2); --engine's backends compiled or not, against "
        "the eager reference"
    )
    only = ("model", "compile", "batch_invariant")  # check's engine runs', and --determinism's backends' setting
    EngineConfig.add_cli_args(engine, skip=tuple(set(EngineConfig.names()) - set(only)), unset="check's")
    chk.add_argument(
        "--kv-cache-dtype",
        default=None,
        help="instead of the grid: KV quality of these page dtypes (e.g. fp8,int8) per backend, teacher-forced: "
        "KL, top-1 agreement and perplexity against the unquantized cache",
    )
    chk.add_argument(
        "--index-cache-dtype",
        default=None,
        help="instead of the grid: a sparse model's (--model, default deepseek-v3.2) selections with fp8 index "
        "keys against 16-bit ones: top-k overlap, KL and top-1 agreement (backend: --backends, default sdpa)",
    )
    chk.add_argument(
        "--loglikelihood",
        action="store_true",
        help="instead of the grid: multiple-choice log-likelihoods (lm-eval's scoring) over held-out text per "
        "backend and --kv-cache-dtype (default auto), against reference: mean |delta logprob|, answer agreement",
    )
    chk.add_argument(
        "--determinism",
        action="store_true",
        help="instead of the grid: per backend, dtype, phase and variant, whether the same call twice is bitwise "
        "equal and each sequence's output is bitwise the same alone, on other pages and in other batches",
    )
    chk.add_argument(
        "--batch-sizes", default=None, help="--determinism's batch sizes (default: 1,7,64 on cpu; 1,7,64,256 on cuda)"
    )
    chk.add_argument("--out", default="reports", help="directory for check.csv and check.md")
    add_overwrite_flag(chk)
    add_threads_flag(chk)
    chk.set_defaults(func=cmd_check, full=False)


def register_backends(sub) -> None:
    backends = sub.add_parser("backends", help="list registered backends and whether they run here")
    backends.add_argument("--device", default=None)
    backends.add_argument("--dtype", default=None)
    backends.add_argument("--head-dim", type=int, default=128)
    backends.add_argument("--block-size", type=int, default=16)
    backends.set_defaults(func=cmd_backends)
