"""`pagedbench profile`: what one steady decode step launches, per backend and batch size: kernels
(CUDA) or operations (CPU) per step and per layer outside attention, device time, top kernels."""

import json
from pathlib import Path

import pandas as pd

from pagedbench.config import EngineConfig
from pagedbench.entrypoints.cli.common import add_threads_flag, backend_names, positive_ints, prepare_out_dir


def cmd_profile(args) -> None:
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
    p.add_argument("--out", default=None, help="directory for profile.csv / profile.md (default: print only)")
    add_threads_flag(p)
    engine = p.add_argument_group(
        "engine settings (unset: profile's, model qwen3-0.6b on cuda and tiny-llama on cpu, sized to the batches, "
        "no prefix caching; else EngineConfig's)"
    )
    EngineConfig.add_cli_args(engine, skip=("backend",), unset="profile's")
    p.set_defaults(func=cmd_profile)
