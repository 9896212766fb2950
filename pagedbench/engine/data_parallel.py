"""Data parallelism (vLLM's data_parallel_size): N engine replicas, each a whole LLMEngine in its
own process (spawn) with its own KV cache, scheduler and device (GPUs i x world .. on CUDA; the
CPU's cores shared out), behind a front that looks like one LLMEngine.

The front validates a request (its own tokenizer and InputProcessor, so a bad one is refused
before anything is queued) and gives it to the replica with the fewest unfinished requests
(waiting plus running). Replicas step on their own and send their outputs up a pipe as they come;
`step()` returns whatever arrived. A replica that fails sends its one-line error and exits: the
front raises it and stops the others."""

import atexit
import dataclasses
import itertools
import multiprocessing.connection
import os
import secrets
import signal
import time
import traceback
import weakref
from collections.abc import Iterable

import torch

from pagedbench import envs
from pagedbench.backends.base import one_line
from pagedbench.config import EngineConfig
from pagedbench.device.dtypes import resolve_device_dtype
from pagedbench.engine.input_processor import InputProcessor
from pagedbench.engine.llm_engine import LLMEngine
from pagedbench.engine.outputs import RequestOutput
from pagedbench.engine.stats import EngineStats, RunCounters
from pagedbench.engine.structured_outputs import StructuredOutputManager
from pagedbench.model.loader import ResolvedModel, resolve_model_config
from pagedbench.model.tokenizer import tokenizer_for
from pagedbench.worker.child_processes import child_context, exit_now, start_child
from pagedbench.worker.tp_workers import START_TIMEOUT_S, WorkerError, stop_children

# What every engine's gauges() holds (besides num_blocks and speculation's): a front reports zeros
# for them until its replicas have sent theirs.
GAUGE_NAMES = (
    "running", "waiting", "swapped", "used_blocks", "prompt_tokens", "generation_tokens", "preemptions",
    "prefix_queries", "prefix_hits",
)  # fmt: skip


def make_engine(config: EngineConfig, logits_processors: list | None = None, model: ResolvedModel | None = None):
    """An LLMEngine, or with data_parallel_size > 1 a DataParallelEngine over that many; `model`
    is config.model already resolved by the command, if it was."""
    if config.data_parallel_size > 1:
        return DataParallelEngine(config, logits_processors, model)
    return LLMEngine(config, logits_processors, model)


