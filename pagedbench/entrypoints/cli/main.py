"""The `pagedbench` command: run / compare scenarios, microbenchmark attention kernels,
re-render reports, list scenarios and backends."""

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import signal
import sys
from pathlib import Path

import pandas as pd
import torch

from pagedbench.bench.scenario import (
    ENGINE_FIELDS,
    LengthRange,
    Scenario,
    build_requests,
    builtin_scenarios,
    load_scenario,
)
from pagedbench.config import EngineConfig
from pagedbench.device.dtypes import dtype_name, resolve_device_dtype
from pagedbench.model.presets import PRESETS
from pagedbench.worker.tp_workers import WorkerError

# Flags that override the scenario's field of the same name (after --scale), equally for every backend.
SCENARIO_OVERRIDES = (*ENGINE_FIELDS, "num_prompts", "input_len", "output_len", "n")


def add_scenario_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", default="synthetic", help="built-in name (see `pagedbench scenarios`) or a TOML file")
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="request counts, lengths and max_num_seqs times F, the KV budget times F^2",
    )
    p.add_argument("--repeats", type=int, default=1, help="measured runs after the warmup")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed warmup run")
    p.add_argument("--out", default="reports", help="directory for the CSV, markdown and PNG reports")
    p.add_argument("--device", default=None, help="cuda if available, else cpu")
    p.add_argument("--dtype", default=None, help="bf16 on cuda, fp32 on cpu")
    overrides = p.add_argument_group("scenario overrides (default: the scenario's value)")
    overrides.add_argument("--model", default=None, help=f"HF model directory or preset ({', '.join(PRESETS)})")
    overrides.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="share KV blocks of common prompt prefixes (default: on)",
    )
    overrides.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="no CUDA graphs: every step eager (default: graphs where the backend allows them, on CUDA)",
    )
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(EngineConfig)} | {
        "num_blocks": "KV pages, the same for every backend",
        "num_prompts": "requests",
        "input_len": "every prompt this many tokens",
        "output_len": "every output this many tokens",
        "n": "samples per prompt (parallel sampling)",
        "seed": "seed of the request set, the sampler and random weights",
    }
    for flag in SCENARIO_OVERRIDES:
        if flag not in ("model", "enable_prefix_caching", "enforce_eager"):
            overrides.add_argument("--" + flag.replace("_", "-"), type=int, default=None, help=helps.get(flag))


CPU_MODEL = "tiny-llama"  # what benchmark commands run on a CPU unless --model says otherwise


def scenario_from_args(args) -> Scenario:
    scenario = load_scenario(args.scenario).scaled(args.scale)
    changes = {f: getattr(args, f) for f in SCENARIO_OVERRIDES if getattr(args, f) is not None}
    device, _ = resolve_device_dtype(args.device, args.dtype)
    if device.type == "cpu" and "model" not in changes and scenario.model != CPU_MODEL:
        print(
            f"pagedbench: note: on cpu, model {CPU_MODEL} instead of the scenario's {scenario.model} "
            f"(pass --model {scenario.model} to run that)"
        )
        changes["model"] = CPU_MODEL
    for length in {"input_len", "output_len"} & set(changes):
        changes[length] = LengthRange(changes[length], changes[length])
    if "num_blocks" in changes:
        changes["kv_tokens"] = None
    scenario = dataclasses.replace(scenario, **changes)
    scenario.validate()
    return scenario


def cmd_run(args) -> None:
    serving_report(args, [args.backend], "run")


def cmd_compare(args) -> None:
    serving_report(args, timed_backend_names(args.backends, args.device, args.dtype), "compare")


def backend_names(text: str | None) -> list[str]:
    """Comma-separated names; every registered backend when not given."""
    from pagedbench.backends.registry import list_backends

    return [b.strip() for b in text.split(",") if b.strip()] if text else list_backends()


