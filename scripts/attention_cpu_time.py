"""The engine's attention time per step against its replay's, by wall clock and by the thread's CPU time.

    OMP_NUM_THREADS=1 python scripts/attention_cpu_time.py [--backend flex] [--scale 0.1] [--repeats 5]
        [--out /tmp/attention-cpu-time]

Runs `pagedbench run --record-steps` (tiny-llama, `mixed`) and then `kernels --replay` of its recording
in this process, with every attention backend's forward() wrapped to note each call's wall time and the
calling thread's CPU time (time.thread_time: what the call computed, not the time other processes held
the core). Prints both per step: the engine's (its measured run's steps, as recorded) and the replay's
(median of its repeats, as `kernels --replay` reports), and their ratios. On a loaded machine the
engine's wall time (one sample per step) is stretched by the time-slices other processes take; the
replay's median of repeats mostly is not; CPU time is stretched in neither. Single-threaded only: with
more OpenMP threads the main thread's CPU time misses its workers' share.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from pagedbench.backends.registry import get_backend

from pagedbench.entrypoints.cli.main import main as pagedbench

CALLS: list[dict] = []


def wrap_forward(cls: type) -> None:
    """Note each outermost forward() of `cls`: its state, query tokens, wall and thread-CPU seconds."""
    inner = cls.forward

    def forward(self, q, k_cache, v_cache, state, *args, **kwargs):
        if getattr(forward, "depth", 0):  # a cascade's inner calls belong to the outer one
            return inner(self, q, k_cache, v_cache, state, *args, **kwargs)
        forward.depth = 1
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return inner(self, q, k_cache, v_cache, state, *args, **kwargs)
        finally:
            forward.depth = 0
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            CALLS.append({"state": id(state), "tokens": q.shape[0], "wall": wall, "cpu": cpu})

    cls.forward = forward


def groups(calls: list[dict]) -> list[list[dict]]:
    """Consecutive calls on one plan state: a step's layers (engine) or one step's timed calls (replay)."""
    out = []
    for call in calls:
        if out and out[-1][0]["state"] == call["state"] and out[-1][0]["tokens"] == call["tokens"]:
            out[-1].append(call)
        else:
            out.append([call])
    return out


def engine_steps(calls: list[dict], recorded_tokens: list[int]) -> list[list[dict]]:
    """The recorded run's steps among the engine's calls: where the steps' query tokens match the recording."""
    steps = groups(calls)
    tokens = [g[0]["tokens"] for g in steps]
    for start in range(len(tokens) - len(recorded_tokens) + 1):
        if tokens[start : start + len(recorded_tokens)] == recorded_tokens:
            return steps[start : start + len(recorded_tokens)]
    raise ValueError("the recorded steps are not among the engine's calls")


def summary(label: str, wall: list[float], cpu: list[float]) -> dict:
    row = {
        "label": label,
        "wall_ms_per_step": 1e3 * statistics.mean(wall),
        "cpu_ms_per_step": 1e3 * statistics.mean(cpu),
    }
    row["wall_over_cpu"] = row["wall_ms_per_step"] / row["cpu_ms_per_step"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="flex")
    parser.add_argument("--scale", default="0.1")
    parser.add_argument("--repeats", default="5")
    parser.add_argument("--out", default="/tmp/attention-cpu-time")
    args = parser.parse_args(argv)
    wrap_forward(get_backend(args.backend))
    run = ["run", "--backend", args.backend, "--scenario", "mixed", "--scale", args.scale, "--model", "tiny-llama"]
    if pagedbench([*run, "--record-steps", "200", "--out", args.out, "--overwrite"]):
        return 1
    recording = Path(args.out) / "run-mixed-steps.jsonl"
    lines = [json.loads(line) for line in recording.read_text().splitlines()[1:]]
    engine = engine_steps(list(CALLS), [sum(line["q"]) for line in lines])
    del CALLS[:]
    replay = ["kernels", "--replay", str(recording), "--backends", args.backend, "--repeats", args.repeats]
    if pagedbench([*replay, "--out", args.out, "--overwrite"]):
        return 1
    timed = [g for g in groups(CALLS) if len(g) > 1]  # each step's warmup + repeats (its untimed first call alone)
    if len(timed) != len(engine):
        raise ValueError(f"{len(timed)} timed replay steps for {len(engine)} recorded")
    layers = len(engine[0])
    rows = [
        summary("engine", [sum(c["wall"] for c in g) for g in engine], [sum(c["cpu"] for c in g) for g in engine]),
        summary(
            "replay",
            [layers * statistics.median(c["wall"] for c in g[1:]) for g in timed],
            [layers * statistics.median(c["cpu"] for c in g[1:]) for g in timed],
        ),
    ]
    for row in rows:
        print(
            json.dumps(
                {"backend": args.backend, **{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}}
            )
        )
    wall, cpu = (rows[0][k] / rows[1][k] for k in ("wall_ms_per_step", "cpu_ms_per_step"))
    print(
        json.dumps(
            {
                "backend": args.backend,
                "engine_over_replay_wall": round(wall, 3),
                "engine_over_replay_cpu": round(cpu, 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
