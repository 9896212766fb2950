"""`pagedbench profile`: what one steady decode step launches, per backend and batch size: kernels
(CUDA) or operations (CPU) per step and per layer outside attention, device time, top kernels."""

import json
from dataclasses import asdict
from pathlib import Path

import pandas as pd

from pagedbench.config import EngineConfig
from pagedbench.entrypoints.cli.common import add_threads_flag, backend_names, positive_ints, prepare_out_dir


def cmd_profile(args) -> None:
    if args.stand_in_device_ms is not None:
        return cmd_host_profile(args)
    from pagedbench.backends.registry import probe
    from pagedbench.bench.environment import device_name, git_sha
    from pagedbench.bench.report_tables import markdown, terminal_table
    from pagedbench.bench.step_profile import profile_decode
    from pagedbench.device.dtypes import resolve_device_dtype
    from pagedbench.engine.data_parallel import make_engine

    device, dtype = resolve_device_dtype(args.device, args.dtype)
    cuda = device.type == "cuda"
    model = args.model or ("qwen3-0.6b" if cuda else "tiny-llama")
    batches = positive_ints(args.batch_sizes or ("64,256" if cuda else "16"), "--batch-sizes")
    context = args.context or (1024 if cuda else 128)
    rows, tops = [], {}
    sized = {  # what the profiled steps need, unless a flag says otherwise
        "model": model,
        "max_num_seqs": max(batches),
        "max_num_batched_tokens": max(2048, context),
        "max_model_len": context + args.steps + args.warmup + 64,
        "enable_prefix_caching": False,
    }
    for backend in backend_names(args.backends or "sdpa"):
        config = EngineConfig(**sized | EngineConfig.given_cli_args(args) | {"backend": backend})
        config.validate()
        engine = make_engine(config)
        try:
            primary, cfg = engine.executor.backend.primary, engine.model_config
            for batch in batches:
                p = profile_decode(engine, batch, context, steps=args.steps, warmup=args.warmup, top=args.top)
                rows.append(
                    {
                        "model": model,
                        "backend": backend,
                        "provider": probe(type(primary), device, dtype, cfg.head_dim, config.block_size)[0],
                        "device": device_name(device),
                        "dtype": str(dtype).removeprefix("torch."),
                        "cuda_graphs": engine.cuda_graphs.split(":")[0] if cuda else "off",
                        "compile": config.compiles(device),
                        "batch": batch,
                        "context": context,
                        "running": p.running,
                        "kv_tokens": p.kv_tokens,
                        "unit": p.unit,
                        "per_step": p.per_step,
                        "per_layer": p.per_layer,
                        "attention_per_step": p.attention,
                        "outside_attention_per_layer": p.outside_attention_per_layer,
                        "device_ms_per_step": p.device_ms_per_step,
                        "wall_ms_per_step": p.wall_ms_per_step,
                        "busy_share": p.busy_share,
                        "git_sha": git_sha(),
                    }
                )
                tops[f"{backend} batch {batch}"] = p.top
                print(
                    f"{backend} batch {batch} x {context}: {p.per_step:.0f} {p.unit}/step, {p.per_layer:.1f} per layer"
                    + ("" if p.device_ms_per_step is None else f", {p.device_ms_per_step:.3f} ms device time/step")
                )
        finally:
            engine.shutdown()
    df = pd.DataFrame(rows)
    first = ["backend", "batch", "per_step", "per_layer", "attention_per_step", "device_ms_per_step"]
    print(terminal_table(df.drop(columns=["git_sha", "device"]).round(3), first))
    if args.out:
        prepare_out_dir(args.out)
        out = Path(args.out)
        df.to_csv(out / "profile.csv", index=False)
        lines = [f"# Decode-step profile ({device_name(device)})", "", markdown(df), ""]
        for title, top in tops.items():
            table = markdown(pd.DataFrame(top, columns=["name", "per step", "ms/step"]))
            lines += [f"## Top {df['unit'].iloc[0]}: {title}", "", table, ""]
        (out / "profile.md").write_text("\n".join(lines))
        (out / "profile-top.json").write_text(json.dumps(tops, indent=1))
        print(f"reports: {out / 'profile.csv'}, {out / 'profile.md'}")


