"""Tensor- and pipeline-parallel ranks 1..N-1 as worker processes (child_processes.py);
rank 0 is the engine's own process. World rank = pipeline stage x tensor_parallel_size +
tensor-parallel rank.

Rank 0 alone schedules and samples: it sends each step's host arrays (a StepBatch) and its
page copies and swaps down one pipe per worker, and every rank runs the same model call with
its shard, meeting in the all-reduces (gloo on CPU, NCCL on CUDA); pipeline stages pass hidden
states on (pipeline.py). Logits reach rank 0 only.

Failure: a worker that raises sends its one-line error up its pipe and exits; its sockets
close, so rank 0's next collective fails at once, and rank 0 raises that worker's error.
Workers exit when their pipe closes (rank 0 gone) and ignore Ctrl-C, which rank 0 handles;
`shutdown()` joins them, then kills what is left."""

import contextlib
import datetime
import multiprocessing.connection
import os
import signal
import socket
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedbench import envs
from pagedbench.backends.base import one_line
from pagedbench.config import EngineConfig
from pagedbench.device.dtypes import resolve_device_dtype
from pagedbench.model.loader import ResolvedModel
from pagedbench.model.parallel import form_stage_groups, leave_stage_groups, placement
from pagedbench.worker.child_processes import child_context, exit_now, start_child
from pagedbench.worker.layer_attention import build_layer_attention
from pagedbench.worker.model_runner import ModelRunner
from pagedbench.worker.pipeline_stage import StageLink, StageRunner
from pagedbench.worker.step_batch import StepInputs

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)  # a first step may JIT-compile for minutes on a CPU
START_TIMEOUT_S = 600.0


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed; the message is its error."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker needs to build its shard (all picklable)."""

    config: EngineConfig
    model: ResolvedModel  # config.model as rank 0 resolved it
    rope_len: int
    size: int  # the world: tensor_parallel_size x pipeline_parallel_size
    port: int


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r runs on cuda:r (from the first visible GPU); CPU ranks share the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def init_group(device: torch.device, rank: int, size: int, port: int) -> None:
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, spec: WorkerSpec, conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    from pagedbench.model.loader import build_model, weights_path

    try:
        config = spec.config
        cfg, path = spec.model
        tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
        tp, stage = placement(rank, tp_size, pp_size, cfg.num_layers, config.pipeline_layer_partition)
        device, dtype = resolve_device_dtype(config.device, config.dtype)
        device = rank_device(device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # the ranks share the CPU's cores
            torch.set_num_threads(max(1, torch.get_num_threads() // spec.size))
        backend = build_layer_attention(
            config.backend, cfg, config.block_size, device, dtype, tp, config.kv_cache_dtype, config.batch_invariant
        )
        model = build_model(
            cfg, weights_path(path, config), device, dtype, spec.rope_len, config.seed, tp, config.preset_init, stage,
            config.compiles(device), config.batch_invariant,
        )  # fmt: skip
        conn.send(("built",))
        _, (num_blocks, num_cpu_blocks, (num_state_slots, num_cpu_state_slots)) = conn.recv()
        init_group(device, rank, spec.size, spec.port)  # first: a failure after it cannot leave rank 0 waiting
        form_stage_groups(tp_size, pp_size)
        runner = ModelRunner(
            model, backend, num_blocks, config.block_size, device, dtype, num_cpu_blocks,
            config.kv_cache_dtype, config.calculate_kv_scales, num_state_slots, config.index_cache_dtype,
            config.linear_attention_kernel, num_cpu_state_slots,
        )  # fmt: skip
        if pp_size > 1:
            runner = StageRunner(runner, StageLink(stage, tp.rank, tp_size))
        conn.send(("ready",))
        while True:
            try:
                method, args = conn.recv()
            except EOFError:  # rank 0 is gone
                break
            if method == "exit":
                break
            getattr(runner, method)(*args)
    except BaseException as e:
        if envs.enabled("PAGEDBENCH_DEBUG"):
            traceback.print_exc()
        try:
            who = "pipeline stage" if spec.config.pipeline_parallel_size > 1 else "tensor-parallel"
            conn.send(("error", f"{who} rank {rank}: {one_line(e)}"))
        except OSError:
            pass
        os._exit(1)  # closes this rank's sockets, so rank 0's collective fails now, not at a timeout
    if dist.is_initialized():
        dist.destroy_process_group()
    exit_now()


class Workers:
    """Ranks 1..size-1. Started before rank 0 builds its shard, so the ranks build in parallel."""

    def __init__(self, config: EngineConfig, model: ResolvedModel, rope_len: int, size: int):
        if dist.is_initialized():
            raise ValueError(
                "tensor_parallel_size or pipeline_parallel_size > 1 needs this process free of another "
                "torch.distributed group"
            )
        self.port = _free_port()
        spec = WorkerSpec(config, model, rope_len, size, self.port)
        ctx = child_context(resolve_device_dtype(config.device, config.dtype)[0])
        self.conns, self.procs = [], []
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            proc = start_child(ctx, _worker_main, (rank, spec, child), f"pagedbench-tp{rank}", daemon=True)
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.size, self.closed, self.config = size, False, config

    def start(self, device: torch.device, num_blocks: int, num_cpu_blocks: int, state_slots=(0, 0)) -> None:
        """Wait for every worker's shard, give them the cache size (and a hybrid model's state
        slots: on the device, and in CPU memory for swapped-out sequences), and form the group."""
        try:
            self._expect("built")
            self.send("init", num_blocks, num_cpu_blocks, state_slots)
            init_group(device, 0, self.size, self.port)
            form_stage_groups(self.config.tensor_parallel_size, self.config.pipeline_parallel_size)
            self._expect("ready")
        except BaseException:
            self.shutdown()
            raise

    def _expect(self, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = dict(zip(self.conns, self.procs))
        while waiting:
            ready = multiprocessing.connection.wait([*waiting, *(p.sentinel for p in waiting.values())], timeout=1.0)
            for conn, proc in list(waiting.items()):
                try:
                    message = conn.recv() if conn in ready and conn.poll() else None
                except (EOFError, OSError):
                    message = None
                if message is not None and message[0] == "error":
                    raise WorkerError(message[1])
                if message is not None:
                    waiting.pop(conn)
                elif proc.sentinel in ready or not proc.is_alive():
                    proc.join(timeout=1)
                    raise WorkerError(
                        f"tensor-parallel worker {proc.name} exited with code {proc.exitcode} before it was {what} "
                        "(a script that starts one needs the `if __name__ == '__main__':` guard)"
                    )
            if time.monotonic() > deadline:
                raise WorkerError(f"tensor-parallel workers did not get {what} within {START_TIMEOUT_S:.0f} s")

    def send(self, method: str, *args) -> None:
        for conn in self.conns:
            try:
                conn.send((method, args))
            except OSError:
                raise self.failure() from None

    def failure(self, timeout: float = 5.0) -> WorkerError:
        """The error of the worker that failed (waiting up to `timeout` s for it to say why)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for conn, proc in zip(self.conns, self.procs):
                try:
                    message = conn.recv() if conn.poll() else None
                except (EOFError, OSError):  # it died without a word
                    message = None
                if message is not None and message[0] == "error":
                    return WorkerError(message[1])
                if not proc.is_alive():
                    return WorkerError(f"tensor-parallel worker {proc.name} exited with code {proc.exitcode}")
            time.sleep(0.05)
        return WorkerError("a tensor-parallel collective failed, but no worker reported an error")

    def shutdown(self, broken: bool = False) -> None:
        """Stop every worker (asking first), leaving no process behind; idempotent. `broken`: a
        collective failed or a step was interrupted, so workers may be blocked in one and never
        read the request: they get a second, not five."""
        if self.closed:
            return
        self.closed = True
        stop_children(self.conns, self.procs, ("exit", ()), 1 if broken else 5)
        leave_stage_groups()
        if dist.is_initialized():
            dist.destroy_process_group()


def stop_children(conns: list, procs: list, exit_message: tuple, grace_s: float) -> None:
    """Ask each child process to exit (down its pipe), wait `grace_s` for it, then kill it; close the pipes."""
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send(exit_message)
    for proc in procs:
        proc.join(timeout=grace_s)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.close()


class ParallelRunner:
    """Rank 0's ModelRunner, with every call that touches the model or the cache mirrored on
    the workers first (same order on every rank)."""

    def __init__(self, runner: ModelRunner, workers: Workers):
        self.local, self.workers = runner, workers

    @property
    def backend(self):
        return self.local.backend

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.local.kv_cache

    def build_inputs(self, seqs, num_tokens: list[int]) -> StepInputs:
        return self.local.build_inputs(seqs, num_tokens)

    def copy_blocks(self, copies) -> None:
        self._everywhere("copy_blocks", copies)

    def swap_out(self, pairs) -> None:
        self._everywhere("swap_out", pairs)

    def swap_in(self, pairs) -> None:
        self._everywhere("swap_in", pairs)

    def copy_states(self, pairs) -> None:
        self._everywhere("copy_states", pairs)

    def run(self, inputs: StepInputs, backend_state, timer=None) -> torch.Tensor:
        self.workers.send("run_batch", inputs.batch)
        try:
            return self.local.run(inputs, backend_state, timer)
        except RuntimeError as e:
            raise self._broken(e) from None

    def _broken(self, e: RuntimeError) -> WorkerError:
        """The error to raise when a collective failed: the worker's that caused it."""
        error = e if isinstance(e, WorkerError) else self.workers.failure()
        self.workers.shutdown(broken=True)  # the group is broken: this engine cannot step again
        return error

    def _everywhere(self, method: str, *args) -> None:
        self.workers.send(method, *args)
        getattr(self.local, method)(*args)
