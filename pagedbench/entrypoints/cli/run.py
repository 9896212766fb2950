"""`pagedbench run`, `compare` and `scenarios`: a scenario's requests through the engine, on one
backend or several (same requests, same KV budget), reported as CSV, markdown and plots."""

import argparse
import textwrap

import pandas as pd

from pagedbench.bench.scenario import COMMAND_SETTINGS, LengthRange, Scenario, builtin_scenarios, load_scenario
from pagedbench.config import EngineConfig, json_object
from pagedbench.device.dtypes import resolve_device_dtype
from pagedbench.entrypoints.cli.common import (
    Interrupted,
    NothingMeasured,
    add_overwrite_flag,
    add_threads_flag,
    keep_partial,
    prepare_out_dir,
    report_stem,
    timed_backend_names,
    warn_if_busy,
)
from pagedbench.model.presets import PRESETS

# The workload's own flags (a scenario's fields); every engine setting has its flag from EngineConfig.
WORKLOAD_OVERRIDES = ("dataset_name", "dataset_path", "num_prompts", "input_len", "output_len", "n")
WORKLOAD_OVERRIDES += ("speculation_baseline", "structured_outputs", "skip_long_requests")


def structured_outputs_arg(text: str) -> dict:
    """--structured-outputs: a JSON object of StructuredOutputsParams' fields, or "off" (an empty dict)."""
    return {} if text == "off" else json_object(text)


structured_outputs_arg.__name__ = "JSON object or off"


def add_scenario_args(p: argparse.ArgumentParser) -> None:
    """run's and compare's flags: the scenario, how it is measured, and overrides of its fields
    (its workload's below, every engine setting's from EngineConfig, --device and --dtype included)."""
    p.add_argument("--scenario", default="synthetic", help="built-in name (see `pagedbench scenarios`) or a TOML file")
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="request counts, lengths and max_num_seqs times F, the KV budget times F^2",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="measured runs after the warmup (default: 1 for run; 3 for compare, the fewest that give each "
        "backend's median an interval, min-max at 75%% confidence, and its ranking a 'tied'; 6 or more give 95%%)",
    )
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed warmup run")
    p.add_argument("--out", default="reports", help="directory for the CSV, markdown and PNG reports")
    p.add_argument(
        "--record-steps",
        type=int,
        default=None,
        metavar="N",
        help="record up to N of the first measured run's steps, evenly spread, beside the report as "
        "<stem>-steps.jsonl (compare: <stem>-<backend>-steps.jsonl) for `kernels --replay`",
    )
    add_overwrite_flag(p)
    add_threads_flag(p)
    workload = p.add_argument_group("workload overrides (default: the scenario's)")
    for name, help in (("num_prompts", "requests"), ("n", "samples per prompt (parallel sampling)")):
        workload.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=help)
    workload.add_argument("--input-len", type=int, default=None, help="every prompt this many tokens")
    workload.add_argument("--output-len", type=int, default=None, help="every output this many tokens")
    workload.add_argument(
        "--speculation-baseline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run each backend without speculation (default: the scenario's; on in spec-decode)",
    )
    workload.add_argument(
        "--structured-outputs",
        type=structured_outputs_arg,
        default=None,
        help="every request's constraint, as JSON (vLLM's StructuredOutputsParams): {\"json\": {...schema...}}, "
        '{"regex": "..."}, {"choice": [...]}, {"grammar": "..."}; "off" for none (default: the scenario\'s)',
    )
    add_dataset_args(workload)
    EngineConfig.add_cli_args(p, skip=tuple(set(EngineConfig.names()) - {"device", "dtype"}))
    engine = p.add_argument_group("engine settings (default: the scenario's [engine] table, else EngineConfig's)")
    EngineConfig.add_cli_args(engine, skip=COMMAND_SETTINGS, unset="the scenario's")


