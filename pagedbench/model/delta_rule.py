"""The gated delta rule of the hybrid models' DeltaNet layers as a swappable kernel
(EngineConfig.linear_attention_kernel):

- `torch`: transformers' own torch forms (the chunked one for several tokens, the recurrent one for
  a decode), one sequence of the step at a time (model/hybrid.py's loop).
- `fla`: flash-linear-attention's Triton kernels (`pip install fla-core`, import name `fla`):
  every sequence of the step in one varlen call (`cu_seqlens`), the conv window over the whole
  step in one conv. Compiled on CUDA; on CPU run by Triton's interpreter (correct, slow: never a
  kernel's speed).

A sequence's chunk is cut where prefix caching snapshots its state (LinearStep.segments()). Such
a cut cannot be a plain `cu_seqlens` boundary, since the rows after it continue from the state
before it: the step runs in rounds instead, round r holding every sequence's r-th run of rows
(one round unless a chunk crosses a snapshot), each round's final states copied to its snapshots.
"""

import contextlib
import functools
import sys
from dataclasses import dataclass
from importlib import metadata

import torch
import torch.nn.functional as F

FLA_INSTALL_HINT = "pip install 'pagedbench[fla]'"


@contextlib.contextmanager
def fla_hidden_without_cuda():
    """transformers' Qwen3.5/Qwen3-Next modeling imported as if fla were absent, on a machine without
    CUDA: there fla's kernels, which transformers would swap in, cannot run, and importing fla costs
    about 2 s per process (each tensor-parallel rank, each CLI run). With CUDA, fla imports as usual."""
    if torch.cuda.is_available():
        yield
        return
    saved = sys.modules.get("fla", None)
    had = "fla" in sys.modules
    sys.modules["fla"] = None  # `import fla` raises ImportError: transformers keeps its torch forms
    try:
        yield
    finally:
        if had:
            sys.modules["fla"] = saved
        else:
            del sys.modules["fla"]


def transformers_modeling(name: str):
    """transformers.models.<name>.modeling_<name>, imported with fla hidden where it cannot run."""
    import importlib

    with fla_hidden_without_cuda():
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


@functools.cache
def torch_delta_rule():
    """(chunked, recurrent): the torch forms transformers ships. With fla importable, transformers'
    functions of these names call fla's kernels instead (its hub fallback), which a CPU cannot
    run: their `__wrapped__` torch bodies are taken."""
    module = transformers_modeling("qwen3_5")
    functions = (module.torch_chunk_gated_delta_rule, module.torch_recurrent_gated_delta_rule)
    return tuple(getattr(f, "__wrapped__", f) for f in functions)


def pin_transformers_torch_delta_rule() -> None:
    """Point transformers' Qwen3.5 and Qwen3-Next layers back at their torch recurrences where fla's
    kernels replaced them (fla installed): Hugging Face's reference on a CPU (tests, the hf peer)."""
    for name in ("qwen3_5", "qwen3_next"):
        try:
            module = transformers_modeling(name)
        except ImportError:
            continue
        for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            f = getattr(module, fn, None)
            if f is not None:
                setattr(module, fn, getattr(f, "__wrapped__", f))


# --- fla: availability ---------------------------------------------------------------------------


def fla_version() -> str | None:
    try:
        return metadata.version("fla-core")
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def fla_unavailable_reason(device_type: str) -> str | None:
    """None when fla's kernels run on `device_type`, else a one-line reason (absent, broken, or a
    device it does not run on). On CPU a tiny call through the interpreter must match the torch form."""
    from pagedbench.backends.base import import_or_reason, one_line

    if device_type not in ("cuda", "cpu"):
        return f"fla runs on CUDA (compiled Triton) or CPU (Triton's interpreter), not {device_type}"
    for name in ("fla", "fla.ops.gated_delta_rule"):
        module = import_or_reason(name, FLA_INSTALL_HINT)
        if isinstance(module, str):
            return module
    if device_type == "cpu":
        try:
            _smoke_test()
        except Exception as e:  # an fla or triton version whose kernels the interpreter cannot run
            return f"fla's kernels fail in Triton's interpreter on CPU: {one_line(e)}"
    return None


