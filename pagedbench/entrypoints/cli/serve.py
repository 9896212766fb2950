"""`pagedbench serve` (the OpenAI-compatible server) and `bench-serve` (load a server with a
scenario: TTFT, TPOT, ITL, goodput, over one or more request rates)."""

import asyncio
import dataclasses
import sys
from pathlib import Path

from pagedbench.bench.scenario import build_requests, load_scenario, model_requests
from pagedbench.config import EngineConfig
from pagedbench.entrypoints.cli.common import (
    Interrupted,
    NothingMeasured,
    add_overwrite_flag,
    prepare_out_dir,
    report_stem,
)
from pagedbench.entrypoints.cli.run import add_dataset_args
from pagedbench.model.presets import PRESETS
from pagedbench.worker.tp_workers import WorkerError


def check_address(host: str, port: int) -> None:
    """Refuse a port out of range, an unknown host or an address in use before the engine is
    built, so `serve` never announces an address it cannot serve."""
    import socket

    if not 1 <= port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host!r} cannot be resolved: {e}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


# `vllm serve` flags that change nothing here, accepted so a copied command line runs: flag -> why.
VLLM_NO_OP_FLAGS = {
    "trust_remote_code": "only the built-in model code runs, never a model's own",
    "disable_log_stats": "the engine logs no periodic stats (/metrics has them)",
    "enable_chunked_prefill": "prefills are always chunked",
    "enable_auto_tool_choice": "tool calls are not supported; tools in a request are refused",
    "tool_call_parser": "tool calls are not supported",
    "generation_config": "sampling defaults are vLLM's (temperature 1, top_p 1), never the model's file",
}


def resolve_serve_model(args) -> str:
    """The model, positional (`pagedbench serve MODEL`) or as vLLM's --model flag, not both apart."""
    if args.model is None and args.model_flag is None:
        raise ValueError("serve needs a model: pagedbench serve MODEL (or --model MODEL)")
    if args.model is not None and args.model_flag is not None and args.model != args.model_flag:
        raise ValueError(f"two models given: {args.model!r} and --model {args.model_flag!r}")
    return args.model or args.model_flag


def note_no_op_flags(args) -> None:
    for name, why in VLLM_NO_OP_FLAGS.items():
        if getattr(args, name) not in (None, False):
            print(f"pagedbench: note: --{name.replace('_', '-')} accepted, no effect here: {why}")


def warm_up_reason(config: EngineConfig, device) -> str | None:
    """What a server's warm-up would compile before the first request, or None when nothing does
    (an eager model and a backend without JIT on a CPU: a warm-up there only costs a full prefill
    chunk of time, 98 s for a large model)."""
    from pagedbench.backends.registry import get_backend

    if device.type == "cuda":
        return "CUDA kernels and libraries initialise on first use"
    if config.compiles(device):
        return "the compiled model"
    if get_backend(config.backend).compiles_on_first_use(device):
        return f"{config.backend}'s kernels"
    return None


