"""Workloads and timed runs: the same requests (from a seed, never Python's hash) for every backend."""
import time
from dataclasses import dataclass

import numpy as np
import torch

from pagedbench.engine import LLMEngine
from pagedbench.sampling_params import SamplingParams


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    params: list[SamplingParams]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)


def synthetic_workload(num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0) -> Workload:
    """Random-token prompts of `input_len` tokens, each generating exactly `output_len` tokens."""
    if min(num_prompts, input_len, output_len) < 1:
        raise ValueError("num_prompts, input_len and output_len must be >= 1")
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, vocab_size, size=(num_prompts, input_len)).tolist()
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    return Workload(prompts, [params] * num_prompts)


def run_workload(engine: LLMEngine, workload: Workload) -> dict:
    """Run every request to completion; throughput and the engine's step-time split."""
    engine.stats.reset()
    _sync(engine.device)
    start = time.perf_counter()
    for prompt, params in zip(workload.prompts, workload.params):
        engine.add_request({"prompt_token_ids": prompt}, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(o for o in engine.step() if o.finished)
    _sync(engine.device)
    duration = time.perf_counter() - start
    st = engine.stats
    input_tokens = sum(map(len, workload.prompts))
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    step_time = st.time_schedule + st.time_metadata + st.time_backend_prepare + st.time_forward + st.time_sample
    return {
        "backend": engine.config.backend,
        "provider": engine.backend.provider(),
        "device": _device_name(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "num_requests": len(outputs),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "duration_s": duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "steps": st.steps,
        "preemptions": st.preemptions,
        "backend_prepare_share": st.time_backend_prepare / step_time if step_time else 0.0,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