def add_dataset_args(group) -> None:
    """vLLM's --dataset-name / --dataset-path: a user's own workload (bench/datasets.py)."""
    from pagedbench.bench.datasets import DATASET_NAMES

    group.add_argument(
        "--dataset-name",
        choices=DATASET_NAMES,
        default=None,
        help="your own workload: sharegpt (JSON/JSONL conversations), custom (JSONL prompt + output_tokens) or "
        "trace (CSV/JSONL arrivals and lengths: BurstGPT's, Azure's or timestamp,input_len,output_len)",
    )
    group.add_argument("--dataset-path", default=None, help="the dataset's file (with --dataset-name)")
    group.add_argument(
        "--skip-long-requests",
        action="store_true",
        default=None,
        help="skip (and count) a dataset's requests longer than max_model_len, prompt + output; "
        "default: such a request is an error naming its line",
    )


CPU_MODEL = "tiny-llama"  # what benchmark commands run on a CPU unless --model says otherwise


def scenario_from_args(args) -> Scenario:
    scenario = load_scenario(args.scenario).scaled(args.scale)
    changes = {f: getattr(args, f) for f in WORKLOAD_OVERRIDES if getattr(args, f) is not None}
    changes |= EngineConfig.given_cli_args(args)
    for command_setting in COMMAND_SETTINGS:  # the command's (each row says them), not the scenario's
        changes.pop(command_setting, None)
    device, _ = resolve_device_dtype(args.device, args.dtype)
    # A real-shape preset is too slow for CPU; a small model the scenario names (the trained pair) runs.
    model = scenario.engine.model
    if device.type == "cpu" and "model" not in changes and model in PRESETS and model != CPU_MODEL:
        print(
            f"pagedbench: note: on cpu, model {CPU_MODEL} instead of the scenario's {model} "
            f"(pass --model {model} to run that)"
        )
        changes["model"] = CPU_MODEL
    for length in {"input_len", "output_len"} & set(changes):
        changes[length] = LengthRange(changes[length], changes[length])
    if "num_blocks" in changes:
        changes["kv_tokens"] = None
    if changes.get("structured_outputs") == {}:  # --structured-outputs off
        changes["structured_outputs"] = None
    scenario = scenario.replace(**changes)
    scenario.validate()
    return scenario


def cmd_run(args) -> None:
    serving_report(args, [args.backend], "run")


def cmd_compare(args) -> None:
    serving_report(args, timed_backend_names(args.backends, args.device, args.dtype), "compare")


def serving_report(args, backends: list[str], command: str) -> None:
    from pagedbench.bench.compare import compare
    from pagedbench.bench.report import CsvLog, tidy, write_reports
    from pagedbench.bench.report_tables import console_table
    from pagedbench.bench.repro import scenario_flags, serving_repro
    from pagedbench.bench.step_record import RecordSteps

    prepare_out_dir(args.out)
    scenario = scenario_from_args(args)
    warn_if_busy(resolve_device_dtype(args.device, args.dtype)[0])
    stem = report_stem(args.out, f"{command}-{scenario.label.replace(':', '-')}", args.overwrite)
    flags = scenario_flags(args.scenario, args.scale, scenario, WORKLOAD_OVERRIDES)
    log = CsvLog(args.out, stem, "serving", command, lambda row: serving_repro(row, flags))
    if args.record_steps is not None and args.record_steps < 1:
        raise ValueError(f"--record-steps must be >= 1, got {args.record_steps}")
    record = RecordSteps(args.record_steps, args.out, stem, command == "compare") if args.record_steps else None
    with keep_partial(log):
        result = compare(
            scenario,
            backends,
            args.scale,
            args.device,
            args.dtype,
            args.repeats if args.repeats is not None else (3 if command == "compare" else 1),
            args.warmup,
            rows=log,
            peers=getattr(args, "peer", None) or [],
            alone_check=getattr(args, "alone_check", 0),
            record=record,
        )
    if command == "run" and result.unavailable:
        raise ValueError(f"backend {args.backend!r} is unavailable here: {result.unavailable[args.backend]}")
    serving = tidy(result.rows, "serving", command)
    workload = f"scenario {scenario.name}" if scenario.dataset_name is None else f"dataset {scenario.label}"
    print(
        textwrap.fill(
            f"{workload} (scale {args.scale:g}, hash {scenario.content_hash()[:12]}): {result.num_requests} "
            f"requests, model {scenario.engine.model}, KV budget {scenario.kv_blocks} blocks x "
            f"{scenario.engine.block_size} for every backend",
            120,
        )
    )
    print(console_table(serving, cross_backend=command == "compare"))
    frames = {
        "serving": serving,
        "requests": tidy(result.request_rows, "requests", command),
        "kv": tidy(result.kv_rows, "kv", command),
    }
    paths = write_reports(frames, args.out, stem)
    print(f"reports: {', '.join(map(str, paths))}")
    if result.stopped is not None:
        stopped_early(result.stopped, serving)
    if not (serving["status"] == "ok").any():
        raise NothingMeasured(f"no backend ran: {'; '.join(f'{b}: {r}' for b, r in result.unavailable.items())}")