def cmd_serve(args) -> None:
    args.model = resolve_serve_model(args)
    note_no_op_flags(args)
    check_address(args.host, args.port)
    if args.shutdown_grace_period < 0:
        raise ValueError(f"--shutdown-grace-period must be >= 0 seconds, got {args.shutdown_grace_period:g}")
    try:
        import uvicorn

        from pagedbench.entrypoints.openai.api_server import ServerLimits, build_app
        from pagedbench.entrypoints.openai.shutdown import FLUSH_S, DrainingServer
    except ImportError as e:
        raise ValueError(f"serving needs the server extra (pip install 'pagedbench[server]'): {e}") from None
    from pagedbench.engine.data_parallel import make_engine
    from pagedbench.entrypoints.async_llm import AsyncLLM

    config = EngineConfig.from_cli_args(args)
    engine = make_engine(config)
    if args.chat_template is not None:
        _set_chat_template(engine, args.chat_template)
    # Compile before announcing: the first requests must not wait for it (vLLM does the same).
    why = warm_up_reason(config, engine.device)
    if why is None:
        print(
            f"pagedbench: no warm-up: nothing compiles on first use here; CUDA graphs {engine.cuda_graphs}", flush=True
        )
    else:
        seconds, compiling = engine.warm_up()
        warm = f"warmed up in {seconds:.1f} s ({compiling:.1f} s compiling: {why}); CUDA graphs {engine.cuda_graphs}"
        print(f"pagedbench: {warm}", flush=True)
    llm = AsyncLLM(engine, max_pending=args.max_pending)
    limits = ServerLimits(max_body_bytes=args.max_body_bytes, max_tokens=args.max_tokens_limit, max_n=args.max_n)
    fatal: list[str] = []

    def stop(problem: str) -> None:  # a dead engine or replica: stop serving, and say why as the command exits
        fatal.append(problem)
        server.should_exit = True

    app = build_app(llm, args.served_model_name or args.model, args.api_key, limits, on_fatal=stop)
    address = f"http://{args.host}:{args.port}/v1"
    print(f"pagedbench: serving {args.model} ({args.backend}) on {address}; {_tokenizer_note(engine)}", flush=True)
    http = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
    http.timeout_graceful_shutdown = FLUSH_S  # after the drain (shutdown.py): the last answers' time to leave
    server = DrainingServer(http, llm, args.shutdown_grace_period)
    if not args.disable_log_requests:  # an access line per request, as vLLM prints (whatever --log-level)
        import logging

        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    server.run()
    if fatal:
        raise WorkerError(f"{fatal[0]}; the server stopped")
    if server.outcome is not None:  # stopped by Ctrl-C or SIGTERM
        raise Interrupted(server.outcome)


def _tokenizer_note(engine) -> str:
    """Where a client finds the served model's tokenizer (the start banner says it)."""
    if engine.tokenizer is None:
        return "no tokenizer: prompts must be token ids"
    if engine.model_path is not None:
        return f"tokenizer: {engine.model_path} (also GET /tokenizer_info, POST /tokenize)"
    return "tokenizer: the preset's byte-level one (GET /tokenizer_info, POST /tokenize)"


def _set_chat_template(engine, path: str) -> None:
    """vLLM's --chat-template: a Jinja file (or the template itself) replaces the tokenizer's."""
    text = Path(path).read_text() if Path(path).is_file() else path
    if "{%" not in text and "{{" not in text:
        raise ValueError(f"--chat-template {path!r} is neither a file nor a Jinja template")
    if engine.tokenizer is None:
        raise ValueError("--chat-template: this model has no tokenizer")
    engine.tokenizer.chat_template = text


def cmd_bench_serve(args) -> None:
    from pagedbench.bench.serve_client import parse_rates, parse_slos

    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    scenario = load_scenario(args.scenario).scaled(args.scale)
    default_rate = f"{scenario.request_rate:g}" if scenario.arrival == "poisson" else "inf"
    rates, slos = parse_rates(args.request_rate or default_rate), parse_slos(args.goodput)
    if args.num_prompts is not None:
        scenario = dataclasses.replace(scenario, num_prompts=args.num_prompts)
    if args.dataset_name is not None or args.dataset_path is not None:
        dataset = {"dataset_name": args.dataset_name, "dataset_path": args.dataset_path}
        scenario = dataclasses.replace(scenario, **dataset, skip_long_requests=bool(args.skip_long_requests))
        scenario.validate()
    if scenario.dataset_name == "trace" and args.request_rate is None:
        rates = [None]  # the trace's own arrivals
    url = args.base_url.rstrip("/")
    card = _server_card(url, args.api_key, args.model)
    model = args.model or card["id"]
    backend = args.label or card.get("backend") or url  # pagedbench serve names its backend
    prepare_out_dir(args.out)
    requests = _requests(scenario, model, card.get("max_model_len"))
    head = {"backend": backend, "base_url": url, "model": model, "scenario": scenario.label, "scale": args.scale}
    if args.num_warmups:
        _warm_up(url, model, requests, scenario.engine.seed, args)
    rows = [_load_at(rate, url, requests, scenario.engine.seed, slos, args, head) for rate in rates]
    stem = report_stem(args.out, f"bench-serve-{scenario.label.replace(':', '-')}", args.overwrite)
    _write_bench_serve(rows, Path(args.out) / stem, url, model, scenario.label)
    if not any(row["completed"] for row in rows):
        raise NothingMeasured(f"every request to {url} failed: nothing was measured")


