"""Ctrl-C outside a command's own handling (keep_partial's rows, serve's drain): one line, exit 130,
no traceback."""

from pagedbench.bench import environment
from pagedbench.entrypoints.cli.main import main


def test_ctrl_c_while_check_sets_up_is_one_line_and_130(monkeypatch, tmp_path, capsys):
    def interrupted(*args, **kwargs):  # check reads the environment before its grid (and its model)
        raise KeyboardInterrupt

    monkeypatch.setattr(environment, "environment", interrupted)
    assert main(["check", "--backends", "sdpa", "--threads", "1", "--out", str(tmp_path)]) == 130
    assert capsys.readouterr().err == "pagedbench: interrupted\n"


def test_ctrl_c_in_bench_serve_is_one_line_and_130(monkeypatch, tmp_path, capsys):
    from pagedbench.entrypoints.cli import serve

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(serve, "_server_card", interrupted)
    assert main(["bench-serve", "--base-url", "http://127.0.0.1:9", "--out", str(tmp_path)]) == 130
    assert capsys.readouterr().err == "pagedbench: interrupted\n"
