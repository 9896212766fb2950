"""Every report row's `repro`: the exact `pagedbench` command (with the PAGEDBENCH_* knobs in front
that chose how its backend ran) that measures that row again, alone (docs/benchmarks.md)."""

import json
import numbers
import shlex

from pagedbench import envs
from pagedbench.bench.kernels import DENSE, GDN, batch_spec
from pagedbench.bench.peers import PEERS
from pagedbench.bench.scenario import COMMAND_SETTINGS, LengthRange, Scenario, load_scenario
from pagedbench.config import EngineConfig

# Knobs that change what a backend runs (the others name directories or debugging output).
MEASUREMENT_KNOBS = tuple(name for name, knob in envs.KNOBS.items() if knob.measured)
FLASH_PROVIDER_LABELS = {"(FA3)": "fa3", "(FA4)": "fa4", "varlen_attn": "torch", "flash_attn ": "fa2"}


def knob_settings(backend: str, provider: str) -> list[str]:
    """NAME=value for each measurement knob set here, and flash-attn's provider as chosen (it picks
    the first of FA3/FA4/FA2/torch that runs: another machine may pick another)."""
    knobs = {name: envs.get(name) for name in MEASUREMENT_KNOBS if envs.get(name) != envs.KNOBS[name].default}
    if backend == "flash-attn":
        kind = next((k for label, k in FLASH_PROVIDER_LABELS.items() if label in str(provider)), None)
        if kind is not None:
            knobs["PAGEDBENCH_FLASH_PROVIDER"] = kind
    return [f"{name}={value}" for name, value in knobs.items()]


def command_line(row: dict, words: list[str]) -> str:
    """The row's knobs, then `pagedbench` and `words`, quoted for a POSIX shell."""
    return shlex.join([*knob_settings(str(row.get("backend")), str(row.get("provider", ""))), "pagedbench", *words])


def flag(name: str, value) -> list[str]:
    """A setting as the flag that sets it: --x / --no-x for booleans, JSON for dicts, N for a fixed length."""
    option = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [option if value else "--no-" + name.replace("_", "-")]
    if isinstance(value, dict):
        return [option, json.dumps(value, sort_keys=True)]
    if isinstance(value, LengthRange):
        return [option, str(value.max)]
    return [option, str(value)]


def scenario_flags(scenario_arg: str, scale: float, scenario: Scenario, workload: tuple[str, ...]) -> list[str]:
    """run's flags that make `scenario` from `scenario_arg` at `scale`: --scenario and --scale, the
    resolved model and seed, then each of the `workload` fields and engine settings that differs
    from the scenario's own (a setting added to EngineConfig is covered without a change here)."""
    base = load_scenario(scenario_arg).scaled(scale)
    words = ["--scenario", scenario_arg, "--scale", str(scale), *flag("model", scenario.engine.model)]
    if scenario.engine.seed is not None:
        words += flag("seed", scenario.engine.seed)
    for name in workload:
        value = getattr(scenario, name)
        if value != getattr(base, name):
            if name == "structured_outputs" and value is None:
                words += [flag(name, "")[0], "off"]
            elif value is not None:
                words += flag(name, value)
    for name in EngineConfig.names():
        value = getattr(scenario.engine, name)
        if (
            name not in (*COMMAND_SETTINGS, "model", "seed")
            and value is not None
            and value != getattr(base.engine, name)
        ):
            words += flag(name, value)
    return words


def serving_repro(row: dict, scenario_flags: list[str]) -> str:
    """A run/compare row's command: `pagedbench run` of its backend on its device and dtype, one
    measured run, no warmup (a peer library's: `compare` of the reference backend with that peer)."""
    backend = str(row["backend"])
    head = (
        ["compare", "--backends", "reference", "--peer", backend] if backend in PEERS else ["run", "--backend", backend]
    )
    how = ["--device", str(row["device"]), "--dtype", str(row["dtype"]), "--repeats", "1", "--no-warmup"]
    return command_line(row, [*head, *scenario_flags, *how])


def kernel_repro(row: dict) -> str:
    """A kernels row's command: that one grid point (variant, phase, query length, batch, context,
    heads, head dim, page size, page dtype, the cache's pages and their placement) on that backend,
    with its warmup and repeats; the dense yardstick's with sdpa (it runs beside any backend), a
    gated DeltaNet row's by its kernel."""
    backend, variant = str(row["backend"]), str(row["variant"])
    spec = batch_spec(str(row["phase"]), int(row["batch_size"]), int(row["context_len"]), int(row["query_len"]))
    if variant == GDN:
        words = ["kernels", "--linear-kernels", str(row["linear_attention_kernel"])]
    else:
        words = ["kernels", "--backends", "sdpa" if backend == DENSE else backend]
    words += ["--variants", variant, "--heads", f"{row['num_heads']}/{row['num_kv_heads']}"]
    flags = {"phases": "phase", "query_lens": "query_len", "batch_sizes": "batch_size", "context_lens": "context_len"}
    flags |= {"head_dim": "head_dim", "block_sizes": "block_size", "warmup": "warmup", "repeats": "repeats"}
    flags |= {"cache_blocks": "cache_blocks", "placement": "placement"}  # where its pages lie
    if variant != GDN and backend != DENSE:
        flags["kv_cache_dtype"] = "kv_cache_dtype"
    for name, column in flags.items():  # what a row has (a DeltaNet row no pages, an unavailable one no timing)
        if isinstance(row.get(column), (str, numbers.Integral)):
            words += flag(name, row[column])
    words += ["--max-kv-tokens", str(sum(map(sum, spec))), "--max-query-tokens", str(sum(q for _, q in spec))]
    graphs = row.get("cuda_graphs")  # "off", or what capture did when --cuda-graphs asked for it
    words += ["--cuda-graphs"] if isinstance(graphs, str) and graphs != "off" else []
    words += ["--batch-invariant"] if row.get("batch_invariant") is True else []
    return command_line(row, [*words, "--device", str(row["device"]), "--dtype", str(row["dtype"])])


def check_repro(row: dict, grid_flags: list[str]) -> str:
    """A check row's command: check has no flag that picks one case, so the smallest that runs it
    again: its backend, its case's dtype, the device and the grid flags (`grid_flags`) it came from."""
    words = ["check", "--backends", str(row["backend"]), "--dtypes", str(row["dtype"]), *grid_flags]
    return command_line(row, [*words, "--device", str(row["device"])])
