"""What several `pagedbench` commands share: backend lists, the output directory and report
names that never replace an earlier run's, partial results on Ctrl-C or SIGTERM, the busy-machine
warning, integer-list flags, the parser class whose errors are one line."""

import argparse
import contextlib
import os
import signal
import threading
from pathlib import Path

import torch

from pagedbench.device.cpu_threads import choose_threads
from pagedbench.device.dtypes import resolve_device_dtype


class CLIParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr, exit 2, no usage block:
    `pagedbench run: error: argument --threads: invalid int value: 'x' (see pagedbench run --help)`.
    add_subparsers gives every subcommand's parser this class too."""

    def add_subparsers(self, **kwargs):
        kwargs.setdefault("parser_class", type(self))
        return super().add_subparsers(**kwargs)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:  # an unknown option after a subcommand is that subcommand's: its help lists the options
            self._innermost(namespace).error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace

    def _innermost(self, namespace) -> "CLIParser":
        """The parser of the subcommand the namespace holds (this one when there is none)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(namespace, action.dest, None))
                if isinstance(chosen, CLIParser):
                    return chosen._innermost(namespace)
        return self

    def error(self, message: str):
        message = " ".join(str(message).splitlines())  # an argument value may hold a newline
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def backend_names(text: str | None) -> list[str]:
    """Comma-separated names; every registered backend when not given."""
    from pagedbench.backends.registry import list_backends

    if text is None:
        return list_backends()
    names = [b.strip() for b in text.split(",") if b.strip()]
    if not names:
        raise ValueError(f"--backends {text!r} names no backend")
    return names


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
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the output directory {path!r}: {e.strerror}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write reports to {path!r}: permission denied")


def report_stem(out: str, base: str, overwrite: bool) -> str:
    """The file stem a command writes under `out`: `base`, or -- when `base`.csv is there from an
    earlier run and --overwrite is not given -- the first free `base-2`, `base-3`, ... (so a
    second run never replaces the first one's results)."""
    folder = Path(out)
    if overwrite or not (folder / f"{base}.csv").exists():
        return base
    n = 2
    while (folder / f"{base}-{n}.csv").exists():
        n += 1
    stem = f"{base}-{n}"
    print(f"pagedbench: note: {folder / base}.csv is an earlier run's; writing {stem}.* (--overwrite replaces it)")
    return stem


def add_threads_flag(parser) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: OMP_NUM_THREADS, else the usable cores less those busy at start)",
    )


def apply_threads(threads: int | None) -> None:
    """--threads: torch's CPU thread count for this command (recorded as cpu_threads in every row);
    without it, OMP_NUM_THREADS, else the usable cores less the busy ones (device.cpu_threads)."""
    if threads is None:
        choose_threads()
        return
    if not 1 <= threads <= 4 * (os.cpu_count() or 1):
        raise ValueError(f"--threads must be in 1..{4 * (os.cpu_count() or 1)}, got {threads}")
    torch.set_num_threads(threads)


def add_overwrite_flag(parser) -> None:
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an earlier run's reports of the same name in --out"
    )


class NothingMeasured(Exception):
    """A command that ran but measured nothing (every backend unavailable, every request failed):
    its report is written, and it exits 1."""


class Interrupted(Exception):
    """A long command stopped by Ctrl-C or SIGTERM after writing what it had measured."""


@contextlib.contextmanager
def keep_partial(log):
    """On Ctrl-C or SIGTERM (a time limit), render the rows measured so far, then stop."""
    from pagedbench.bench.report import render, tidy

    caught = threading.Event()

    def raise_again():  # raised inside a finalizer (torch.compile's weakrefs), the interrupt is swallowed
        while not caught.wait(2.0):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)  # wakes a blocking call too

    retry = threading.Thread(target=raise_again, daemon=True)

    def terminate(signum, frame):
        if caught.is_set():  # the partial report is being written
            return
        if not retry.is_alive():
            with contextlib.suppress(RuntimeError):  # started once
                retry.start()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    except KeyboardInterrupt:
        caught.set()
        if not len(log):
            raise Interrupted("interrupted before any row was complete; nothing written") from None
        paths = [log.path, *render(tidy(list(log), log.kind, log.command), log.path.parent, log.path.stem)]
        raise Interrupted(f"interrupted after {len(log)} rows; kept: {', '.join(map(str, paths))}") from None
    finally:
        caught.set()
        signal.signal(signal.SIGTERM, previous)


def warn_if_busy(device: torch.device) -> None:
    from pagedbench.bench.environment import busy_warning

    warning = busy_warning(device)
    if warning:  # on stdout, beside the figures it qualifies (stderr is for errors: one line each)
        print(f"pagedbench: warning: {warning}")


def int_list(text: str, name: str, sep: str = ",", length: int | None = None) -> list[int]:
    try:
        values = [int(v) for v in text.split(sep)]
    except ValueError:
        values = []
    if not values or length not in (None, len(values)):
        count = f"{length} " if length else ""
        raise ValueError(f"{name} must be {count}integers separated by {sep!r}, got {text!r}")
    return values


def positive_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes positive integers, got {text!r}")
    return values