def check_linear_attention_kernel(name: str, device: torch.device | str) -> None:
    """ValueError, one line, when `name` cannot run on `device`."""
    if name == "fla":
        reason = fla_unavailable_reason(torch.device(device).type)
        if reason:
            raise ValueError(f"linear_attention_kernel fla: {reason}")


def timing_caveat(name: str, device: torch.device | str) -> str | None:
    """Why `name`'s timings on `device` are not a kernel's speed (fla interpreted on CPU), or None."""
    if name == "fla" and torch.device(device).type != "cuda":
        return (
            "fla's kernels in Triton's interpreter on CPU (numpy, one program at a time): correct, not a kernel's speed"
        )
    return None


def kernel_provider(name: str, device: torch.device | str) -> str:
    """What runs the gated delta rule under `name`, for reports."""
    if name == "fla":
        how = "compiled" if torch.device(device).type == "cuda" else "Triton interpreter"
        return f"fla-core {fla_version()} chunk/fused_recurrent_gated_delta_rule, varlen ({how})"
    import transformers

    return f"transformers {transformers.__version__} torch_chunk/recurrent_gated_delta_rule, per sequence"


def _smoke_test() -> None:
    """Two sequences (a decode and a 3-token chunk) through both fla kernels against the torch form."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 4, 1, 16, generator=gen) for _ in "qk")
    v = torch.randn(1, 4, 2, 16, generator=gen)
    g, beta = -torch.rand(1, 4, 2, generator=gen), torch.rand(1, 4, 2, generator=gen)
    h0 = torch.randn(2, 2, 16, 16, generator=gen)
    chunked, _ = torch_delta_rule()
    ops = _fla_ops()
    cu = torch.tensor([0, 1, 4])
    for op in ops:
        with _interpreted():
            o, h = op(
                q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                cu_seqlens=cu,
            )  # fmt: skip
        for i in range(2):
            rows = slice(int(cu[i]), int(cu[i + 1]))
            want, final = chunked(
                q[:, rows], k[:, rows], v[:, rows], g=g[:, rows], beta=beta[:, rows], initial_state=h0[i : i + 1],
                output_final_state=True, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
            torch.testing.assert_close(o[:, rows], want, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(h[i : i + 1], final, atol=1e-4, rtol=1e-4)


def _fla_ops():
    """(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


# --- fla on CPU: Triton's interpreter ------------------------------------------------------------


@contextlib.contextmanager
def _interpreted():
    """fla's kernels on CPU tensors, in Triton's interpreter, however triton and fla were imported:
    a kernel `triton.jit` compiled (TRITON_INTERPRET unset at import) runs interpreted instead, an
    autotuned one takes its first configuration (benchmarking each in the interpreter would take
    minutes), and loop indices get the `.to()` compiled Triton gives them (`i_t.to(tl.int64)`)."""
    import numpy as np
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    from pagedbench.backends.triton import interpreting

    run, prune = JITFunction.run, Autotuner.prune_configs
    modules = [
        m for name, m in list(sys.modules.items()) if m is not None and (name == "fla" or name.startswith("fla."))
    ]
    shadowed = [(m, m.__dict__.get("range", _UNSET)) for m in modules]
    JITFunction.run = _run_interpreted
    Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]
    for m in modules:
        m.__dict__["range"] = _kernel_range
    try:
        with interpreting(), np.errstate(all="ignore"):  # masked-off lanes overflow harmlessly, as on a GPU
            yield
    finally:
        for m, before in shadowed:
            if before is _UNSET:
                m.__dict__.pop("range", None)
            else:
                m.__dict__["range"] = before
        JITFunction.run, Autotuner.prune_configs = run, prune


_UNSET = object()


@functools.cache
def _interpreter_of(fn):
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


def _run_interpreted(self, *args, grid, warmup, **kwargs):
    """JITFunction.run for a launch on CPU tensors: the kernel's body in the interpreter."""
    return _interpreter_of(self.fn).run(*args, grid=grid, warmup=warmup, **kwargs)


