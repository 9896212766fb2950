"""The `pagedbench` command: run / compare scenarios, microbenchmark attention kernels, check
backends against an oracle, serve and load-test, re-render reports, list scenarios and backends.
Each command group lives in its own module (run, kernels, serve, tools) with its parser; here are
the root parser, the one-line errors and the exit codes."""

import argparse
import atexit
import functools
import logging
import os
import shutil
import sys
import tempfile

import torch

from pagedbench.entrypoints.cli import gpu_suite, kernels, profile, run, serve, tools
from pagedbench.entrypoints.cli.common import CLIParser, Interrupted, NothingMeasured, apply_threads
from pagedbench.worker.tp_workers import WorkerError


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


def build_parser() -> CLIParser:
    from importlib.metadata import version

    parser = CLIParser(
        prog="pagedbench",
        description="Compare paged-attention backends in one engine.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"pagedbench {version('pagedbench')} (torch {torch.__version__})"
    )
    parser.epilog = (
        "Errors are one line on stderr with exit code 2; `check` exits 1 when a case fails, and run, "
        "compare, kernels, check and bench-serve exit 1 when they measured nothing."
    )
    sub = parser.add_subparsers(dest="command", required=True)  # CLIParser's: one-line errors too
    sub.add_parser = functools.partial(sub.add_parser, formatter_class=_HelpFormatter)
    commands = (  # in the order `pagedbench --help` lists them
        run.register,  # run, compare
        kernels.register,  # kernels, check
        tools.register_report,
        run.register_scenarios,
        tools.register_kv_calc,
        serve.register,  # serve, bench-serve
        kernels.register_backends,
        profile.register,
        gpu_suite.register,
    )
    for register in commands:
        register(sub)
    return parser


def _log_to_stderr() -> None:
    """The library's INFO messages (a JIT compile starting, say) on stderr; other libraries' untouched."""
    log = logging.getLogger("pagedbench")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("pagedbench: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def _launched_rank_quiet(args) -> None:
    """Under torchrun every rank runs the command (an external-launcher engine, or its share of the
    kernels/check grid); rank 0 alone prints and writes reports (the others write to a scratch directory)."""
    rank = _launched_rank()
    if rank:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the rest of the process)
        if hasattr(args, "out"):
            args.out = tempfile.mkdtemp(prefix=f"pagedbench-rank{rank}-")
            atexit.register(shutil.rmtree, args.out, ignore_errors=True)  # scratch: nothing there is kept


def _launched_rank() -> int:
    """This process's rank under torchrun (0 outside it)."""
    return int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0


def _who() -> str:
    """How a message names its sender: "pagedbench" on rank 0 or alone, "pagedbench rank N" under torchrun."""
    rank = _launched_rank()
    return f"pagedbench rank {rank}" if rank else "pagedbench"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _launched_rank_quiet(args)
    _log_to_stderr()
    try:
        if hasattr(args, "threads"):  # the commands that compute here (serve's LLM chooses its own)
            apply_threads(args.threads)
        return args.func(args) or 0
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"{_who()}: error: {e}", file=sys.stderr)
        return 2
    except NothingMeasured as e:
        print(f"{_who()}: error: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:
        if _launched_rank():  # torchrun stops the other ranks when one fails: rank 0's reports say why
            print(f"{_who()}: stopped by the launcher (another rank ended the run)", file=sys.stderr)
        else:
            print(f"pagedbench: {e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:  # before or outside a command's own handling (keep_partial's, serve's)
        print(f"{_who()}: interrupted", file=sys.stderr)
        return 130
    except WorkerError as e:  # a tensor-parallel rank failed: its own one-line error
        print(f"{_who()}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
