"""What one decode step launches: device kernels (CUDA) or dispatched operations (CPU), in all and
per layer outside the attention backend's own calls, the device time of a step and its top
kernels. Used by `pagedbench profile`, the GPU suite and the `kernels_per_step` report column.

Counting, so that the figure means the same before and after fusion:
- CUDA: the profiler's kernel events (kernels inside a replayed CUDA graph included).
- CPU: top-level ATen operations that compute (views and no-op casts excluded; a composite op
  counts once), plus each kernel an inductor-compiled region calls (C++ kernels are plain calls
  from its Python wrapper, invisible to the profiler, so they are counted with sys.setprofile).
"""

import contextlib
import os
import random
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from pagedbench.bench.environment import synchronize
from pagedbench.sample.sampling_params import SamplingParams

BACKEND_SPAN = "pagedbench::attention_backend"
FORWARD_SPAN = "pagedbench::forward"
# ATen ops that only make a view, an alias or an empty allocation: never a kernel.
NON_COMPUTING = {
    "aten::" + name
    for name in (
        "view as_strided select slice unsqueeze squeeze expand permute transpose t split chunk unbind detach alias "
        "_unsafe_view narrow split_with_sizes unflatten flatten view_as _reshape_alias lift_fresh empty "
        "empty_strided empty_like resize_ set_ expand_as movedim diagonal real numpy_T unfold"
    ).split()
}
# Ops that are a view or a no-op unless they did work below them (a copy, a cast).
COMPUTING_IF_CHILDREN = {"aten::to", "aten::reshape", "aten::contiguous", "aten::type_as", "aten::flatten"}
INDUCTOR_CPU_KERNEL = "kernel"  # the name of every C++ kernel inductor's CPU wrapper calls


@dataclass(slots=True)
class StepProfile:
    """Per decode step of `batch` sequences (averaged over `steps` profiled steps)."""

    device: str
    unit: str  # "kernels" (CUDA) or "ops" (CPU)
    batch: int
    steps: int
    num_layers: int
    per_step: float  # everything the step launched (scheduler and sampler included)
    forward: float  # inside the model's forward
    attention: float | None  # inside the attention backend's calls (None: a replayed CUDA graph hides them)
    device_ms_per_step: float | None  # CUDA: the kernels' summed time
    wall_ms_per_step: float | None = None  # the same steps unprofiled, synchronized before and after
    running: float = 0.0  # sequences the scheduler ran, mean over the profiled steps (<= batch if preempted)
    kv_tokens: float = 0.0  # KV tokens those sequences held, mean over the profiled steps
    top: list[tuple[str, float, float]] = field(default_factory=list)  # (name, count per step, ms per step)

    @property
    def outside_attention_per_layer(self) -> float | None:
        return None if self.attention is None else (self.forward - self.attention) / self.num_layers

    @property
    def busy_share(self) -> float | None:
        """Device time over wall time of a step (CUDA): under 1, the GPU waits on the host."""
        if self.device_ms_per_step is None or not self.wall_ms_per_step:
            return None
        return self.device_ms_per_step / self.wall_ms_per_step

    @property
    def per_layer(self) -> float:
        return self.forward / self.num_layers


def _is_aten(name: str) -> bool:
    return name.startswith("aten::")


def _computes(event) -> bool:
    if event.name in NON_COMPUTING:
        return False
    return event.name not in COMPUTING_IF_CHILDREN or any(_is_aten(c.name) and _computes(c) for c in event.cpu_children)