class _LoopIndex(int):
    """A loop index as compiled Triton has it: an int that also converts like a scalar tensor."""

    def to(self, dtype, **kwargs):
        import numpy as np
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle, _get_np_dtype

        return tl.tensor(TensorHandle(np.array([int(self)], dtype=_get_np_dtype(dtype)), dtype), dtype)


def _scalar(x) -> int:
    if hasattr(x, "handle"):  # an interpreter tensor (a bound computed in the kernel)
        return int(x.handle.data.reshape(-1)[0])
    return int(getattr(x, "value", x))  # an int or a constexpr


def _kernel_range(*bounds):
    for i in range(*map(_scalar, bounds)):
        yield _LoopIndex(i)


# --- fla: one step of a DeltaNet layer -----------------------------------------------------------


@dataclass(slots=True)
class _Round:
    """One call's worth of rows: the r-th run of rows of each sequence that has one."""

    rows: torch.Tensor | None  # the step's rows in this round, in order (None: every row of the step)
    cu_seqlens: torch.Tensor  # [N + 1] on the device
    cu_seqlens_cpu: torch.Tensor
    slots: torch.Tensor  # [N]
    continues: torch.Tensor  # [N] bool: from the slot's state (else from zeros)
    decode: bool  # every run is one token continuing a state: the recurrent kernel
    snapshot_of: torch.Tensor | None  # positions among the N whose final state is snapshotted ...
    snapshot_slots: torch.Tensor | None  # ... into these slots


@dataclass(slots=True)
class _Layout:
    """A step's index tensors, the same for every DeltaNet layer of the step (built once, kept on
    the LinearStep): the conv over every sequence's window and rows at once, and the rounds."""

    slots: torch.Tensor  # [S] each sequence's slot
    continues: torch.Tensor  # [S] bool
    extended: torch.Tensor  # rows of cat(windows [S * (K-1)], step rows [T]) in each sequence's order
    outputs: torch.Tensor  # [T] the conv's output column of each step row
    windows: torch.Tensor  # [S + snapshots, K-1] extended rows of each new window (slots, then snapshots)
    window_slots: torch.Tensor  # [S + snapshots]
    rounds: list[_Round]


def _layout(step, width: int, device: torch.device) -> _Layout:
    """`width`: conv_kernel - 1."""
    seqs: list[tuple[int, list]] = []  # (slot, its runs: [(start, end, continues, snapshot)])
    for slot, start, end, continues, snapshot in step.segments():
        if not seqs or seqs[-1][0] != slot or seqs[-1][1][-1][1] != start:
            seqs.append((slot, []))
        seqs[-1][1].append((start, end, continues, snapshot))
    extended, outputs, windows, window_slots = [], [], [], []
    snapshot_windows, snapshot_slots = [], []
    base = len(seqs) * width  # the step's rows follow the windows in cat(windows, rows)
    for i, (slot, runs) in enumerate(seqs):
        first, end = runs[0][0], runs[-1][1]
        offset = len(extended)  # where this sequence's window starts in the extended order
        extended += [*range(i * width, (i + 1) * width), *range(base + first, base + end)]
        outputs += range(offset, offset + end - first)
        # a window: the `width` inputs before row r of the sequence, extended rows offset + r on
        windows.append(list(range(offset + end - first, offset + end - first + width)))
        window_slots.append(slot)
        for _, run_end, _, snapshot in runs:
            if snapshot is not None:
                snapshot_windows.append(list(range(offset + run_end - first, offset + run_end - first + width)))
                snapshot_slots.append(snapshot)
    rounds = []
    for r in range(max((len(runs) for _, runs in seqs), default=0)):
        these = [(slot, runs[r]) for slot, runs in seqs if len(runs) > r]
        lengths = [end - start for _, (start, end, _, _) in these]
        cu = torch.tensor([0, *lengths]).cumsum(0)
        snaps = [(j, run[3]) for j, (_, run) in enumerate(these) if run[3] is not None]
        rows = [x for _, (start, end, _, _) in these for x in range(start, end)]
        rounds.append(
            _Round(
                None if len(rows) == len(outputs) else _tensor(rows, device),  # one round: every row in order
                cu.to(device),
                cu,
                _tensor([slot for slot, _ in these], device),
                _tensor([run[2] for _, run in these], device, torch.bool),
                all(n == 1 for n in lengths) and all(run[2] for _, run in these),
                _tensor([j for j, _ in snaps], device) if snaps else None,
                _tensor([s for _, s in snaps], device) if snaps else None,
            )
        )
    return _Layout(
        _tensor([slot for slot, _ in seqs], device),
        _tensor([runs[0][2] for _, runs in seqs], device, torch.bool),
        _tensor(extended, device),
        _tensor(outputs, device),
        _tensor(windows + snapshot_windows, device),
        _tensor(window_slots + snapshot_slots, device),
        rounds,
    )


