"""Under torchrun, a rank other than 0 says who it is and what happened to it, and leaves no
scratch directory behind."""

import sys
from types import SimpleNamespace

from pagedbench.entrypoints.cli import main as cli
from pagedbench.entrypoints.cli.common import Interrupted


def as_rank(monkeypatch, rank: int) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(rank))


def test_a_rank_stopped_by_the_launcher_says_so(monkeypatch, capsys):
    as_rank(monkeypatch, 1)
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # the quiet rank's devnull is undone after the test

    def stopped(args):
        raise Interrupted("interrupted before any row was complete; nothing written")

    parser = SimpleNamespace(parse_args=lambda argv: SimpleNamespace(func=stopped))
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    assert cli.main([]) == 130
    err = capsys.readouterr().err
    assert err == "pagedbench rank 1: stopped by the launcher (another rank ended the run)\n"


def test_a_ranks_error_names_the_rank_and_rank_0_speaks_plainly(monkeypatch, capsys):
    def bad(args):
        raise ValueError("no such thing")

    parser = SimpleNamespace(parse_args=lambda argv: SimpleNamespace(func=bad))
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.setattr(sys, "stdout", sys.stdout)
    as_rank(monkeypatch, 3)
    assert cli.main([]) == 2 and capsys.readouterr().err == "pagedbench rank 3: error: no such thing\n"
    as_rank(monkeypatch, 0)
    assert cli.main([]) == 2 and capsys.readouterr().err == "pagedbench: error: no such thing\n"


def test_a_quiet_ranks_scratch_directory_is_removed_at_exit(monkeypatch):
    import os

    as_rank(monkeypatch, 1)
    monkeypatch.setattr(sys, "stdout", sys.stdout)
    registered = []
    monkeypatch.setattr(cli.atexit, "register", lambda fn, *a, **k: registered.append((fn, a, k)))
    args = SimpleNamespace(out="reports")
    cli._launched_rank_quiet(args)
    assert args.out != "reports" and os.path.isdir(args.out) and "pagedbench-rank1-" in args.out
    for fn, a, k in registered:  # what the process does as it exits
        fn(*a, **k)
    assert not os.path.exists(args.out)


def test_the_busy_machine_warning_is_one_short_line(monkeypatch):
    import torch

    from pagedbench.bench import environment

    monkeypatch.setattr(environment, "load_average", lambda: 5.0)
    warning = environment.busy_warning(torch.device("cpu"))
    assert "busy machine (load 5.00" in warning and len("pagedbench: warning: " + warning) <= 120
    monkeypatch.setattr(environment, "load_average", lambda: 0.0)
    assert environment.busy_warning(torch.device("cpu")) is None
