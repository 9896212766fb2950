"""flex's decode option search run twice on one problem, uncached, to show whether its result reproduces.

    python scripts/flex_tune_twice.py [--batch 16] [--context 2048] [--cache-pages 17600]
        [--heads 32/8] [--head-dim 128] [--page-size 16] [--runs 2]

On CUDA each candidate compiles (in the tuner's own wrapper) and is timed as do_bench times a kernel;
on a CPU eager flex is timed by wall clock (its kernel takes no options: only noise tells them apart).
Prints the problem and its disk key, then per run the winner, its time and the candidates timed, and
whether the runs agree within 10 % (flex_tune.agree).
"""

import argparse
import sys

import torch
from pagedbench.backends import flex_tune
from pagedbench.backends.flex import FlexBackend
from pagedbench.backends.flex_tune import DecodeProblem, context_class, describe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="static decode batch (a power of two)")
    parser.add_argument("--context", type=int, default=2048, help="longest context in tokens (its class is searched)")
    parser.add_argument("--cache-pages", type=int, default=17600, help="pages in the cache (the engine's size)")
    parser.add_argument("--heads", default="32/8", help="query/KV heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args(argv)
    heads, kv_heads = (int(n) for n in args.heads.split("/"))
    cuda = torch.cuda.is_available()
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    backend = FlexBackend(heads, kv_heads, args.head_dim, args.head_dim**-0.5, args.page_size, device, dtype)
    tuner = backend.decode_tuner
    if not cuda:
        tuner.measure = flex_tune.eager_cpu_timer
    slots = args.cache_pages * args.page_size
    k = torch.zeros(1, kv_heads, slots, args.head_dim, device=device, dtype=dtype)
    problem = DecodeProblem(args.batch, 1, context_class(args.context, args.page_size), args.cache_pages)
    print(f"{device}: {problem} ({problem.row_pages} pages a row); key {tuner.shape(problem).key}")
    base = backend.kernel_options["decode"] or {}
    runs = tuner.repeat_search(problem, base, (k, k, backend.scale, None, None), runs=args.runs)
    for i, run in enumerate(runs, 1):
        print(f"run {i}: {describe(run.options)}: {run.seconds * 1e6:.1f} us ({len(run.timings)} candidates)")
    agreed = all(flex_tune.agree(runs[0], run) for run in runs[1:])
    print("the runs agree within 10 %" if agreed else "the runs disagree beyond 10 %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
