"""The host benchmark (`pagedbench profile --stand-in-device-ms D`): the real engine's host work
around a stand-in device of D ms a step, async scheduling off and on."""

import pandas as pd
import pytest

from pagedbench.bench.host_profile import StandInDevice, host_profile
from pagedbench.entrypoints.cli.main import main


def test_the_stand_in_device_takes_its_time_and_decides_the_tokens():
    device = StandInDevice(2.0, vocab_size=50, max_rows=8)
    inputs = type("Inputs", (), {"logits_indices": [0, 1, 2]})()
    first, second = device.run(inputs, None), device.run(inputs, None)
    assert first.shape == (3, 50) and first.argmax(-1).tolist() == [3, 10, 17]
    assert second.argmax(-1).tolist() == [10, 17, 24]  # the next step's tokens move on


@pytest.mark.parametrize("run_ahead", [False, True], ids=["sync", "async"])
def test_host_profile_measures_host_and_device_apart(run_ahead):
    row = host_profile("tiny-llama", "sdpa", 4.0, batch=4, context=16, output_len=3, steps=5, run_ahead=run_ahead)
    assert (row.batch, row.context, row.output_len, row.steps, row.async_scheduling) == (4, 16, 3, 5, run_ahead)
    assert row.device_ms_per_step >= 4.0  # the stand-in's sleep is the device's, every step
    assert 0 < row.host_ms_per_step < row.wall_ms_per_step and 0 < row.busy_share <= 1.05
    if not run_ahead:  # in series: the wall holds the host's work and the device's
        assert row.wall_ms_per_step >= row.device_ms_per_step


@pytest.mark.slow
def test_profile_stand_in_writes_both_rows_and_the_plot(tmp_path):
    args = ["profile", "--stand-in-device-ms", "2", "--batch-sizes", "2,4", "--context", "16", "--output-lens", "2"]
    assert main([*args, "--steps", "3", "--out", str(tmp_path)]) == 0
    df = pd.read_csv(tmp_path / "host-profile.csv")
    assert sorted(df["async_scheduling"].unique()) == [False, True] and sorted(df["batch"].unique()) == [2, 4]
    assert {"host_ms_per_step", "wall_ms_per_step", "busy_share", "output_len", "context"} <= set(df.columns)
    assert (tmp_path / "host-profile.png").stat().st_size > 0 and (tmp_path / "host-profile.md").is_file()
    assert main([*args, "--stand-in-device-ms", "0"]) == 2


def test_the_kv_timeline_stays_bounded_and_samples_wasted_slots_on_its_steps():
    from pagedbench.engine.stats import TIMELINE_POINTS, EngineStats, StepTimes

    stats, counted = EngineStats(), []
    for step in range(5 * TIMELINE_POINTS):
        wanted = stats.samples_next_step
        counted.append(wanted)
        stats.record_step(StepTimes(start=0.0, end=float(step)), 10, 0, step if wanted else None)
    assert stats.steps == 5 * TIMELINE_POINTS and len(stats.timeline) <= TIMELINE_POINTS + 1
    times = [t for t, _, _ in stats.timeline]
    assert times[0] == 0.0 and times[-1] > 4 * TIMELINE_POINTS  # it spans the run, evenly
    assert len({b - a for a, b in zip(times, times[1:])}) == 1
    assert all(w == t for t, _, w in stats.timeline)  # each point's wasted slots are its own step's
    assert stats.wasted_slot_samples == sum(counted) < stats.steps
    assert stats.peak_wasted_slots == max(s for s, wanted in enumerate(counted) if wanted)


def test_an_engine_freezes_the_startup_heap_and_its_shutdown_thaws_it(monkeypatch):
    import gc

    from pagedbench import LLM, SamplingParams

    monkeypatch.setenv("PAGEDBENCH_GC_FREEZE", "1")
    llm = LLM("tiny-llama", backend="sdpa", device="cpu", dtype="float32", num_blocks=64, max_model_len=64)
    try:
        assert gc.get_freeze_count() > 1000  # torch's and the model's objects: out of every later collection
        out = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
    assert gc.get_freeze_count() == 0


def test_an_engine_dropped_without_shutdown_is_collected_when_the_next_is_built(monkeypatch):
    import gc
    import weakref

    from pagedbench import LLM

    monkeypatch.setenv("PAGEDBENCH_GC_FREEZE", "1")
    settings = dict(backend="sdpa", device="cpu", dtype="float32", num_blocks=64, max_model_len=64)
    first = LLM("tiny-llama", **settings)
    cache = weakref.ref(first.engine.runner.kv_cache)  # the first engine's whole KV cache
    scheduler = weakref.ref(first.engine.scheduler)  # in a reference cycle with its StepUpdate: frozen with the heap
    del first
    second = LLM("tiny-llama", **settings)
    try:
        assert scheduler() is None and cache() is None  # collected before the second sized its cache
        assert gc.get_freeze_count() > 0
    finally:
        second.shutdown()
