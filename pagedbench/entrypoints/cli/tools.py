"""`pagedbench report` and `kv-calc`: re-render reports from CSVs, KV-cache memory arithmetic."""

import textwrap

from pagedbench.backends.base import KV_CACHE_DTYPES
from pagedbench.entrypoints.cli.common import positive_ints
from pagedbench.model.presets import CUT_PRESETS, PRESETS

MAX_MEMORY_GIB = 2**20  # 1 PiB: far past any machine, short of numbers that print as nonsense


def cmd_report(args) -> None:
    from pathlib import Path

    from pagedbench.bench.report import load_csvs, render

    Path(args.out).mkdir(parents=True, exist_ok=True)
    paths = render(load_csvs(args.csv), Path(args.out), args.name)
    print(f"reports: {', '.join(map(str, paths))}")


def cmd_kv_calc(args) -> None:
    import torch

    from pagedbench.backends.base import kv_storage_dtype
    from pagedbench.bench.kv_calc import GIB, kv_bytes_per_token, kv_table
    from pagedbench.bench.report_tables import terminal_table
    from pagedbench.device.dtypes import DTYPES
    from pagedbench.model.loader import resolve_model_config

    args.dtype = args.dtype or ("bf16" if torch.cuda.is_available() else "fp32")  # the device's default, as run's
    if args.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {args.dtype!r}; choose one of {', '.join(DTYPES)}")
    if not 0 < args.memory <= MAX_MEMORY_GIB:
        raise ValueError(f"--memory must be in (0, {MAX_MEMORY_GIB}] GiB, got {args.memory:g}")
    cfg, _ = resolve_model_config(args.model)
    block_sizes = positive_ints(args.block_size, "--block-size")
    seq_lens = positive_ints(args.seq_len, "--seq-len") if args.seq_len else [cfg.max_position_embeddings]
    dtype = DTYPES[args.dtype]
    kv_dtypes = [k.strip() for k in args.kv_cache_dtype.split(",") if k.strip()]
    for kv in kv_dtypes:
        kv_storage_dtype(kv, dtype)  # an unknown name fails here, naming the known ones
    per_token = kv_bytes_per_token(cfg, dtype)
    if cfg.mla is None:
        shape = f"{cfg.num_kv_heads} KV heads x head_dim {cfg.head_dim} x 2 (K, V)"
    else:  # latent attention caches one plane per token and layer, the values a view of it
        shape = f"one latent of {cfg.mla.kv_lora_rank} + {cfg.mla.qk_rope_head_dim} rope dims (no separate V)"
    print_wrapped(
        f"{args.model}: {cfg.num_kv_layers} layers x {shape} x {dtype.itemsize} B ({args.dtype}) = {per_token:,} B "
        f"({per_token / 1024:g} KiB) per token unquantized; {args.memory:g} GiB of KV cache"
    )
    if args.model in CUT_PRESETS:  # say plainly what the figures answer for
        real = CUT_PRESETS[args.model]
        kept = cfg.num_kv_layers  # of the layers that cache K/V (a hybrid's attention layers)
        print_wrapped(
            f"note: preset {args.model} keeps {kept} of the real model's {real} layers, and the figures "
            f"below are for that cut model; the real model caches {real / kept:g}x as much per token "
            f"({per_token * real // kept:,} B), so it fits {kept / real:.3g}x the blocks and sequences"
        )
    if cfg.linear is not None:
        from pagedbench.worker.linear_state import state_bytes_per_sequence

        attending = cfg.num_layers - sum(cfg.linear.layers)
        print_wrapped(
            f"note: hybrid model: {attending} of {cfg.num_layers} layers attend over pages; the other "
            f"{sum(cfg.linear.layers)} keep a DeltaNet state of {state_bytes_per_sequence(cfg, dtype) / 2**20:.1f} MiB "
            "per sequence (counted in 'concurrent seqs')"
        )
    table = kv_table(cfg, dtype, int(args.memory * GIB), block_sizes, seq_lens, kv_dtypes)
    print(terminal_table(table, ["kv_cache_dtype", "block size", "seq len", "blocks", "concurrent seqs"]))


def print_wrapped(text: str) -> None:
    """A note wrapped for a 120-column terminal."""
    print(textwrap.fill(text, 120, subsequent_indent="  "))


def register_report(sub) -> None:
    rep = sub.add_parser("report", help="re-render markdown and plots from CSVs (merging runs and machines)")
    rep.add_argument("csv", nargs="+", help="CSV files written by run, compare, kernels, check or bench-serve")
    rep.add_argument("--out", default="reports")
    rep.add_argument("--name", default="report", help="file name stem of the markdown and PNGs")
    rep.set_defaults(func=cmd_report)


def register_kv_calc(sub) -> None:
    kv = sub.add_parser("kv-calc", help="KV-cache memory: bytes per token and block, blocks, concurrent sequences")
    kv.add_argument("model", help=f"HF model directory or preset ({', '.join(PRESETS)})")
    kv.add_argument("--block-size", default="16", help="one or more, comma-separated (a sweep)")
    kv.add_argument("--memory", type=float, default=40.0, help="GiB given to the KV cache")
    kv.add_argument(
        "--dtype",
        default=None,
        help="the model's dtype, the cache's under kv_cache_dtype auto (default: the device's, as run's: bf16 on "
        "cuda, fp32 on cpu)",
    )
    kv.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help=f"how pages are stored, one or more of {', '.join(KV_CACHE_DTYPES)} (e.g. auto,fp8,int8)",
    )
    kv.add_argument("--seq-len", default=None, help="sequence lengths, comma-separated (default: the model's max)")
    kv.set_defaults(func=cmd_kv_calc)
