"""The host benchmark (`pagedbench profile --stand-in-device-ms D`): the real engine -- scheduler,
block manager, step inputs, backend plan, sampler, update_from_output, outputs -- with the model's
forward replaced by a stand-in device that takes D ms a step, so that a CPU shows how much host work
a step costs and how much of it async scheduling hides behind the device.

Both rows of a configuration run on the device lane (engine/engine_core.py: a worker thread on a
CPU), which runs each step's device work -- page moves, inputs, the backend's plan, the stand-in's
D ms, the draw -- so the same work counts as the device's in both; with async scheduling off the
lane never runs ahead (a step completes before the next is scheduled: host + device in series)."""

import time
from dataclasses import dataclass

import torch

from pagedbench.bench.environment import load_average
from pagedbench.config import EngineConfig
from pagedbench.engine.llm_engine import LLMEngine
from pagedbench.sample.sampling_params import RequestOutputKind, SamplingParams


class StandInDevice:
    """The model's forward as a stand-in: sleeps `ms` (releasing the GIL, as a device computes) and
    returns fixed logits whose peaks move each step (row r of step s peaks at token 7(r + s) + 3), so
    that greedy decoding is deterministic and a sequence's tokens vary as a model's do."""

    PERIOD = 97  # steps before the peaks repeat

    def __init__(self, ms: float, vocab_size: int, max_rows: int):
        self.seconds, self.step = ms / 1e3, 0
        rows = torch.arange(max_rows + self.PERIOD)
        self.logits = torch.zeros(len(rows), vocab_size)
        self.logits[rows, (7 * rows + 3) % vocab_size] = 10.0

    def run(self, inputs, state, timer=None) -> torch.Tensor:
        time.sleep(self.seconds)
        start, self.step = self.step % self.PERIOD, self.step + 1
        return self.logits[start : start + len(inputs.logits_indices)]


@dataclass(slots=True)
class HostRow:
    async_scheduling: bool
    batch: int
    context: int
    output_len: int
    steps: int
    host_ms_per_step: float  # the engine's own thread, busy (CPU time: waits excluded)
    wall_ms_per_step: float
    device_ms_per_step: float  # the lane's work: the stand-in's D ms and the rest of a step's device work
    busy_share: float  # device time / wall time
    load_average: float


def host_profile(
    model: str,
    backend: str,
    device_ms: float,
    batch: int,
    context: int,
    output_len: int,
    steps: int,
    run_ahead: bool,
    settings: dict | None = None,
) -> HostRow:
    """`batch` sequences of `context` prompt tokens, each at least `output_len` tokens into its output
    when the `steps` measured decode steps run (outputs as a server streams them: RequestOutputKind.DELTA)."""
    chunk = max(8192, batch)  # prompt tokens a step; the first sequences decode while the last ones prefill
    length = context + output_len + steps + -(-batch * context // chunk) + 2
    config = EngineConfig(
        model=model,
        backend=backend,
        device="cpu",
        dtype="float32",
        async_scheduling=True,
        max_num_seqs=batch,
        max_num_batched_tokens=chunk,
        max_model_len=length,
        num_blocks=batch * -(-length // 16) + 1,
        enable_prefix_caching=False,
        **(settings or {}),
    )
    engine = LLMEngine(config)
    engine.core.overlap = run_ahead
    engine.executor.runner.run = StandInDevice(device_ms, engine.model_config.vocab_size, batch).run
    final_only = RequestOutputKind.FINAL_ONLY  # as the benchmark drivers run: token ids, the finished output
    params = SamplingParams(
        temperature=0, max_tokens=length - context, ignore_eos=True, detokenize=False, output_kind=final_only
    )
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        engine.add_request({"prompt_token_ids": [(31 * i + 7 * t) % (vocab - 1) + 1 for t in range(context)]}, params)
    try:
        while not _decoding_at(engine, batch, context + output_len):
            engine.step()
        lane, load = engine.core.device_lane, load_average()
        busy, cpu, wall = lane.busy_seconds, time.thread_time(), time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall, cpu, busy = time.perf_counter() - wall, time.thread_time() - cpu, lane.busy_seconds - busy
    finally:
        engine.shutdown()
    ms = 1e3 / steps  # per step
    return HostRow(run_ahead, batch, context, output_len, steps, cpu * ms, wall * ms, busy * ms, busy / wall, load)


def _decoding_at(engine: LLMEngine, batch: int, length: int) -> bool:
    """Whether all `batch` sequences run and hold `length` tokens (the measured steps may start)."""
    running = engine.scheduler.running
    return len(running) == batch and all(seq.num_tokens >= length for seq in running)