def stopped_early(stop: BaseException, serving: pd.DataFrame) -> None:
    """After the reports of a compare cut short are written: Ctrl-C exits as interrupted, naming the
    backends it cut; a backend's failure is raised again (its traceback is the bug report)."""
    if not isinstance(stop, KeyboardInterrupt):
        raise stop
    cut = "; ".join(f"{b}: {r}" for b, r in serving.loc[serving["status"] == "cut", ["backend", "reason"]].values)
    raise Interrupted(f"interrupted; the reports keep every finished run; cut: {cut}")


def cmd_scenarios(args) -> None:
    """The built-in scenarios, with the model `run` takes here (a real-shape preset becomes CPU_MODEL on a CPU)."""
    cpu = resolve_device_dtype(None, None)[0].type == "cpu"
    rows = []
    for name in sorted(builtin_scenarios()):
        s = load_scenario(name)
        arrival = s.arrival if s.request_rate is None else f"{s.arrival} {s.request_rate:g}/s"
        rows.append(
            {
                "scenario": name,
                "requests": s.num_prompts,
                "input": str(s.input_len),
                "output": str(s.output_len),
                "arrival": arrival,
                "KV blocks": s.kv_blocks,
                "model": model_column(s.engine.model, cpu),
            }
        )
    print(pd.DataFrame(rows).to_markdown(index=False))
    if cpu:
        print(f"model: what runs on this CPU ({CPU_MODEL}), the scenario's real-shape preset in parentheses")
    print()  # the descriptions below the table, wrapped: the table fits a 120-column terminal
    for name in sorted(builtin_scenarios()):
        print(textwrap.fill(f"{name}: {load_scenario(name).description}", 120, subsequent_indent="    "))


def model_column(model: str, cpu: bool) -> str:
    """The model `run` takes, with the scenario's real-shape preset in parentheses where it differs."""
    return f"{CPU_MODEL} ({model})" if cpu and model in PRESETS and model != CPU_MODEL else model


def register(sub) -> None:
    run = sub.add_parser("run", help="run a scenario on one backend: throughput, latency, engine internals")
    run.add_argument("--backend", default="sdpa", help="a name from `pagedbench backends`")
    add_scenario_args(run)
    run.set_defaults(func=cmd_run)

    comp = sub.add_parser("compare", help="run a scenario on several backends: same requests, same KV budget")
    comp.add_argument("--backends", default=None, help="comma-separated (default: every registered backend)")
    comp.add_argument(
        "--peer",
        action="append",
        choices=["hf"],
        help="also run a peer library on the same requests: hf = transformers' continuous batching (repeatable)",
    )
    comp.add_argument(
        "--alone-check",
        type=int,
        default=0,
        metavar="K",
        help="also run K of the requests one at a time per backend: identical_alone, the share whose greedy tokens "
        "equal their batched run's (1.0 expected with --batch-invariant)",
    )
    add_scenario_args(comp)
    comp.set_defaults(func=cmd_compare)


def register_scenarios(sub) -> None:
    scen = sub.add_parser("scenarios", help="list the built-in scenarios")
    scen.set_defaults(func=cmd_scenarios)
