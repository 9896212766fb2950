"""CPU threads for a command: the usable cores less those other work keeps busy at start."""

import sys

import pytest
import torch

from pagedbench.device import cpu_threads


def _fake_psutil(monkeypatch, busy_shares: list[float], cores: list[int]):
    """psutil's per-core sample, in which core i was busy busy_shares[i] of the time."""
    psutil = pytest.importorskip("psutil")
    asked = []

    def cpu_percent(interval=None, percpu=False):
        asked.append((interval, percpu))
        return [100.0 * share for share in busy_shares]

    monkeypatch.setattr(psutil, "cpu_percent", cpu_percent)
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: cores)
    return asked


def test_a_busy_core_gets_no_thread(monkeypatch):
    asked = _fake_psutil(monkeypatch, [1.0, 0.1], [0, 1])
    assert cpu_threads.default_threads() == (1, "2 usable cores, 1 busy at start")
    assert asked == [(cpu_threads.SAMPLE_SECONDS, True)]  # one short per-core sample


def test_without_psutil_every_usable_core_gets_a_thread(monkeypatch):
    """`pip install --no-deps` (the GPU machine) may leave psutil out: no error, no busy-core check."""
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil raises ImportError
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: [0, 1, 2])
    assert cpu_threads.busy_cores([0, 1, 2]) is None
    assert cpu_threads.default_threads() == (3, "3 usable cores, busy ones unknown (no psutil)")


def test_light_background_work_takes_no_core(monkeypatch):
    _fake_psutil(monkeypatch, [0.2, 0.2, 0.05, 0.0], [0, 1, 2, 3])
    assert cpu_threads.default_threads()[0] == 4


def test_only_the_cores_this_process_may_use_count(monkeypatch):
    """Core 0 is busy but outside the affinity mask (taskset, a cgroup): it takes nothing."""
    _fake_psutil(monkeypatch, [1.0, 0.0, 0.0], [1, 2])
    assert cpu_threads.default_threads() == (2, "2 usable cores, 0 busy at start")


def test_every_core_busy_still_leaves_one_thread(monkeypatch):
    _fake_psutil(monkeypatch, [1.0, 1.0], [0, 1])
    assert cpu_threads.default_threads()[0] == 1


def test_omp_num_threads_wins(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        assert cpu_threads.choose_threads() is None and torch.get_num_threads() == before
        monkeypatch.delenv("OMP_NUM_THREADS")
        _fake_psutil(monkeypatch, [1.0, 0.0], [0, 1])
        assert cpu_threads.choose_threads() == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_usable_cores_and_busy_cores_on_this_machine():
    pytest.importorskip("psutil")
    cores = cpu_threads.usable_cores()
    assert cores and all(isinstance(c, int) for c in cores)
    assert 0 <= cpu_threads.busy_cores(cores, seconds=0.05) <= len(cores)


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