def cmd_host_profile(args) -> None:
    """`profile --stand-in-device-ms D`: bench/host_profile.py's rows, a table, CSV, markdown and a PNG."""
    from pagedbench.bench.environment import git_sha
    from pagedbench.bench.host_profile import host_profile
    from pagedbench.bench.report_plots import busy_share_plot
    from pagedbench.bench.report_tables import markdown

    if not args.stand_in_device_ms > 0:
        raise ValueError(f"--stand-in-device-ms must be > 0, got {args.stand_in_device_ms}")
    batches = positive_ints(args.batch_sizes or "64,256", "--batch-sizes")
    output_lens = positive_ints(args.output_lens, "--output-lens")
    context, steps = args.context or 2048, max(args.steps, 20)
    modes = [args.async_scheduling] if args.async_scheduling is not None else [False, True]
    settings = {k: v for k, v in EngineConfig.given_cli_args(args).items() if k not in ("model", "async_scheduling")}
    rows = []
    for batch in batches:
        for output_len in output_lens:
            for run_ahead in modes:
                model, backend = args.model or "tiny-llama", (args.backends or "sdpa").split(",")[0]
                row = host_profile(
                    model, backend, args.stand_in_device_ms, batch, context, output_len, steps, run_ahead, settings
                )
                rows.append(
                    {"model": model, "backend": backend, "stand_in_device_ms": args.stand_in_device_ms, **asdict(row)}
                )
                print(f"async {run_ahead!s:5} batch {batch} output {output_len}: host {row.host_ms_per_step:.2f} ms, "
                      f"wall {row.wall_ms_per_step:.2f} ms, busy {row.busy_share:.2f}")  # fmt: skip
    df = pd.DataFrame(rows).assign(git_sha=git_sha())
    shown = {"async_scheduling": "async", "batch": "batch", "context": "context", "output_len": "output"}
    shown |= {"host_ms_per_step": "host ms", "wall_ms_per_step": "wall ms", "device_ms_per_step": "device ms"}
    print(markdown(df[list(shown | {"busy_share": 0})].rename(columns=shown | {"busy_share": "busy"}).round(3)))
    if args.out:
        prepare_out_dir(args.out)
        out = Path(args.out)
        df.to_csv(out / "host-profile.csv", index=False)
        title = f"Host benchmark: stand-in device {args.stand_in_device_ms:g} ms a step, context {context}"
        (out / "host-profile.md").write_text(f"# {title}\n\n{markdown(df)}\n")
        busy_share_plot(df, out / "host-profile.png", title)
        print(f"reports: {out / 'host-profile.csv'}, {out / 'host-profile.md'}, {out / 'host-profile.png'}")


def register(sub) -> None:
    p = sub.add_parser(
        "profile",
        help="kernels (CUDA) or operations (CPU) one steady decode step launches, device time, top kernels",
    )
    p.add_argument("--backends", default=None, help="comma-separated (default: sdpa)")
    p.add_argument("--batch-sizes", default=None, help="decoding sequences (default: 64,256 on cuda, 16 on cpu)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens per sequence (default: 1024 cuda, 128 cpu)")
    p.add_argument("--steps", type=int, default=3, help="profiled decode steps")
    p.add_argument("--warmup", type=int, default=2, help="decode steps before the profiled ones")
    p.add_argument("--top", type=int, default=15, help="kernels listed per profile")
    p.add_argument(
        "--stand-in-device-ms",
        type=float,
        default=None,
        help="the host benchmark: the real engine with the model's forward replaced by a stand-in device taking "
        "this many ms a step; rows per --batch-sizes x --output-lens, async scheduling off and on (unless "
        "--async-scheduling/--no-async-scheduling picks one): host_ms_per_step, wall_ms_per_step, busy_share",
    )
    p.add_argument(
        "--output-lens",
        default="8",
        help="the host benchmark: tokens each sequence has generated when the measured steps run (comma-separated)",
    )
    p.add_argument("--out", default=None, help="directory for profile.csv / profile.md (default: print only)")
    add_threads_flag(p)
    engine = p.add_argument_group(
        "engine settings (unset: profile's, model qwen3-0.6b on cuda and tiny-llama on cpu, sized to the batches, "
        "no prefix caching; else EngineConfig's)"
    )
    EngineConfig.add_cli_args(engine, skip=("backend",), unset="profile's")
    p.set_defaults(func=cmd_profile)