def timed_backend_names(text: str | None, device: str | None, dtype: str | None) -> list[str]:
    """`backend_names` for a timing command: without --backends, a backend whose timings here are
    not a kernel's speed (Triton's interpreter on CPU) is left out, saying so; named, it runs."""
    from pagedbench.backends.registry import get_backend

    names = backend_names(text)
    if text:
        return names
    dev = resolve_device_dtype(device, dtype)[0]
    timed = []
    for name in names:
        caveat = get_backend(name).timing_caveat(dev)
        if caveat:
            print(f"pagedbench: note: {name} not timed by default on {dev.type}: {caveat} (--backends {name} times it)")
        else:
            timed.append(name)
    return timed


def prepare_out_dir(path: str) -> None:
    """Fail before a long run, not after it, when reports cannot be written."""
    from pathlib import Path

    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the output directory {path!r}: {e.strerror}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write reports to {path!r}: permission denied")


class Interrupted(Exception):
    """A long command stopped by Ctrl-C or SIGTERM after writing what it had measured."""


@contextlib.contextmanager
def keep_partial(log):
    """On Ctrl-C or SIGTERM (a time limit), render the rows measured so far, then stop."""
    from pagedbench.bench.report import render, tidy

    def terminate(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    except KeyboardInterrupt:
        if not len(log):
            raise Interrupted("interrupted before any row was complete; nothing written") from None
        paths = [log.path, *render(tidy(list(log), log.kind, log.command), log.path.parent, log.path.stem)]
        raise Interrupted(f"interrupted after {len(log)} rows; kept: {', '.join(map(str, paths))}") from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def warn_if_busy(device: torch.device) -> None:
    from pagedbench.bench.environment import busy_warning

    warning = busy_warning(device)
    if warning:  # on stdout, beside the figures it qualifies (stderr is for errors: one line each)
        print(f"pagedbench: warning: {warning}")


def serving_report(args, backends: list[str], command: str) -> None:
    from pagedbench.bench.compare import compare
    from pagedbench.bench.report import CsvLog, console_table, tidy, write_reports

    prepare_out_dir(args.out)
    scenario = scenario_from_args(args)
    warn_if_busy(resolve_device_dtype(args.device, args.dtype)[0])
    log = CsvLog(args.out, f"{command}-{scenario.name}", "serving", command)
    with keep_partial(log):
        result = compare(
            scenario,
            backends,
            args.scale,
            args.device,
            args.dtype,
            args.repeats,
            args.warmup,
            rows=log,
            peers=getattr(args, "peer", None) or [],
        )
    if command == "run" and result.unavailable:
        raise ValueError(f"backend {args.backend!r} is unavailable here: {result.unavailable[args.backend]}")
    serving = tidy(result.rows, "serving", command)
    print(
        f"scenario {scenario.name} (scale {args.scale:g}, hash {scenario.content_hash()[:12]}): "
        f"{scenario.num_prompts} requests, model {scenario.model}, KV budget {scenario.kv_blocks} blocks "
        f"x {scenario.block_size} for every backend"
    )
    print(console_table(serving, cross_backend=command == "compare"))
    frames = {
        "serving": serving,
        "requests": tidy(result.request_rows, "requests", command),
        "kv": tidy(result.kv_rows, "kv", command),
    }
    paths = write_reports(frames, args.out, f"{command}-{scenario.name}")
    print(f"reports: {', '.join(map(str, paths))}")


def cmd_kernels(args) -> None:
    from pagedbench.bench.kernels import GRID_PRESETS, run_kernels
    from pagedbench.bench.report import CsvLog, kernel_table, markdown, not_run_lines, tidy, write_reports

    prepare_out_dir(args.out)
    device, _ = resolve_device_dtype(args.device, args.dtype)
    warn_if_busy(device)
    grid = dataclasses.replace(GRID_PRESETS[args.preset or ("gpu" if device.type == "cuda" else "cpu")])
    for name in ("batch_sizes", "context_lens", "block_sizes"):
        if getattr(args, name):
            setattr(grid, name, _int_list(getattr(args, name), name))
    if args.heads:
        grid.heads = [_int_list(pair, "heads", sep="/", length=2) for pair in args.heads.split(",")]
    if args.phases:
        grid.phases = args.phases.split(",")
    if args.variants:
        grid.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for name in ("head_dim", "max_kv_tokens", "max_query_tokens", "warmup", "repeats"):
        if getattr(args, name) is not None:
            setattr(grid, name, getattr(args, name))
    log = CsvLog(args.out, "kernels", "kernels", "kernels")
    with keep_partial(log):
        run_kernels(
            timed_backend_names(args.backends, args.device, args.dtype), grid, args.device, args.dtype, rows=log
        )
    kernels = tidy(log, "kernels", "kernels")
    print("\n".join([markdown(kernel_table(kernels)), *not_run_lines(kernels)]))
    paths = write_reports({"kernels": kernels}, args.out, "kernels")
    print(f"reports: {', '.join(map(str, paths))}")


def cmd_check(args) -> int:
    from pagedbench.bench.check import TOLERANCE_FACTOR, TOLERANCE_FLOOR, engine_check, run_check, summary
    from pagedbench.bench.environment import environment
    from pagedbench.bench.report import EnvCsvLog, tidy, write_reports

    prepare_out_dir(args.out)
    device, _ = resolve_device_dtype(args.device, None)
    names = args.dtypes or ("fp32,bf16" if device.type == "cpu" else "bf16,fp16,fp32")
    dtypes = [resolve_device_dtype(args.device, name.strip())[1] for name in names.split(",") if name.strip()]
    env = environment(device, dtypes[0])
    backends = backend_names(args.backends)
    log = EnvCsvLog(env, args.out, "check", "check", "check")
    with keep_partial(log):
        run_check(backends, device, dtypes, full=args.full, rows=log)
        if args.engine or args.full:
            log += engine_check(backends, device, dtypes, model=args.model)
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
    paths = write_reports({"check": tidy(rows, "check", "check")}, args.out, "check")
    print(f"reports: {', '.join(map(str, paths))}")
    failed = sum(row["status"] == "fail" for row in rows)
    if failed:
        print(f"pagedbench: check failed: {failed} case(s)", file=sys.stderr)
    return 1 if failed else 0


def _int_list(text: str, name: str, sep: str = ",", length: int | None = None) -> list[int]:
    try:
        values = [int(v) for v in text.split(sep)]
    except ValueError:
        values = []
    if not values or length not in (None, len(values)):
        count = f"{length} " if length else ""
        raise ValueError(f"{name} must be {count}integers separated by {sep!r}, got {text!r}")
    return values


def cmd_report(args) -> None:
    from pathlib import Path

    from pagedbench.bench.report import load_csvs, render

    Path(args.out).mkdir(parents=True, exist_ok=True)
    paths = render(load_csvs(args.csv), Path(args.out), args.name)
    print(f"reports: {', '.join(map(str, paths))}")


def cmd_scenarios(args) -> None:
    rows = []
    for name in sorted(builtin_scenarios()):
        s = load_scenario(name)
        arrival = s.arrival if s.request_rate is None else f"{s.arrival} {s.request_rate:g}/s"
        rows.append(
            {
                "scenario": name,
                "description": s.description,
                "requests": s.num_prompts,
                "input": str(s.input_len),
                "output": str(s.output_len),
                "arrival": arrival,
                "KV blocks": s.kv_blocks,
                "model": s.model,
            }
        )
    print(pd.DataFrame(rows).to_markdown(index=False))


def cmd_kv_calc(args) -> None:
    from pagedbench.bench.kv_calc import GIB, kv_bytes_per_token, kv_table
    from pagedbench.bench.report import markdown
    from pagedbench.device.dtypes import DTYPES
    from pagedbench.model.loader import resolve_model_config

    if args.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {args.dtype!r}; choose one of {', '.join(DTYPES)}")
    if not args.memory > 0:
        raise ValueError(f"--memory must be > 0 GiB, got {args.memory}")
    cfg, _ = resolve_model_config(args.model)
    block_sizes = _positive_ints(args.block_size, "--block-size")
    seq_lens = _positive_ints(args.seq_len, "--seq-len") if args.seq_len else [cfg.max_position_embeddings]
    dtype = DTYPES[args.dtype]
    per_token = kv_bytes_per_token(cfg, dtype)
    print(
        f"{args.model}: {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x head_dim {cfg.head_dim} x 2 (K, V) "
        f"x {dtype.itemsize} B ({args.dtype}) = {per_token:,} B ({per_token / 1024:g} KiB) per token; "
        f"{args.memory:g} GiB of KV cache"
    )
    print(markdown(kv_table(cfg, dtype, int(args.memory * GIB), block_sizes, seq_lens)))


def _positive_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes positive integers, got {text!r}")
    return values


def cmd_serve(args) -> None:
    try:
        import uvicorn

        from pagedbench.entrypoints.openai.api_server import ServerLimits, build_app
    except ImportError as e:
        raise ValueError(f"serving needs the server extra (pip install 'pagedbench[server]'): {e}") from None
    from pagedbench.engine.llm_engine import LLMEngine
    from pagedbench.entrypoints.async_llm import AsyncLLM

    config = EngineConfig.from_cli_args(args)
    llm = AsyncLLM(LLMEngine(config), max_pending=args.max_pending)
    limits = ServerLimits(max_body_bytes=args.max_body_bytes, max_tokens=args.max_tokens_limit, max_n=args.max_n)
    app = build_app(llm, args.served_model_name or args.model, args.api_key, limits)
    print(f"pagedbench: serving {args.model} ({args.backend}) on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


def cmd_bench_serve(args) -> None:
    import json as _json
    import math
    import urllib.request

    import pandas as pd

    from pagedbench.bench.report import BENCH_SERVE_COLUMNS, bench_serve_table, markdown, plot_rate_sweep
    from pagedbench.bench.serve_client import parse_rates, parse_slos, replay, summarize
    from pagedbench.model.loader import resolve_model_config

    scenario = load_scenario(args.scenario).scaled(args.scale)
    default_rate = f"{scenario.request_rate:g}" if scenario.arrival == "poisson" else "inf"
    rates, slos = parse_rates(args.request_rate or default_rate), parse_slos(args.goodput)
    if args.num_prompts is not None:
        scenario = dataclasses.replace(scenario, num_prompts=args.num_prompts)
    url = args.base_url.rstrip("/")
    try:
        headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        with urllib.request.urlopen(urllib.request.Request(url + "/v1/models", headers=headers), timeout=10) as r:
            card = _json.loads(r.read())["data"][0]
    except (OSError, ValueError, KeyError, IndexError) as e:
        if args.model is None:
            raise ValueError(f"cannot read {url}/v1/models (or pass --model): {e}") from None
        card = {}
    model = args.model or card["id"]
    backend = args.label or card.get("backend") or url  # pagedbench serve names its backend
    try:
        vocab = resolve_model_config(model)[0].vocab_size
    except (ValueError, FileNotFoundError, OSError):
        vocab = 1000  # token ids every real vocabulary has
    prepare_out_dir(args.out)
    requests = build_requests(scenario, vocab)
    rows = []
    for rate in rates:
        results, duration = asyncio.run(
            replay(url, model, requests, rate, args.max_concurrency, args.api_key, scenario.seed)
        )
        failures = [r.error for r in results if not r.ok]
        if failures:
            print(f"pagedbench: {len(failures)} of {len(results)} requests failed, e.g. {failures[0]}", file=sys.stderr)
        rows.append(
            {
                "kind": "bench-serve",
                "timestamp": pd.Timestamp.now(tz="UTC").isoformat(timespec="seconds"),
                "backend": backend,
                "base_url": url,
                "model": model,
                "scenario": scenario.name,
                "scale": args.scale,
                "num_prompts": len(requests),
                "request_rate": rate if math.isfinite(rate) else "inf",
                "max_concurrency": args.max_concurrency,
                "slos_ms": args.goodput or "",
                **summarize(results, duration, slos),
            }
        )
        row = rows[-1]
        print(
            f"rate {rate:g}/s: {row['output_throughput']:.1f} output tok/s, median TTFT {row['median_ttft_ms']:.1f} ms"
        )
    df = pd.DataFrame(rows).reindex(columns=BENCH_SERVE_COLUMNS)
    stem = Path(args.out) / f"bench-serve-{scenario.name}"
    df.to_csv(stem.with_suffix(".csv"), index=False)
    table = markdown(bench_serve_table(df))
    stem.with_suffix(".md").write_text(f"# bench-serve: {scenario.name} against {url} ({model})\n\n{table}\n")
    plot_rate_sweep(df, Path(f"{stem}-latency-vs-throughput.png"))
    print(table)
    print(f"reports: {stem}.csv, {stem}.md, {stem}-latency-vs-throughput.png")


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
    print(pd.DataFrame(rows).to_markdown(index=False))
    from pagedbench.bench.capabilities import capability_table

    print("\nWhat each backend runs here (✓, or why not; from the same reasons check and compare act on):")
    print(
        capability_table(device, dtype, args.head_dim, args.block_size)
        .drop(columns="provider")
        .to_markdown(index=False)
    )


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" only where it tells something: not for flags, unset options, or help
    that already names its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            "default" in text
            or any(action.default is v for v in (None, False, True, argparse.SUPPRESS))
            or not action.option_strings
        ):
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    parser = argparse.ArgumentParser(
        prog="pagedbench",
        description="Compare paged-attention backends in one engine.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"pagedbench {version('pagedbench')} (torch {torch.__version__})"
    )
    parser.epilog = "Errors are one line on stderr with exit code 2; `check` exits 1 when a case fails."
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser = functools.partial(sub.add_parser, formatter_class=_HelpFormatter)

    run = sub.add_parser("run", help="run a scenario on one backend: throughput, latency, engine internals")
    run.add_argument("--backend", default="sdpa", help="a name from `pagedbench backends`")
    add_scenario_args(run)
    run.set_defaults(func=cmd_run)

    comp = sub.add_parser("compare", help="run a scenario on several backends: same requests, same KV budget")
    comp.add_argument("--backends", default=None, help="comma-separated (default: every registered backend)")
    comp.add_argument(
        "--peer",
        action="append",
        choices=["hf"],
        help="also run a peer library on the same requests: hf = transformers' continuous batching (repeatable)",
    )
    add_scenario_args(comp)
    comp.set_defaults(func=cmd_compare)

    kern = sub.add_parser("kernels", help="attention-only microbenchmark: prepare and forward per backend")
    kern.add_argument("--backends", default=None, help="comma-separated (default: every registered backend)")
    kern.add_argument("--preset", choices=["cpu", "gpu"], default=None, help="grid (default: gpu on cuda, else cpu)")
    kern.add_argument("--batch-sizes", help="e.g. 1,8,32")
    kern.add_argument("--context-lens", help="e.g. 512,2048")
    kern.add_argument("--block-sizes", help="e.g. 16,128")
    kern.add_argument("--heads", help="query/KV heads, e.g. 16/8,32/8")
    kern.add_argument("--phases", help="among decode,prefill,mixed")
    kern.add_argument(
        "--variants", help="attention variants, among plain,window-1024,softcap-50,sinks (default: plain)"
    )
    kern.add_argument("--head-dim", type=int)
    kern.add_argument("--max-kv-tokens", type=int, help="skip grid points holding more KV tokens than this")
    kern.add_argument("--max-query-tokens", type=int, help="skip grid points with more query tokens than this")
    kern.add_argument("--warmup", type=int)
    kern.add_argument("--repeats", type=int)
    kern.add_argument("--device", default=None)
    kern.add_argument("--dtype", default=None)
    kern.add_argument("--out", default="reports", help="directory for the CSV, markdown and PNG reports")
    kern.set_defaults(func=cmd_kernels)

    chk = sub.add_parser("check", help="every backend against a dense oracle on a grid of paged-attention problems")
    chk.add_argument("--backends", default=None, help="comma-separated (default: every registered backend)")
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
    chk.add_argument("--model", default="tiny-llama", help="model for --engine (a preset or HF directory)")
    chk.add_argument("--out", default="reports", help="directory for check.csv and check.md")
    chk.set_defaults(func=cmd_check, full=False)

    rep = sub.add_parser("report", help="re-render markdown and plots from CSVs (merging runs and machines)")
    rep.add_argument("csv", nargs="+", help="CSV files written by run, compare, kernels, check or bench-serve")
    rep.add_argument("--out", default="reports")
    rep.add_argument("--name", default="report", help="file name stem of the markdown and PNGs")
    rep.set_defaults(func=cmd_report)

    scen = sub.add_parser("scenarios", help="list the built-in scenarios")
    scen.set_defaults(func=cmd_scenarios)

    kv = sub.add_parser("kv-calc", help="KV-cache memory: bytes per token and block, blocks, concurrent sequences")
    kv.add_argument("model", help=f"HF model directory or preset ({', '.join(PRESETS)})")
    kv.add_argument("--block-size", default="16", help="one or more, comma-separated (a sweep)")
    kv.add_argument("--memory", type=float, default=40.0, help="GiB given to the KV cache")
    kv.add_argument("--dtype", default="bf16", help="cache dtype")
    kv.add_argument("--seq-len", default=None, help="sequence lengths, comma-separated (default: the model's max)")
    kv.set_defaults(func=cmd_kv_calc)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    serve.add_argument("model", help=f"HF model directory or preset ({', '.join(PRESETS)})")
    serve.add_argument("--backend", default="sdpa")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (loopback unless you say otherwise)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    serve.add_argument("--served-model-name", default=None, help="the model's name in the API (default: MODEL)")
    EngineConfig.add_cli_args(serve.add_argument_group("engine"), skip=("model", "backend"))
    serve.add_argument("--max-pending", type=int, default=None, help="requests in flight before 429 (4 x max-num-seqs)")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20)
    serve.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens (max-model-len)")
    serve.add_argument("--max-n", type=int, default=16)
    serve.add_argument("--log-level", default="warning")
    serve.set_defaults(func=cmd_serve)

    bs = sub.add_parser(
        "bench-serve", help="load an OpenAI-compatible server with a scenario: TTFT, TPOT, ITL, goodput"
    )
    bs.add_argument("--base-url", default="http://127.0.0.1:8000")
    bs.add_argument("--scenario", default="online", help="built-in name or TOML file (its requests and lengths)")
    bs.add_argument("--scale", type=float, default=1.0)
    bs.add_argument("--num-prompts", type=int, default=None)
    bs.add_argument(
        "--request-rate",
        default=None,
        help="requests/s, Poisson arrivals; comma-separated for a sweep (default: the scenario's rate, else inf)",
    )
    bs.add_argument("--max-concurrency", type=int, default=None)
    bs.add_argument("--model", default=None, help="the model name the server knows (default: its first)")
    bs.add_argument("--label", default=None, help="the backend column (default: the server's backend, else its URL)")
    bs.add_argument("--api-key", default=None)
    bs.add_argument("--goodput", default=None, help="SLOs in ms, e.g. ttft:500,tpot:50")
    bs.add_argument("--out", default="reports")
    bs.set_defaults(func=cmd_bench_serve)

    backends = sub.add_parser("backends", help="list registered backends and whether they run here")
    backends.add_argument("--device", default=None)
    backends.add_argument("--dtype", default=None)
    backends.add_argument("--head-dim", type=int, default=128)
    backends.add_argument("--block-size", type=int, default=16)
    backends.set_defaults(func=cmd_backends)
    return parser


def _log_to_stderr() -> None:
    """The library's INFO messages (a JIT compile starting, say) on stderr; other libraries' untouched."""
    log = logging.getLogger("pagedbench")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("pagedbench: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _log_to_stderr()
    try:
        return args.func(args) or 0
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"pagedbench: error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"pagedbench: {e}", file=sys.stderr)
        return 130
    except WorkerError as e:  # a tensor-parallel rank failed: its own one-line error
        print(f"pagedbench: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
