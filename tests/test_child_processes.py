"""The engine's child processes (tensor/pipeline ranks, data-parallel replicas) start in the parent's
current environment and working directory, on a CPU forked from a fork server started once."""

import torch

from pagedbench.worker.child_processes import child_context, start_child
from tests.helpers import report_environment


def test_a_cpu_child_sees_the_parents_environment_as_it_is_now(monkeypatch, tmp_path):
    ctx = child_context(torch.device("cpu"))
    assert ctx.get_start_method() == "forkserver"
    seen = []
    for value, threads in (("first", "1"), ("second", "2")):  # the second child: after the server started
        monkeypatch.setenv("PAGEDBENCH_TEST_VALUE", value)
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
        monkeypatch.chdir(tmp_path)
        parent, child = ctx.Pipe()
        proc = start_child(ctx, report_environment, (child, "PAGEDBENCH_TEST_VALUE"), "pagedbench-test", daemon=True)
        child.close()
        seen.append(parent.recv())
        proc.join(timeout=30)
        assert proc.exitcode == 0
    assert seen == [("first", str(tmp_path), 1), ("second", str(tmp_path), 2)]
    parent, child = ctx.Pipe()  # `env` on top of the parent's (a data-parallel replica's GPUs)
    given = {"PAGEDBENCH_TEST_VALUE": "3"}
    proc = start_child(ctx, report_environment, (child, "PAGEDBENCH_TEST_VALUE"), "x", True, given)
    child.close()
    assert parent.recv()[0] == "3"
    proc.join(timeout=30)


def test_cuda_children_are_spawned():
    assert child_context(torch.device("cuda")).get_start_method() == "spawn"
