"""`compare --alone-check K`: K of the scenario's requests run again one at a time, on a fresh engine
of the same backend and settings, and each row's `identical_alone` is the share of them whose greedy
tokens equal their batched run's (1.0 under batch_invariant; below it where the batch changes a
token's logits enough to flip an argmax)."""

import dataclasses

import numpy as np

from pagedbench.engine.data_parallel import make_engine

ALONE_COLUMN = "identical_alone"


def alone_indices(num_requests: int, k: int) -> list[int]:
    """K requests spread evenly over the request set (all of them when K >= their number)."""
    if k < 1:
        raise ValueError(f"--alone-check takes a positive number of requests, got {k}")
    k = min(k, num_requests)
    return sorted({round(i * (num_requests - 1) / max(k - 1, 1)) for i in range(k)})


def sample_offsets(requests) -> list[int]:
    """Where each request's samples start in a Measurement's outputs (n samples a request)."""
    offsets = [0]
    for r in requests:
        offsets.append(offsets[-1] + r.params.n)
    return offsets


def identical_alone(config, model, requests, batched: list[list[int]], indices: list[int], drive) -> float:
    """Share of requests `indices` whose tokens alone (each the engine's only request, prefix cache
    cold, run by compare's `drive`) equal `batched` (a Measurement's outputs: every request's samples)."""
    offsets, same = sample_offsets(requests), 0
    engine = make_engine(config, model=model)
    try:
        for i in indices:
            engine.reset_prefix_cache()
            _, (out,) = drive(engine, [dataclasses.replace(requests[i], arrival_time=0.0)])
            same += [list(c.token_ids) for c in out.outputs] == [list(t) for t in batched[offsets[i] : offsets[i + 1]]]
    finally:
        engine.shutdown()
    return same / len(indices)


def add_alone_columns(rows: list[dict], measured: dict, configs: dict, model, requests, k: int, greedy: bool, drive):
    """identical_alone on each ok row of a backend in `configs` ({name: its EngineConfig}), from its
    first run without speculation; NaN for sampled scenarios, peers and speculative runs."""
    indices = alone_indices(len(requests), k)
    shares = {}
    for name, config in configs.items():
        runs = measured.get((name, "off"))
        if greedy and runs:
            shares[name] = identical_alone(config, model, requests, runs[0].outputs, indices, drive)
    for row in rows:
        if row.get("status") == "ok":
            row[ALONE_COLUMN] = shares.get(row["backend"], np.nan) if row.get("speculative", "off") == "off" else np.nan
