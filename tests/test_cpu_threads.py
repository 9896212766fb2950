"""CPU threads for a command: the usable cores less those other work keeps busy at start."""

import os

import pytest
import torch

from pagedbench.device import cpu_threads


def _fake_proc_stat(monkeypatch, busy_shares: list[float], cores: list[int]):
    """Two /proc/stat samples 1000 jiffies apart in which core i was busy busy_shares[i] of the time."""
    samples = iter(
        [
            {i: (0, 0) for i in range(len(busy_shares))},
            {i: (int(1000 * share), 1000) for i, share in enumerate(busy_shares)},
        ]
    )
    monkeypatch.setattr(cpu_threads, "_cpu_times", lambda: next(samples))
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: cores)
    monkeypatch.setattr(cpu_threads.time, "sleep", lambda s: None)


def test_a_busy_core_gets_no_thread(monkeypatch):
    _fake_proc_stat(monkeypatch, [1.0, 0.1], [0, 1])
    assert cpu_threads.default_threads() == (1, "2 usable cores, 1 busy at start")


def test_light_background_work_takes_no_core(monkeypatch):
    _fake_proc_stat(monkeypatch, [0.2, 0.2, 0.05, 0.0], [0, 1, 2, 3])
    assert cpu_threads.default_threads()[0] == 4


def test_only_the_cores_this_process_may_use_count(monkeypatch):
    """Core 0 is busy but outside the affinity mask (taskset, a cgroup): it takes nothing."""
    _fake_proc_stat(monkeypatch, [1.0, 0.0, 0.0], [1, 2])
    assert cpu_threads.default_threads() == (2, "2 usable cores, 0 busy at start")


def test_every_core_busy_still_leaves_one_thread(monkeypatch):
    _fake_proc_stat(monkeypatch, [1.0, 1.0], [0, 1])
    assert cpu_threads.default_threads()[0] == 1


def test_omp_num_threads_wins(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        assert cpu_threads.choose_threads() is None and torch.get_num_threads() == before
        monkeypatch.delenv("OMP_NUM_THREADS")
        _fake_proc_stat(monkeypatch, [1.0, 0.0], [0, 1])
        assert cpu_threads.choose_threads() == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux's /proc/stat")
def test_usable_cores_and_proc_stat_on_this_machine():
    cores = cpu_threads.usable_cores()
    assert cores and all(isinstance(c, int) for c in cores)
    times = cpu_threads._cpu_times()
    assert set(cores) <= set(times) and all(0 <= busy <= total for busy, total in times.values())


def test_the_python_api_chooses_threads_as_the_cli_does(monkeypatch, capsys):
    """LLM() on a CPU: threads= wins; else OMP_NUM_THREADS; else the free cores, with a one-line note."""
    import torch

    from pagedbench import LLM
    from pagedbench.device import cpu_threads

    before = torch.get_num_threads()
    try:
        LLM("tiny-llama", device="cpu", threads=1, num_blocks=16)
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="threads must be an int"):
            LLM("tiny-llama", device="cpu", threads=0)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(cpu_threads, "default_threads", lambda: (2, "2 usable cores, 0 busy at start"))
        LLM("tiny-llama", device="cpu", num_blocks=16)
        assert torch.get_num_threads() == 2
        assert "pagedbench: CPU threads: 2 (2 usable cores, 0 busy at start; OMP_NUM_THREADS" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)