def _under(event, span: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == span:
            return True
        parent = parent.cpu_parent
    return False


def _top_level_aten(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if _is_aten(parent.name):
            return False
        parent = parent.cpu_parent
    return True


@contextlib.contextmanager
def _spans(runner, counter: "_CompiledKernelCounter"):
    """Mark the model's forward and each backend's forward as profiler spans (instance attributes
    shadow the methods for the duration; nothing changes outside a profile)."""
    wrapped = [runner.model, *runner.backend.distinct]
    names = [FORWARD_SPAN] + [BACKEND_SPAN] * (len(wrapped) - 1)
    for obj, name in zip(wrapped, names):
        original = type(obj).forward.__get__(obj)

        def spanned(*args, _original=original, _name=name, **kwargs):
            inside = _name == BACKEND_SPAN
            counter.in_backend += inside
            try:
                with record_function(_name):
                    return _original(*args, **kwargs)
            finally:
                counter.in_backend -= inside

        obj.forward = spanned
    try:
        yield
    finally:
        for obj in wrapped:
            del obj.forward


class _CompiledKernelCounter:
    """Counts the C++ kernels inductor's CPU wrappers call, and whether each ran inside a span."""

    def __init__(self):
        self.total = self.attention = self.in_backend = 0

    def __call__(self, frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", None) == INDUCTOR_CPU_KERNEL:
            self.total += 1
            self.attention += self.in_backend > 0

    @contextlib.contextmanager
    def active(self):
        sys.setprofile(self)
        try:
            yield
        finally:
            sys.setprofile(None)


def _within(op, span: str) -> bool:
    return op.name == span or _under(op, span)


def cuda_kernels(events) -> tuple[list, int, int | None]:
    """(the device's kernels, memcpys and memsets; how many the model's forward ran; how many the
    attention backend's calls ran, None where a replayed CUDA graph hides them) from a profile's events.
    The GPU-timeline copies of record_function spans (user annotations, e.g. our forward span, as long
    as the forward) are not kernels: counted as such they doubled a step's device time on the H200.
    A kernel's launching op lists it (`kernels`; FunctionEvent.linked_correlation_id is not in torch
    2.11), except an annotation's copy of itself; a graph's kernels link to no op of ours."""
    spans = {FORWARD_SPAN, BACKEND_SPAN}
    device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    counted = [e for e in device if not getattr(e, "is_user_annotation", False) and e.name not in spans]
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    launched_by = [op for op in cpu for k in op.kernels if k.name != op.name and k.name not in spans]
    forward = sum(_within(op, FORWARD_SPAN) for op in launched_by)
    if any(e.name == "cudaGraphLaunch" for e in cpu):
        return counted, forward + max(0, len(counted) - len(launched_by)), None
    return counted, forward, sum(_within(op, BACKEND_SPAN) for op in launched_by)


KINETO_CHATTER = re.compile(r"^USDT:.*\] profiler_(start|stop)\s*$")


@contextlib.contextmanager
def _quiet_profile(activities):
    """torch.profiler's `profile`, without the "USDT: ... profiler_start / profiler_stop" lines its
    kineto library prints on stderr as it starts and stops (anything else printed there then passes)."""
    prof = profile(activities=activities)
    with _stderr_without(KINETO_CHATTER):
        prof.start()
    try:
        yield prof
    finally:
        with _stderr_without(KINETO_CHATTER):
            prof.stop()


@contextlib.contextmanager
def _stderr_without(pattern: re.Pattern):
    """File descriptor 2 (C++ libraries write there, not to sys.stderr) caught for the block; its
    lines are then written to sys.stderr, those matching `pattern` left out."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            lines = caught.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not pattern.match(line)))


def profile_steps(engine, steps: int, top: int = 15) -> StepProfile:
    """Profile the next `steps` engine steps (the caller has brought the engine to steady decode)."""
    runner = engine.executor.runner
    device = engine.device
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    batch = sum(1 for g in engine.requests.values() for s in g.seqs if not s.finished)
    counter = _CompiledKernelCounter()
    running, kv_tokens = [], []
    with _spans(runner, counter), _quiet_profile(activities) as prof:
        with counter.active() if not cuda else contextlib.nullcontext():
            for _ in range(steps):
                seqs = engine.scheduler.running  # what the step will run (before it, finished ones still count)
                running.append(len(seqs))
                kv_tokens.append(sum(s.num_computed_tokens for s in seqs))
                engine.step()
        if cuda:
            torch.cuda.synchronize(device)
    events = prof.events()
    if cuda:
        counted, forward, attention = cuda_kernels(events)
        device_ms = sum(e.time_range.elapsed_us() for e in counted) / 1e3 / steps
    else:
        counted = [e for e in events if _is_aten(e.name) and _top_level_aten(e) and _computes(e)]
        forward = sum(_under(e, FORWARD_SPAN) for e in counted)
        attention = sum(_under(e, BACKEND_SPAN) for e in counted)
        device_ms = None
    compiled = counter.total  # every inductor kernel runs inside the model's forward
    by_name: Counter = Counter(e.name for e in counted)
    times: Counter = Counter()
    for e in counted:
        times[e.name] += (e.time_range.elapsed_us() if cuda else e.cpu_time_total) / 1e3
    if compiled:
        by_name["inductor C++ kernel"] += compiled
    return StepProfile(
        device=str(device),
        unit="kernels" if cuda else "ops",
        batch=batch,
        steps=steps,
        num_layers=engine.model_config.num_layers,
        per_step=(len(counted) + compiled) / steps,
        forward=(forward + compiled) / steps,
        attention=None if attention is None else (attention + counter.attention) / steps,
        device_ms_per_step=device_ms,
        running=sum(running) / steps,
        kv_tokens=sum(kv_tokens) / steps,
        top=[(name, n / steps, times[name] / steps) for name, n in by_name.most_common(top)],
    )


def steady_decode(engine, batch: int, context: int, seed: int = 0) -> None:
    """Add `batch` requests of `context` random prompt tokens that never stop, and step until every
    one of them decodes (each has its first token) — the state a decode-step profile needs."""
    rnd = random.Random(seed)
    vocab = engine.model_config.vocab_size
    if context >= engine.max_model_len:
        raise ValueError(f"context {context} leaves no room to decode under max_model_len {engine.max_model_len}")
    params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - context, ignore_eos=True, detokenize=False)
    ids = [
        engine.add_request({"prompt_token_ids": [rnd.randrange(vocab) for _ in range(context)]}, params)
        for _ in range(batch)
    ]
    started: set[str] = set()
    for _ in range(batch * context + 10):
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)
        if started.issuperset(ids):
            return
    raise RuntimeError("the profiled requests never all reached decode")


def profile_decode(engine, batch: int, context: int, steps: int = 3, warmup: int = 2, top: int = 15) -> StepProfile:
    """Steady decode at `batch` x `context`, `warmup` unprofiled steps, `steps` timed ones, then
    `steps` profiled ones; the requests are aborted after."""
    before = set(engine.requests)
    steady_decode(engine, batch, context)
    try:
        for _ in range(warmup):
            engine.step()
        synchronize(engine.device)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        synchronize(engine.device)
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
        core = getattr(engine, "core", None)  # (a data-parallel front has none: its replicas count themselves)
        with core.synchronous() if core is not None else contextlib.nullcontext():  # ops on this thread
            profile = profile_steps(engine, steps, top)
        profile.wall_ms_per_step = wall_ms
        return profile
    finally:
        engine.abort_request([r for r in list(engine.requests) if r not in before])
        while engine.has_unfinished_requests() and not before:
            engine.step()