def _tensor(values, device, dtype=torch.long) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def fla_mix(lin, mixed, weight, g, beta, step, conv_states, states) -> torch.Tensor:
    """One DeltaNet layer's token mixing for the whole step through fla's kernels: `mixed` [T, conv_dim]
    (q/k/v before the conv), `weight` the conv's [C, 1, K], `g` [T, Hv] (fp32 log decay), `beta`
    [T, Hv]; each sequence's conv window and state read from and written to its slot (and
    snapshots), as the torch loop does. Returns [T, Hv, Dv]."""
    width = lin.conv_kernel - 1
    layout = step.layout
    if layout is None or layout[0] != width:  # the first DeltaNet layer of the step builds it
        layout = (width, _layout(step, width, mixed.device))
        step.layout = layout
    layout = layout[1]
    # The causal conv: each sequence's window (its slot's, or zeros) before its rows, one conv over all.
    windows = conv_states[layout.slots] * layout.continues[:, None, None].to(conv_states.dtype)  # [S, C, K-1]
    extended = torch.cat((windows.transpose(1, 2).reshape(-1, mixed.shape[1]), mixed))[layout.extended]  # [E, C]
    y = F.conv1d(extended.T[None], weight, groups=mixed.shape[1])[0]  # [C, E - (K-1)]
    y = F.silu(y[:, layout.outputs].T)  # [T, C]
    conv_states[layout.window_slots] = extended[layout.windows].transpose(1, 2)  # new windows, snapshots' too
    q, k, v = y.split([lin.key_dim, lin.key_dim, lin.value_dim], dim=-1)
    q, k = (t.reshape(1, -1, lin.num_key_heads, lin.key_head_dim) for t in (q, k))
    v = v.reshape(1, -1, lin.num_value_heads, lin.value_head_dim)
    g, beta = g[None], beta[None]
    interpreted = mixed.device.type == "cpu"
    if interpreted and mixed.dtype == torch.bfloat16:  # the interpreter's bf16 dots are wrong (numpy has no bf16)
        q, k, v, beta = (t.float() for t in (q, k, v, beta))
    chunked, recurrent = _fla_ops()
    out = mixed.new_empty(v.shape[1:])
    with _interpreted() if interpreted else contextlib.nullcontext():
        for rnd in layout.rounds:
            inputs = (q, k, v, g, beta) if rnd.rows is None else (t[:, rnd.rows] for t in (q, k, v, g, beta))
            h0 = states[rnd.slots] * rnd.continues[:, None, None, None]
            extra = {} if rnd.decode else {"cu_seqlens_cpu": rnd.cu_seqlens_cpu}
            q_, k_, v_, g_, beta_ = inputs
            o, final = (recurrent if rnd.decode else chunked)(
                q_, k_, v_, g=g_, beta=beta_, initial_state=h0, output_final_state=True,
                use_qk_l2norm_in_kernel=True, cu_seqlens=rnd.cu_seqlens, **extra,
            )  # fmt: skip
            if rnd.rows is None:
                out = o[0].to(out.dtype)
            else:
                out[rnd.rows] = o[0].to(out.dtype)
            states[rnd.slots] = final
            if rnd.snapshot_of is not None:
                states[rnd.snapshot_slots] = final[rnd.snapshot_of]
    return out