def _replica_main(
    index: int, config: EngineConfig, logits_processors, model: ResolvedModel, threads: int, conn
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front's to handle
    try:
        if threads:
            torch.set_num_threads(threads)
        engine = LLMEngine(config, logits_processors, model)
        info = {"max_model_len": engine.max_model_len, "num_blocks": engine.num_blocks}
        conn.send(("ready", info | {"cuda_graphs": engine.cuda_graphs, "world_size": engine.world_size}))
        while True:
            idle = not engine.has_unfinished_requests()
            while conn.poll(None if idle else 0):  # an idle replica waits for work
                idle = False
                message = conn.recv()
                if message[0] == "exit":
                    engine.shutdown()
                    exit_now()
                if message[0] == "add":
                    engine.add_request(*message[1])
                elif message[0] == "abort":
                    engine.abort_request(message[1])
                else:  # ("call", method, args): the front waits for its result
                    conn.send(("result", getattr(engine, message[1])(*message[2])))
            if engine.has_unfinished_requests():
                # every step, outputs or none (FINAL_ONLY requests make none until they finish): the
                # front's step() returns each step, so its caller adds arrivals on time; gauges stay fresh
                conn.send(("outputs", engine.step(), engine.gauges()))
    except BaseException as e:
        if envs.enabled("PAGEDBENCH_DEBUG"):
            traceback.print_exc()
        try:
            conn.send(("error", f"data-parallel replica {index}: {one_line(e)}"))
        except OSError:
            pass
        os._exit(1)


def replica_config(config: EngineConfig, index: int) -> tuple[EngineConfig, dict[str, str]]:
    """Replica `index`'s settings (one replica, its seed the front's) and the environment it starts
    with: on CUDA, the GPUs of its ranks (tensor x pipeline parallel) only."""
    replica = dataclasses.replace(config, data_parallel_size=1)
    device, _ = resolve_device_dtype(config.device, config.dtype)
    if device.type != "cuda":
        return replica, {}
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if len(gpus) < world * config.data_parallel_size:
        raise ValueError(
            f"data_parallel_size={config.data_parallel_size} x {world} GPUs per replica needs "
            f"{world * config.data_parallel_size} GPUs; {len(gpus)} visible"
        )
    return dataclasses.replace(replica, device="cuda"), {
        "CUDA_VISIBLE_DEVICES": ",".join(gpus[index * world : (index + 1) * world])
    }


def _start_replica(ctx, index: int, config: EngineConfig, logits_processors, model: ResolvedModel, threads: int):
    """Replica `index`'s started process and the front's end of its pipe. Not a daemon: a replica
    may start its own parallel workers."""
    replica, env = replica_config(config, index)
    parent, child = ctx.Pipe()
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # a spawned child reads the environment as it starts
    try:
        args = (index, replica, logits_processors, model, threads, child)
        proc = start_child(ctx, _replica_main, args, f"pagedbench-dp{index}", daemon=False, env=env)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
    child.close()
    return parent, proc


def _shutdown_at_exit(front: "weakref.ref[DataParallelEngine]") -> None:
    if (engine := front()) is not None:
        engine.shutdown()


def _ended(proc) -> str:
    code = proc.exitcode
    signal_note = f" (killed by signal {-code})" if code is not None and code < 0 else ""
    return f"data-parallel replica {proc.name} exited with code {code}{signal_note}"


class DataParallelEngine:
    """The front over `data_parallel_size` replica processes; what LLM, AsyncLLM and the benchmark
    commands use of an LLMEngine."""

    def __init__(self, config: EngineConfig, logits_processors: list | None = None, model: ResolvedModel | None = None):
        config.validate()
        if config.distributed_executor_backend == "external_launcher":
            raise ValueError("data_parallel_size > 1 runs with distributed_executor_backend='mp'")
        if config.seed is None:
            config = dataclasses.replace(config, seed=secrets.randbelow(2**31))  # one seed, every replica
        self.config, self.size = config, config.data_parallel_size
        model = model or resolve_model_config(config.model, need_weights=config.load_format != "dummy")
        self.model_config, path = model
        self.model_path = path  # the model's directory (weights, tokenizer); None for a preset
        cfg = self.model_config
        self.tokenizer = tokenizer_for(config.tokenizer, path, cfg.vocab_size, cfg.eos_token_ids)
        self.device, self.dtype = resolve_device_dtype(config.device, config.dtype)
        self.conns, self.procs, self.closed = [], [], False
        self._outputs: list[RequestOutput] = []  # arrived while waiting for a call's result
        self._gauges = [{}] * self.size  # each replica's latest (gauges())
        ctx = child_context(self.device)
        threads = max(1, torch.get_num_threads() // self.size) if self.device.type == "cpu" else 0
        try:
            for index in range(self.size):
                conn, proc = _start_replica(ctx, index, config, logits_processors, model, threads)
                self.conns.append(conn)
                self.procs.append(proc)
            # Before multiprocessing's own exit hook, which would wait for the replicas to end.
            atexit.register(_shutdown_at_exit, weakref.ref(self))
            self._starting = True  # a replica that dies now may lack the __main__ guard
            infos = [self._receive(i, "ready", START_TIMEOUT_S) for i in range(self.size)]
            self._starting = False
        except BaseException:
            self.shutdown()
            raise
        self.max_model_len = min(info["max_model_len"] for info in infos)
        self.blocks_per_replica = infos[0]["num_blocks"]
        self.num_blocks = self.blocks_per_replica * self.size  # every replica's pages
        self.cuda_graphs = infos[0]["cuda_graphs"]
        self.world_size = infos[0]["world_size"] * self.size
        # Constraints are compiled here to check requests; the replicas' own managers apply them.
        structured = StructuredOutputManager(
            self.tokenizer, cfg.vocab_size, cfg.eos_token_ids, torch.device("cpu"), EngineStats(), None,
            config.disable_any_whitespace,
        )  # fmt: skip
        self.input_processor = InputProcessor(config, cfg, self.tokenizer, self.max_model_len, self.device, structured)
        self.requests: dict[str, int] = {}  # unfinished request id -> its replica
        self.structured_outputs = structured
        self.load = [0] * self.size  # unfinished requests per replica
        self.requests_served = [0] * self.size  # since the last reset_counters
        self.tokens_served = [0] * self.size
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        return self.input_processor.tokenize(prompt)

    def validate_request(self, token_ids: list[int], params) -> None:
        self.input_processor.validate(token_ids, params)

    def validate_priority(self, priority) -> None:
        self.input_processor.validate_priority(priority)

    def get_tokenizer(self):
        return self.tokenizer

    def add_request(self, prompt, params=None, request_id: str | None = None, arrival_time=None, priority: int = 0):
        """Validate here, then queue on the least loaded replica (ValueError: nothing queued)."""
        from pagedbench.sample.sampling_params import SamplingParams

        params = params or SamplingParams()
        text, token_ids = self.tokenize(prompt)
        self.validate_request(token_ids, params)
        self.validate_priority(priority)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        replica = min(range(self.size), key=self.load.__getitem__)
        tokenized = {"prompt": text, "prompt_token_ids": token_ids}
        if isinstance(prompt, dict):
            tokenized = prompt | tokenized
        self._send(replica, ("add", (tokenized, params, request_id, arrival_time or time.perf_counter(), priority)))
        self.requests[request_id] = replica
        self.load[replica] += 1
        self.requests_served[replica] += 1
        return request_id

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            replica = self.requests.pop(rid, None)
            if replica is not None:
                self.load[replica] -= 1
                self._send(replica, ("abort", [rid]))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def gauges(self) -> dict[str, float]:
        """The replicas' latest gauges (as each sent them with its last outputs), summed; zeros for
        the ones no replica has sent yet (a scrape before the first request)."""
        summed = {"num_blocks": self.num_blocks, **dict.fromkeys(GAUGE_NAMES, 0)}
        for gauges in self._gauges:
            for name, value in gauges.items():
                if name != "num_blocks":
                    summed[name] = summed.get(name, 0) + value
        return summed

    def warm_up(self, num_seqs: int = 4) -> tuple[float, float]:
        """Every replica's warm-up, at once: (seconds, of which compiling), the slowest's."""
        results = self.call_all("warm_up", num_seqs)
        return max(r[0] for r in results), max(r[1] for r in results)

    def step(self) -> list[RequestOutput]:
        """The outputs that arrived from any replica (waiting until one does, while any works)."""
        outputs, self._outputs = self._outputs, []
        if not outputs and self.requests:
            busy = sorted(set(self.requests.values()))
            ready = multiprocessing.connection.wait(
                [self.conns[i] for i in busy] + [self.procs[i].sentinel for i in busy]
            )
            for i in busy:
                try:
                    while self.conns[i] in ready and self.conns[i].poll():
                        outputs += self._handle(i, self.conns[i].recv())
                except (EOFError, OSError):  # it died mid-message
                    raise self._failed(i) from None
                if self.procs[i].sentinel in ready:
                    raise self._failed(i)
        for out in outputs:
            replica = self.requests.get(out.request_id)
            if out.finished and replica is not None:
                del self.requests[out.request_id]
                self.load[replica] -= 1
                self.tokens_served[replica] += sum(len(c.token_ids) for c in out.outputs)
        return outputs

    # ---- what the benchmark commands and the server read -----------------------------------

    def call_all(self, method: str, *args) -> list:
        """`method(*args)` on every replica's engine, in turn; their results."""
        for i in range(self.size):
            self._send(i, ("call", method, args))
        return [self._receive(i, "result") for i in range(self.size)]

    def reset_prefix_cache(self) -> None:
        self.call_all("reset_prefix_cache")

    def reset_counters(self) -> None:
        self.call_all("reset_counters")
        self.requests_served, self.tokens_served = [0] * self.size, [0] * self.size

    def run_counters(self) -> RunCounters:
        """Every replica's counters since reset_counters, merged (KV use: summed over replicas)."""
        return RunCounters.merge(self.call_all("run_counters"))

    def replica_load(self) -> dict:
        """Requests and output tokens each replica served since reset_counters (reports' columns)."""
        return {
            "replica_requests": " ".join(map(str, self.requests_served)),
            "replica_output_tokens": " ".join(map(str, self.tokens_served)),
        }

    @property
    def stats(self) -> EngineStats:
        return self.run_counters().stats

    def set_timing(self, enabled: bool) -> None:
        self.call_all("set_timing", enabled)

    def shutdown(self) -> None:
        """Stop every replica (asking first), leaving no process behind; idempotent."""
        if self.closed:
            return
        self.closed = True
        stop_children(self.conns, self.procs, ("exit",), 10)

    def __del__(self):
        if getattr(self, "procs", None) is not None:
            self.shutdown()

    # ---- the pipes ---------------------------------------------------------------------------

    def _send(self, replica: int, message: tuple) -> None:
        try:
            self.conns[replica].send(message)
        except OSError:
            raise self._failed(replica) from None

    def _receive(self, replica: int, kind: str, timeout: float | None = None):
        """The next `kind` message from `replica` (outputs that arrive first are kept for step())."""
        conn, proc = self.conns[replica], self.procs[replica]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait([conn, proc.sentinel], timeout=left)
            if conn in ready:
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    raise self._failed(replica) from None
                if message[0] == kind:
                    return message[1]
                self._outputs += self._handle(replica, message)
            elif proc.sentinel in ready:
                raise self._failed(replica)
            elif deadline is not None and time.monotonic() > deadline:
                self.shutdown()
                raise WorkerError(f"data-parallel replica {replica} did not get {kind} within {timeout:.0f} s")

    def _handle(self, replica: int, message: tuple) -> list[RequestOutput]:
        if message[0] == "outputs":
            self._gauges[replica] = message[2]
            return message[1]
        if message[0] == "error":
            self.shutdown()
            raise WorkerError(message[1])
        raise RuntimeError(f"data-parallel replica {replica} sent {message[0]!r} unasked")

    def _failed(self, replica: int) -> WorkerError:
        """The replica's own error if it sent one, else how it exited; the others are stopped."""
        conn, proc = self.conns[replica], self.procs[replica]
        error = None
        try:
            while error is None and conn.poll(1.0):
                message = conn.recv()
                if message[0] == "error":
                    error = WorkerError(message[1])
        except (EOFError, OSError):
            pass
        proc.join(timeout=5)
        self.shutdown()
        if error is not None:
            return error
        hint = " (a script that starts replicas needs the `if __name__ == '__main__':` guard)"
        return WorkerError(f"{_ended(proc)}{hint if getattr(self, '_starting', False) else ''}")

    def dead_replica(self) -> str | None:
        """How the first replica that has ended ended ("data-parallel replica pagedbench-dp1 exited
        with code -9 (killed by signal 9)"), or None while every one runs: the server's /health."""
        return next((_ended(proc) for proc in self.procs if proc.exitcode is not None), None)