def _warm_up(url: str, model: str, requests, seed: int, args) -> None:
    """vLLM's --num-warmups: the scenario's first requests (cycled), all at once, results dropped."""
    import math

    from pagedbench.bench.serve_client import replay

    warm = [requests[i % len(requests)] for i in range(args.num_warmups)]
    results, seconds = asyncio.run(replay(url, model, warm, math.inf, args.max_concurrency, args.api_key, seed))
    print(f"pagedbench: {len(warm)} warm-up requests in {seconds:.1f} s, kept out of the metrics")
    _say_failures(results)


def _say_failures(results) -> None:
    failures = [r.error for r in results if not r.ok]
    if failures:
        print(f"pagedbench: {len(failures)} of {len(results)} requests failed, e.g. {failures[0]}", file=sys.stderr)


def _server_card(url: str, api_key: str | None, model: str | None) -> dict:
    """The server's first /v1/models card ({} when it cannot be read and --model names the model)."""
    import json
    import urllib.request

    try:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        with urllib.request.urlopen(urllib.request.Request(url + "/v1/models", headers=headers), timeout=10) as r:
            return json.loads(r.read())["data"][0]
    except (OSError, ValueError, KeyError, IndexError) as e:
        if model is None:
            raise ValueError(f"cannot read {url}/v1/models (or pass --model): {e}") from None
        return {}


def _requests(scenario, model: str, max_model_len: int | None):
    """The scenario's requests for the served `model`, resolved here where it can be (a preset,
    directory or GGUF file); else random ids that every real vocabulary has. A dataset's requests
    fit `max_model_len`, the server's (its /v1/models card's), where it says."""
    from pagedbench.model.loader import resolve_model_config

    try:
        config, path = resolve_model_config(model)
    except (ValueError, FileNotFoundError, OSError):
        if scenario.prompts == "chat":
            raise ValueError(
                f"scenario {scenario.name!r} formats its prompts with the model's chat template: "
                f"--model must name the served model's directory, GGUF file or preset here (got {model!r})"
            ) from None
        return build_requests(scenario, 1000, max_model_len=max_model_len)
    return model_requests(scenario, config, path, max_model_len)


def _load_at(rate: float, url: str, requests, seed: int, slos, args, head: dict) -> dict:
    """One request rate's replay of the scenario against the server, as a bench-serve row."""
    import math

    import pandas as pd

    from pagedbench.bench.serve_client import replay, summarize

    results, duration = asyncio.run(
        replay(url, head["model"], requests, rate, args.max_concurrency, args.api_key, seed)
    )
    _say_failures(results)
    row = {
        "kind": "bench-serve",
        "timestamp": pd.Timestamp.now(tz="UTC").isoformat(timespec="seconds"),
        **head,
        "num_prompts": len(requests),
        "request_rate": "trace" if rate is None else rate if math.isfinite(rate) else "inf",
        "max_concurrency": args.max_concurrency,
        "slos_ms": args.goodput or "",
        **summarize(results, duration, slos),
    }
    label = "trace arrivals" if rate is None else f"rate {rate:g}/s"
    print(f"{label}: {row['output_throughput']:.1f} output tok/s, median TTFT {row['median_ttft_ms']:.1f} ms")
    return row


