"""How the engine starts its child processes (tensor/pipeline-parallel ranks, data-parallel replicas).

With CUDA: `spawn`, a fresh interpreter per child (a process that may have touched CUDA never forks).
On a CPU: a fork server that imported torch and the engine once; each child is forked from it in
milliseconds instead of importing them again (about 2 s of CPU per child, which on a 2-core machine
a TP 2 start, or a test suite of them, pays in full). Either way the child runs `spawn`'s preparation
(sys.path, the working directory, the `__main__` module: a script still needs its
`if __name__ == '__main__':` guard), and it starts with the environment the parent has now, not the
one the fork server was started with."""

import os
import sys

import torch
import torch.multiprocessing as mp

PRELOAD = ["pagedbench.worker.tp_workers", "pagedbench.engine.data_parallel"]


def child_context(device: torch.device):
    """The multiprocessing context for children of an engine on `device`."""
    if device.type == "cuda" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (once per parent process)
    return ctx


def start_child(ctx, target, args: tuple, name: str, daemon: bool, env: dict[str, str] | None = None):
    """A started Process running target(*args) in the parent's current environment plus `env`."""
    proc = ctx.Process(
        target=_in_environment, args=(dict(os.environ) | (env or {}), target, args), name=name, daemon=daemon
    )
    proc.start()
    return proc


def _in_environment(environment: dict[str, str], target, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environment)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # as a fresh interpreter would read it
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    target(*args)


def exit_now() -> None:
    """A child's clean end without the interpreter's teardown of torch (about half a second that rank 0,
    or the data-parallel front, would wait in shutdown): its streams flushed, nothing else left to do."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
