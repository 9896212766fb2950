"""The `pagedbench` command end to end (small workloads)."""

from pagedbench.entrypoints.cli.main import main


def test_run_prints_throughput_table(capsys, tmp_path):
    args = ["--num-prompts", "3", "--input-len", "20", "--output-len", "5", "--no-warmup", "--out", str(tmp_path)]
    assert main(["run", *args]) == 0
    out = capsys.readouterr().out
    assert "output tok/s" in out and "total tok/s" in out
    row = next(line for line in out.splitlines() if line.startswith("| sdpa"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "3" and cells[4] == "15"  # requests, output tokens


def test_backends_lists_every_backend_with_status(capsys):
    assert main(["backends", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    from pagedbench.backends.registry import list_backends

    first_table = out.split("\n\n")[0]  # the capability table follows
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in first_table.splitlines()[3:]]
    rows = {c[0]: c for c in cells}  # backend -> [backend, provider, status, reason]
    assert set(rows) == set(list_backends())
    assert rows["reference"][2:] == ["available", ""] and rows["sdpa"][2] == "available"
    assert rows["flash-attn"][2] == "unavailable" and rows["flash-attn"][3].startswith("no CUDA device")
    for provider in ("fa3: ", "fa4: ", "fa2: ", "torch: "):  # why each provider was passed over
        assert provider in rows["flash-attn"][3]
    assert rows["flex"][1].endswith("flex compiled")


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
