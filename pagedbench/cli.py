"""The `pagedbench` command: run a workload on one backend, list backends."""
import argparse
import sys

import pandas as pd
import torch

from pagedbench.bench import run_workload, synthetic_workload
from pagedbench.config import EngineConfig
from pagedbench.engine import LLMEngine, resolve_device_dtype
from pagedbench.presets import PRESETS


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama", help=f"HF model directory or preset ({', '.join(PRESETS)})")
    p.add_argument("--device", default=None, help="cuda if available, else cpu")
    p.add_argument("--dtype", default=None, help="bf16 on cuda, fp32 on cpu")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)


def engine_config(args, backend: str) -> EngineConfig:
    return EngineConfig(model=args.model, backend=backend, device=args.device, dtype=args.dtype,
                        block_size=args.block_size, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                        seed=args.seed)


def cmd_run(args) -> None:
    engine = LLMEngine(engine_config(args, args.backend))
    vocab = engine.model_config.vocab_size
    if args.warmup:
        run_workload(engine, synthetic_workload(min(args.num_prompts, 4), args.input_len, 4, vocab, seed=args.seed + 1))
    result = run_workload(engine, synthetic_workload(args.num_prompts, args.input_len, args.output_len, vocab, args.seed))
    table = pd.DataFrame([{
        "backend": result["backend"], "device": result["device"], "dtype": result["dtype"],
        "requests": result["num_requests"], "output tokens": result["total_output_tokens"],
        "duration s": round(result["duration_s"], 2), "output tok/s": round(result["output_throughput"], 1),
        "total tok/s": round(result["total_token_throughput"], 1), "steps": result["steps"],
        "preemptions": result["preemptions"], "prepare share %": round(100 * result["backend_prepare_share"], 2),
    }])
    print(table.to_markdown(index=False))


def cmd_backends(args) -> None:
    from pagedbench.backends.registry import get_backend, list_backends

    device, dtype = resolve_device_dtype(args.device, args.dtype)
    rows = []
    for name in list_backends():
        cls = get_backend(name)
        reason = cls.unavailable_reason(device, dtype, args.head_dim, args.block_size)
        rows.append({"backend": name, "provider": cls.provider(), "status": "unavailable" if reason else "available",
                     "reason": reason or ""})
    print(f"device {device}, dtype {str(dtype).removeprefix('torch.')}, head_dim {args.head_dim}, "
          f"block_size {args.block_size}, torch {torch.__version__}")
    print(pd.DataFrame(rows).to_markdown(index=False))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedbench", description="Compare paged-attention backends in one engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a synthetic workload on one backend and print throughput")
    run.add_argument("--backend", default="sdpa")
    add_engine_args(run)
    run.add_argument("--num-prompts", type=int, default=32)
    run.add_argument("--input-len", type=int, default=128)
    run.add_argument("--output-len", type=int, default=64)
    run.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed warmup run")
    run.set_defaults(func=cmd_run)

    backends = sub.add_parser("backends", help="list registered backends and whether they run here")
    backends.add_argument("--device", default=None)
    backends.add_argument("--dtype", default=None)
    backends.add_argument("--head-dim", type=int, default=128)
    backends.add_argument("--block-size", type=int, default=16)
    backends.set_defaults(func=cmd_backends)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"pagedbench: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
