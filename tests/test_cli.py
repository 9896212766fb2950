"""The `pagedbench` command end to end (small workloads)."""

import pytest

from pagedbench.entrypoints.cli.main import main


def test_run_prints_throughput_table(capsys, tmp_path):
    args = ["--num-prompts", "3", "--input-len", "20", "--output-len", "5", "--no-warmup", "--out", str(tmp_path)]
    assert main(["run", *args]) == 0
    out = capsys.readouterr().out
    assert "output tok/s" in out and "total tok/s" in out
    assert "requests 3, output tokens 15," in " ".join(out.split())  # one run: its settings on a line above
    assert max(map(len, out.splitlines()[:-1])) <= 120  # the reports line lists paths
    row = next(line for line in out.splitlines() if line.startswith("| sdpa"))
    assert float(row.strip("|").split("|")[1]) > 0  # output tok/s, right after the backend


def test_backends_lists_every_backend_with_status(capsys):
    assert main(["backends", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    from pagedbench.backends.registry import list_backends

    first = " ".join(out.split("\n\n")[0].split())  # a backend a line, wrapped; the capability table follows
    rows = {name: first[first.index(f"{name}: ") :] for name in list_backends()}  # each from its line on
    assert rows["reference"].startswith("reference: available, torch") and rows["sdpa"].startswith("sdpa: available")
    assert rows["flash-attn"].startswith("flash-attn: unavailable, ") and "; no CUDA device" in rows["flash-attn"]
    for provider in ("fa3: ", "fa4: ", "fa2: ", "torch: "):  # why each provider was passed over
        assert provider in rows["flash-attn"]
    assert "flex: available, torch" in first and "flex compiled" in rows["flex"]
    assert max(map(len, out.splitlines())) <= 120


def test_version_and_help_show_defaults(capsys):
    import pytest
    import torch

    from pagedbench import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert (
        e.value.code == 0 and capsys.readouterr().out.strip() == f"pagedbench {__version__} (torch {torch.__version__})"
    )
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "(default: synthetic)" in capsys.readouterr().out


def test_unwritable_out_fails_before_running(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for command in (["run", "--num-prompts", "2"], ["kernels"], ["check"]):
        assert main([*command, "--out", str(blocker / "reports")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("pagedbench: error: cannot create the output directory") and "\n" not in err


def test_cpu_runs_the_tiny_preset_unless_told(tmp_path, capsys):
    args = ["--scenario", "mixed", "--scale", "0.02", "--no-warmup", "--device", "cpu", "--out", str(tmp_path)]
    assert main(["run", *args]) == 0
    out = capsys.readouterr().out
    assert "note: on cpu, model tiny-llama instead of the scenario's qwen3-0.6b" in out and "model tiny-llama" in out


def test_run_compares_nothing_with_itself(tmp_path):
    import pandas as pd

    assert (
        main(
            [
                "run",
                "--num-prompts",
                "2",
                "--input-len",
                "8",
                "--output-len",
                "2",
                "--no-warmup",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    rows = pd.read_csv(tmp_path / "run-synthetic.csv")
    assert rows["identical_token_share"].isna().all() and rows["throughput_vs_best"].isna().all()


ARGPARSE_FAILURES = {
    "bad int": (["run", "--num-prompts", "1e7"], "pagedbench run: error: argument --num-prompts", "pagedbench run"),
    "bad choice": (["run", "--kv-cache-dtype", "fp4"], "invalid choice: 'fp4'", "pagedbench run"),
    "bad json": (["run", "--speculative-config", "{bad json"], "argument --speculative-config", "pagedbench run"),
    "threads": (["run", "--threads", "x"], "argument --threads: invalid int value: 'x'", "pagedbench run"),
    "unknown option": (["run", "--bogus"], "unrecognized arguments: --bogus", "pagedbench run"),
    "unknown subcommand": (["frob"], "invalid choice: 'frob'", "pagedbench"),
    "no subcommand": ([], "the following arguments are required: command", "pagedbench"),
    "missing required": (
        ["report"],
        "pagedbench report: error: the following arguments are required",
        "pagedbench report",
    ),
    "bad float": (["kv-calc", "tiny-llama", "--memory", "lots"], "argument --memory", "pagedbench kv-calc"),
    "top-level option": (["--bogus"], "pagedbench: error: ", "pagedbench"),
    "ambiguous option": (["run", "--num", "3"], "ambiguous option: --num could match", "pagedbench run"),
    "not an object": (
        ["compare", "--structured-outputs", "[1]"],
        "argument --structured-outputs",
        "pagedbench compare",
    ),
    "newline in value": (["run", "--bogus\nvalue"], "unrecognized arguments: --bogus value", "pagedbench run"),
    "serve port": (["serve", "--port", "x"], "argument --port: invalid int value", "pagedbench serve"),
    "kernels": (["kernels", "--head-dim", "x"], "argument --head-dim: invalid int value", "pagedbench kernels"),
}


@pytest.mark.parametrize("argv,says,prog", ARGPARSE_FAILURES.values(), ids=ARGPARSE_FAILURES.keys())
def test_argparse_errors_are_one_line_with_a_help_pointer(argv, says, prog, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert e.value.code == 2 and out == ""
    assert len(lines) == 1 and lines[0].strip(), err
    assert says in lines[0] and lines[0].endswith(f"(see {prog} --help)") and "usage:" not in err


def test_every_subcommand_parser_has_the_one_line_error_class():
    import argparse

    from pagedbench.entrypoints.cli.common import CLIParser
    from pagedbench.entrypoints.cli.main import build_parser

    parser = build_parser()
    assert isinstance(parser, CLIParser)
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert sub.choices and all(type(p) is CLIParser for p in sub.choices.values())
