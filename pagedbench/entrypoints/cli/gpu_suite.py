"""`pagedbench gpu-suite`: the project's measurements on a CUDA machine within a time budget, packed
into one tarball (pagedbench/bench/gpu_suite.py)."""

import os
import sys
from pathlib import Path

from pagedbench.bench.gpu_ledger import gpu_slug, read_ledgers
from pagedbench.entrypoints.cli.common import NothingMeasured


def cmd_gpu_suite(args) -> int:
    from pagedbench.bench import gpu_suite as suite

    out = Path(args.out or os.environ.get("OUT") or "gpu-suite")
    work = Path(args.work)
    steps = suite.default_steps(work / "reports", args.scale, args.num_blocks)
    known = [s.name for s in steps]
    if args.steps:
        wanted = [s.strip() for s in args.steps.split(",") if s.strip()]
        unknown = [w for w in wanted if w not in known]
        if unknown:
            raise ValueError(f"unknown suite step {unknown[0]!r}; known: {', '.join(known)}")
        steps = [s for s in steps if s.name in wanted]
    if args.next:
        steps, done = suite.due_steps(steps, read_ledgers(ledger_dir(args.ledger_dir)))
        for line in done:
            print(f"pagedbench: gpu-suite --next leaves out {line}")
    if args.budget <= 0:
        raise ValueError(f"--budget must be > 0 seconds, got {args.budget:g}")
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if args.fa4_parts:
        site = suite.install_fa4([Path(p) for p in args.fa4_parts.split(",")])
        if site is None:
            print(f"pagedbench: FA4: half of the wheels kept in {suite.STASH}; pass the other half in the next call")
        else:
            cute = site / "nvidia_cutlass_dsl" / "dsl_packages"  # the CuTe DSL's .pth line, as PYTHONPATH
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(cute), env.get("PYTHONPATH")]))
    results = suite.run_suite(steps, work, out, args.budget, env=env)
    table = suite.write_summary(results, work)
    print(f"\nGPU suite: {out / suite.TARBALL} (work directory {work})\n")
    print(table)
    sys.stdout.flush()
    if not any(r.status == "ok" for r in results):
        raise NothingMeasured("no suite step ran to completion")
    return 0 if all(r.status in ("ok", "skipped") for r in results) else 1


def ledger_dir(given: str | None) -> Path:
    """Where --next reads the ledgers: --ledger-dir, else reports/<this card> (reports/nvidia-h200)."""
    if given:
        return Path(given)
    import torch

    if not torch.cuda.is_available():
        raise ValueError("--next reads reports/<card>/: pass --ledger-dir on a machine without CUDA")
    return Path("reports") / gpu_slug(torch.cuda.get_device_name(0))


def register(sub) -> None:
    p = sub.add_parser(
        "gpu-suite",
        help="environment, step profile, decode kernels, compare at scale 1, CUDA tests, FA4: one budget, one tarball",
    )
    p.add_argument("--budget", type=float, default=480, help="seconds for every step together")
    p.add_argument("--out", default=None, help="where the tarball goes (default: $OUT, else ./gpu-suite)")
    p.add_argument("--work", default="gpu-suite-work", help="directory of the logs and reports being packed")
    p.add_argument("--steps", default=None, help="comma-separated subset of the steps, in the suite's order")
    p.add_argument(
        "--next",
        action="store_true",
        help="only the steps without a result on the code as it is now, by the ledgers committed under "
        "reports/<card>/ (gpu_ledger.py); --steps then picks among those",
    )
    p.add_argument("--ledger-dir", default=None, help="--next's ledgers (default: reports/<this card's name>)")
    p.add_argument("--scale", type=float, default=1.0, help="the compare step's scale of the mixed scenario")
    p.add_argument("--num-blocks", type=int, default=16384, help="the KV budget of every backend in compare")
    p.add_argument(
        "--fa4-parts",
        default=None,
        help="FA4's wheel-tar halves (../shared/gpu/pack.sh), comma-separated; a half kept from an earlier call "
        "on the same warm machine counts",
    )
    p.set_defaults(func=cmd_gpu_suite)
