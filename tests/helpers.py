import re

import pytest
import torch
from pagedbench.backends.registry import get_backend, list_backends, probe

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def backend_id(name: str) -> str:
    """A short, stable test id: the backend's name, plus which flash-attn generation serves it
    (`flash-attn[FA3]`); versions and settings stay out (they change with every install; `-rs`
    and the reports name the provider)."""
    generation = re.search(r"\bFA\d\b", get_backend(name).provider())
    return f"{name}[{generation.group()}]" if generation else name


def backend_params(dtype=torch.float32, head_dim=16, block_size=16):
    """pytest params for every registered backend on every device; unavailable ones are
    skipped with their reason (visible with `pytest -rs`)."""
    params = []
    for device in DEVICES:
        for name in list_backends():
            _, reason = probe(get_backend(name), torch.device(device), dtype, head_dim, block_size)
            marks = [pytest.mark.skip(reason=f"{name} on {device}: {reason}")] if reason else []
            params.append(pytest.param(name, device, id=f"{backend_id(name)}-{device}", marks=marks))
    return params


# The engine's CPU backends for engine-level tests: sdpa in the fast tier, the others in the slow one.
ENGINE_BACKENDS = [
    "sdpa",
    pytest.param("reference", marks=pytest.mark.slow),
    pytest.param("flex", marks=pytest.mark.slow),
]


def rows_with_pid(case, backends, device):
    """A stand-in for the check's run_case (module level, so a spawned helper can load it): one row
    per backend saying which process made it; in a helper, a case named "dies" kills the process."""
    import multiprocessing
    import os

    if case.batch == "dies" and multiprocessing.parent_process() is not None:
        os._exit(3)
    return [{"case": case.name, "backend": name, "pid": os.getpid()} for name in backends]


def assert_swap_and_tp2_keep_the_tokens(path: str, prompts: list, expected: list, max_new: int, **setup) -> None:
    """The model at `path` under swap preemption (it must swap) and at tensor-parallel size 2 (sdpa,
    CPU, fp32, `setup`) gives `expected` greedy tokens for `prompts`."""
    from pagedbench import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    settings = dict(backend="sdpa", device="cpu", dtype="float32") | setup
    swap = LLM(path, preemption_mode="swap", **settings)
    assert [o.outputs[0].token_ids for o in swap.generate(requests, params, use_tqdm=False)] == expected
    assert swap.engine.stats.swap_outs > 0
    tp = LLM(path, tensor_parallel_size=2, **settings)
    try:
        assert [o.outputs[0].token_ids for o in tp.generate(requests, params, use_tqdm=False)] == expected
    finally:
        tp.shutdown()


def report_environment(conn, name: str) -> None:
    """A child process's view (module level, so a started child can load it): `name` in its
    environment, its working directory and torch's threads, sent up `conn`."""
    import os

    import torch

    conn.send((os.environ.get(name), os.getcwd(), torch.get_num_threads()))
    conn.close()