def _write_bench_serve(rows: list[dict], stem: Path, url: str, model: str, scenario: str) -> None:
    import pandas as pd

    from pagedbench.bench.report_plots import plot_rate_sweep
    from pagedbench.bench.report_schema import BENCH_SERVE_COLUMNS
    from pagedbench.bench.report_tables import BENCH_SERVE_FIRST, bench_serve_table, markdown, terminal_table

    df = pd.DataFrame(rows).reindex(columns=BENCH_SERVE_COLUMNS)
    df.to_csv(stem.with_suffix(".csv"), index=False)
    table = markdown(bench_serve_table(df))
    stem.with_suffix(".md").write_text(f"# bench-serve: {scenario} against {url} ({model})\n\n{table}\n")
    plot_rate_sweep(df, Path(f"{stem}-latency-vs-throughput.png"))
    print(terminal_table(bench_serve_table(df), BENCH_SERVE_FIRST))
    print(f"reports: {stem}.csv, {stem}.md, {stem}-latency-vs-throughput.png")


def register(sub) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    serve.add_argument("model", nargs="?", help=f"HF model directory or preset ({', '.join(PRESETS)})")
    serve.add_argument("--model", dest="model_flag", default=None, help="the model, as vLLM's flag (or positional)")
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
    serve.add_argument(
        "--shutdown-grace-period",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on Ctrl-C or SIGTERM, how long requests in flight may run on before they are answered 503 "
        "(a second Ctrl-C: at once)",
    )
    serve.add_argument("--log-level", "--uvicorn-log-level", default="warning", help="the HTTP server's log level")
    serve.add_argument(
        "--disable-log-requests", action="store_true", help="no access-log line per request (vLLM's flag)"
    )
    serve.add_argument(
        "--chat-template", default=None, help="a Jinja chat template (file or text) replacing the tokenizer's"
    )
    vllm = serve.add_argument_group("vLLM flags accepted without effect (each prints a note)")
    for name in ("trust_remote_code", "disable_log_stats", "enable_chunked_prefill", "enable_auto_tool_choice"):
        vllm.add_argument("--" + name.replace("_", "-"), action="store_true", help=VLLM_NO_OP_FLAGS[name])
    vllm.add_argument("--tool-call-parser", default=None, help=VLLM_NO_OP_FLAGS["tool_call_parser"])
    vllm.add_argument(
        "--generation-config", choices=["auto", "vllm"], default=None, help=VLLM_NO_OP_FLAGS["generation_config"]
    )
    serve.set_defaults(func=cmd_serve)

    bs = sub.add_parser(
        "bench-serve", help="load an OpenAI-compatible server with a scenario: TTFT, TPOT, ITL, goodput"
    )
    bs.add_argument("--base-url", default="http://127.0.0.1:8000")
    bs.add_argument("--scenario", default="online", help="built-in name or TOML file (its requests and lengths)")
    bs.add_argument("--scale", type=float, default=1.0)
    bs.add_argument("--num-prompts", type=int, default=None)
    add_dataset_args(bs)
    bs.add_argument(
        "--request-rate",
        default=None,
        help="requests/s, Poisson arrivals; comma-separated for a sweep (default: the scenario's rate, else inf)",
    )
    bs.add_argument("--max-concurrency", type=int, default=None)
    bs.add_argument(
        "--num-warmups", type=int, default=0, help="warm-up requests sent first, kept out of the metrics (as vLLM's)"
    )
    bs.add_argument("--model", default=None, help="the model name the server knows (default: its first)")
    bs.add_argument("--label", default=None, help="the backend column (default: the server's backend, else its URL)")
    bs.add_argument("--api-key", default=None)
    bs.add_argument("--goodput", default=None, help="SLOs in ms, e.g. ttft:500,tpot:50")
    bs.add_argument("--out", default="reports")
    add_overwrite_flag(bs)
    bs.set_defaults(func=cmd_bench_serve)
