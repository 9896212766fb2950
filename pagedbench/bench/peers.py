"""Peers: the same requests through another inference library, measured in the same run so a
ratio needs no second machine. `hf`: Hugging Face transformers' continuous batching (its
paged cache and scheduler, `continuous_batching_context_manager`).

A preset model gets random weights in both engines, but not the same ones: its tokens are not
compared. A model directory loads the same weights, so greedy tokens are."""

import contextlib
import logging
import time
from pathlib import Path

import torch
import transformers
from packaging.version import Version

from pagedbench.bench.scenario import Request, Scenario
from pagedbench.model.loader import ResolvedModel
from pagedbench.model.presets import PRESETS

PEERS = ("hf",)
# Under continuous batching transformers routes "sdpa" through its paged cache; before 5.23 that
# had to be asked for by name ("paged|sdpa", deprecated since).
HF_ATTENTION = "sdpa" if Version(transformers.__version__).release >= (5, 23) else "paged|sdpa"
HF_PAGE = 256  # transformers' default page size
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
}


def peer_provider(name: str, model_config=None) -> str:
    if model_config is not None and model_config.linear is not None:
        return f"transformers {transformers.__version__} generate, one request at a time (hybrid model)"
    return f"transformers {transformers.__version__} continuous batching ({HF_ATTENTION})"


def hf_peer(scenario: Scenario, model: ResolvedModel, device: torch.device, dtype: torch.dtype):
    """The Hugging Face peer for `model`: continuous batching, or, for a hybrid model (whose
    linear-attention layers transformers' continuous batching refuses: "Invalid layer type"),
    `generate` one request at a time."""
    cls = HFGenerate if model.config.linear is not None else HFContinuousBatching
    return cls(scenario, model, device, dtype)


def peer_unavailable_reason(name: str, scenario: Scenario) -> str | None:
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    if scenario.n > 1:
        return "n > 1: transformers' continuous batching returns one sample per request"
    engine = scenario.engine
    if engine.tensor_parallel_size * engine.pipeline_parallel_size * engine.data_parallel_size > 1:
        return "tensor, pipeline or data parallelism: the peer runs on one device"
    return None


def hf_model(model: str, path: Path | None, device: torch.device, dtype: torch.dtype, seed: int):
    """The scenario's model in transformers: its directory's weights (`path`, as the command
    resolved `model`), or with `path` None a preset's shape with transformers' own random
    initialisation."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if path is not None:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=HF_ATTENTION)
    else:
        fields = dict(PRESETS[model])
        architectures = fields.pop("architectures")
        fields.pop("model_type", None)
        config = AutoConfig.for_model(MODEL_TYPES[architectures[0]], **fields)
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=HF_ATTENTION)
    return hf.to(device).eval()


@contextlib.contextmanager
def quiet_transformers():
    """transformers' batching logger reports, at ERROR, that it cannot size memory on CPU
    without psutil: irrelevant here (the KV pages are given), and noise beside our tables."""
    log = logging.getLogger("ContinuousBatchingLogger")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


class HFContinuousBatching:
    """One transformers model, driven like pagedbench drives its engine: each request added
    when its arrival time comes, with its own output length."""

    def __init__(self, scenario: Scenario, model: ResolvedModel, device: torch.device, dtype: torch.dtype):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.model = hf_model(scenario.engine.model, model.path, device, dtype, scenario.engine.seed)
        eos = model.config.eos_token_ids
        self.eos_token_id = eos[0] if eos else -1
        sampling = dict(do_sample=True, temperature=scenario.temperature, top_p=scenario.top_p)
        self.generation = GenerationConfig(
            **(sampling if scenario.temperature > 0 else dict(do_sample=False)),
            max_new_tokens=1,  # each request sets its own
            eos_token_id=None,
            pad_token_id=0,
        )
        kv_tokens = scenario.kv_blocks * scenario.engine.block_size  # the KV budget every backend gets
        self.batching = ContinuousBatchingConfig(
            num_blocks=-(-kv_tokens // HF_PAGE),
            max_batch_tokens=scenario.engine.max_num_batched_tokens,
            max_requests_per_batch=scenario.engine.max_num_seqs,
        )

    def drive(self, requests: list[Request]) -> tuple[float, list[list[int]]]:
        """Wall time and each request's output token ids, in request order."""
        pending = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time)
        index: dict[str, int] = {}  # transformers' request id -> our request
        outputs: dict[int, list[int]] = {}
        with (
            quiet_transformers(),
            self.model.continuous_batching_context_manager(
                generation_config=self.generation, block=True, timeout=60, continuous_batching_config=self.batching
            ) as manager,
        ):
            start = time.perf_counter()
            while len(outputs) < len(requests):
                while pending and start + requests[pending[0]].arrival_time <= time.perf_counter():
                    i = pending.pop(0)
                    r = requests[i]
                    request_id = manager.add_request(
                        r.prompt_token_ids,
                        max_new_tokens=r.params.max_tokens,
                        eos_token_id=-1 if r.params.ignore_eos else self.eos_token_id,
                    )
                    index[request_id] = i
                result = manager.get_result(timeout=0.05)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching stopped before finishing")
                    continue
                if result.is_finished():
                    outputs[index[result.request_id]] = list(result.generated_tokens)
            duration = time.perf_counter() - start
        return duration, [outputs[i] for i in range(len(requests))]


class HFGenerate:
    """transformers' `generate`, one request at a time, each when its arrival time has come (the
    peer of models continuous batching cannot run; its throughput is a single-request engine's)."""

    def __init__(self, scenario: Scenario, model: ResolvedModel, device: torch.device, dtype: torch.dtype):
        if device.type != "cuda":  # fla installed, transformers' DeltaNet layers would call its GPU kernels
            from pagedbench.model.delta_rule import pin_transformers_torch_delta_rule

            pin_transformers_torch_delta_rule()
        self.model = hf_model(scenario.engine.model, model.path, device, dtype, scenario.engine.seed)
        eos = model.config.eos_token_ids
        self.eos_token_id = eos[0] if eos else None
        self.sampling = (
            dict(do_sample=True, temperature=scenario.temperature, top_p=scenario.top_p)
            if scenario.temperature > 0
            else dict(do_sample=False)
        )
        self.device = device

    def drive(self, requests: list[Request]) -> tuple[float, list[list[int]]]:
        """Wall time and each request's output token ids, in request order."""
        outputs: dict[int, list[int]] = {}
        with quiet_transformers(), torch.inference_mode():
            start = time.perf_counter()
            for i in sorted(range(len(requests)), key=lambda i: requests[i].arrival_time):
                r = requests[i]
                time.sleep(max(0.0, start + r.arrival_time - time.perf_counter()))
                ids = torch.tensor([r.prompt_token_ids], device=self.device)
                fixed = r.params.ignore_eos  # every output token generated, as the engine does
                out = self.model.generate(
                    ids, max_new_tokens=r.params.max_tokens, min_new_tokens=r.params.max_tokens if fixed else 0,
                    eos_token_id=None if fixed else self.eos_token_id, pad_token_id=0, **self.sampling,
                )  # fmt: skip
                outputs[i] = out[0, ids.shape[1] :].tolist()
            duration = time.perf_counter() - start
        return duration, [outputs[i] for i in range(len(requests))]
