"""Build the model from a Hugging Face directory (config.json + safetensors) or a preset."""

import difflib
import logging
import re
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open

from pagedbench.model.batch_invariant import unsupported_reason
from pagedbench.model.config import ModelConfig
from pagedbench.model.fused import ops_for
from pagedbench.model.gguf import REAL_MODELS, gguf_model_dir, is_gguf
from pagedbench.model.llama import CausalLM
from pagedbench.model.parallel import NO_TP, WHOLE_MODEL, PPStage, TPShard, full_shape, local_part
from pagedbench.model.preset_init import decisive_reason, decisive_weights
from pagedbench.model.presets import PRESETS
from pagedbench.model.trained_pair import trained_models

logger = logging.getLogger(__name__)


class ResolvedModel(NamedTuple):
    """A model name resolved once per command and passed down (engines, peers, report columns)."""

    config: ModelConfig
    path: Path | None  # the Hugging Face directory; None for a preset (random weights)


def resolve_model_config(model: str, need_weights: bool = True) -> ResolvedModel:
    """(config, model directory or None for a preset). The trained pair (py-byte-target,
    py-byte-draft) and the real GGUF models (smollm2-135m-instruct) are found by name; a .gguf
    file is converted once into a cached directory (gguf.py)."""
    if model in PRESETS:
        return ResolvedModel(ModelConfig.from_dict(PRESETS[model]), None)
    path = gguf_model_dir(model) if is_gguf(model) else trained_models().get(model, Path(model))
    if not path.exists():
        known = [*PRESETS, *trained_models(), *REAL_MODELS]
        raise FileNotFoundError(
            f"model {model!r} is neither a directory nor a preset ({', '.join(known)}){did_you_mean(model, known)}"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {model!r} has no config.json")
    if need_weights and not list(path.glob("*.safetensors")):
        raise ValueError(f"model directory {model!r} has no *.safetensors weights")
    return ResolvedModel(ModelConfig.from_dir(path), path)


def did_you_mean(name: str, known: list[str]) -> str:
    """The hint `; did you mean 'x'?` with the closest of `known` to a mistyped `name`, else nothing."""
    match = difflib.get_close_matches(name, known, n=1)
    return f"; did you mean {match[0]!r}?" if match else ""


def weights_path(path: Path | None, config) -> Path | None:
    """Where build_model reads weights: None (random, as for a preset) under load_format="dummy"."""
    return None if config.load_format == "dummy" else path


def build_model(
    cfg: ModelConfig,
    path: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    seed: int,
    tp: TPShard = NO_TP,
    preset_init: str = "decisive",
    stage: PPStage = WHOLE_MODEL,
    compile: bool = False,
    batch_invariant: bool = False,
) -> CausalLM:
    """The model (this rank's shard of it, of pipeline `stage`'s layers), from `path`'s
    safetensors, or with `path` None random weights (`preset_init`: "decisive", see
    preset_init.py, or "plain" N(0, 0.02)): every shard and stage gets the whole model's values.
    `compile`: the layers' elementwise work under torch.compile (fused.py), with q/k/v and gate/up
    as one GEMM each (merged_projections). `batch_invariant`: every dense GEMM in fixed row tiles
    (batch_invariant.py), or a ValueError where the model has GEMMs it does not tile."""
    if batch_invariant and (reason := unsupported_reason(cfg)):
        raise ValueError(reason)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in `dtype`; RoPE tables stay fp32
    try:
        with torch.device(device):
            model = CausalLM(cfg, max_positions, tp, stage)
    finally:
        torch.set_default_dtype(default_dtype)
    if path is None and preset_init == "decisive" and (reason := decisive_reason(cfg, max_positions)):
        logger.warning("random weights: plain init, not decisive: %s", reason)
        preset_init = "plain"
    if path is None and preset_init == "decisive":
        _init_decisive(model, seed, max_positions)
    elif path is None:
        _init_random(model, seed)
    else:
        _load_safetensors(model, path)
    model.batch_invariant = batch_invariant
    return model.eval().requires_grad_(False).use_ops(ops_for(compile), merged_projections(device, compile))


def merged_projections(device: torch.device, compile: bool) -> bool:
    """One GEMM for q/k/v and one for gate/up: on CUDA (fewer, larger kernels) and wherever the model
    is compiled; on an eager CPU run apart, where the merged GEMM measured no faster (docs/benchmarks.md)."""
    return device.type == "cuda" or compile


def _whole_model_shapes(model: CausalLM) -> list[tuple[str, tuple]]:
    """(name, checkpoint shape) of every parameter of the whole model, in its order: a pipeline
    stage draws random weights in the same sequence as a single process does, keeping its own."""
    if model.stage == WHOLE_MODEL:
        return [(name, full_shape(p)) for name, p in model.named_parameters()]
    with torch.device("meta"):
        whole = CausalLM(model.config, 1, model.tp)
    return [(name, full_shape(p)) for name, p in whole.named_parameters()]


def _stage_params(model: CausalLM) -> dict[str, torch.nn.Parameter]:
    """This stage's parameters by checkpoint name (a last stage's LM head answers for a tied embedding)."""
    params = dict(model.named_parameters())
    if model.config.tie_word_embeddings and "lm_head.weight" in params and "model.embed_tokens.weight" not in params:
        params["model.embed_tokens.weight"] = params.pop("lm_head.weight")
    return params


def _init_random(model: CausalLM, seed: int) -> None:
    params = _stage_params(model)
    device = next(iter(params.values())).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shape in _whole_model_shapes(model):
        p = params.get(name)
        if name.endswith("norm.weight"):
            if p is not None:
                p.data.fill_(1.0)
            continue
        # Drawn at full size, then sliced: every tensor-parallel size and stage gets the same weights.
        full = torch.empty(shape, dtype=torch.get_default_dtype() if p is None else p.dtype, device=device)
        full.normal_(0.0, 0.02, generator=gen)
        if p is not None:
            p.data.copy_(local_part(p, full))


def _init_decisive(model: CausalLM, seed: int, max_positions: int) -> None:
    params = _stage_params(model)
    for name, full in decisive_weights(model.config, _whole_model_shapes(model), seed, max_positions):
        if (p := params.get(name)) is not None:
            p.data.copy_(local_part(p, full.to(p.device, p.dtype)))


def _load_safetensors(model: CausalLM, path: Path) -> None:
    params = _stage_params(model)
    tied = model.config.tie_word_embeddings
    others = {name for name, _ in _whole_model_shapes(model)} - set(params)  # other stages' weights
    loaded: set[str] = set()
    expert_names = model.config.moe.expert_names if model.config.moe is not None else None
    for file in sorted(path.glob("*.safetensors")):
        try:
            _load_file(file, params, tied, loaded, others, expert_names)
        except (OSError, RuntimeError, SafetensorError) as e:  # truncated or corrupt: one line naming the file
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"cannot read weights from {file}: {reason}") from None
    missing = [n for n in params if n not in loaded and not (tied and n == "lm_head.weight")]
    if missing:
        raise ValueError(f"weights missing from {path}: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")


# A checkpoint's per-expert weight, stored in the model as one slice of a stacked [E, ...] parameter.
EXPERT_WEIGHT = re.compile(r"^(?P<stack>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


def _expert_stack(name: str) -> str | None:
    """The stacked parameter a checkpoint's per-expert weight goes into, or None."""
    match = EXPERT_WEIGHT.match(name)
    return match and f"{match['stack']}.{match['proj']}"


def _load_expert(name: str, tensor: torch.Tensor, params: dict, loaded: set[str]) -> bool:
    """Copy expert e's weight into slice e of its stacked parameter (this rank's part); False when
    `name` is no expert weight of the model."""
    stack = _expert_stack(name)
    match = EXPERT_WEIGHT.match(name)
    if stack not in params:
        return False
    param, expert = params[stack], int(match["expert"])
    expected = full_shape(param)
    if expert >= expected[0] or tuple(tensor.shape) != expected[1:]:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}: not expert {expert} of {expected}")
    if hasattr(param, "tp_slice"):  # the stacked parameter's shard, on this expert's dims
        dim, start, length, _ = param.tp_slice
        tensor = tensor.narrow(dim - 1, start, length)
    param.data[expert].copy_(tensor)
    loaded.add(f"{stack}#{expert}")
    if all(f"{stack}#{e}" in loaded for e in range(expected[0])):
        loaded.add(stack)
    return True


# transformers' in-memory layout of SiLU-gated experts (what its GGUF reader yields): gate and up
# stacked as one [E, 2I, in] gate_up_proj (gate first), down_proj [E, out, I].
STACKED_EXPERTS = re.compile(r"^(?P<stack>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def _load_stacked_experts(
    name: str, f, model_names: tuple[str, str, str] | None, params: dict, skip: set[str], loaded: set[str]
) -> bool:
    """Copy transformers' stacked gate_up_proj / down_proj from file `f` into the model's
    per-projection stacks (`model_names`: its gate, up and down names; None: a dense model), or
    pass over another pipeline stage's (in `skip`); False when `name` is no such weight of the model."""
    match = STACKED_EXPERTS.match(name)
    if match is None or model_names is None:
        return False
    gate, up, down = (f"{match['stack']}.{proj}" for proj in model_names)
    if gate in skip:
        return True
    if gate not in params:
        return False
    tensor = f.get_tensor(name)
    parts = {down: tensor} if match["proj"] == "down_proj" else dict(zip((gate, up), tensor.chunk(2, dim=1)))
    for target, part in parts.items():
        param = params[target]
        if tuple(part.shape) != full_shape(param):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}: not the experts of {full_shape(param)}")
        param.data.copy_(local_part(param, part))
        loaded.add(target)
    return True


def _load_file(
    file: Path, params: dict, tied: bool, loaded: set[str], others: set[str], expert_names: tuple[str, str, str] | None
) -> None:
    """Copy `file`'s weights into `params` (this rank's parts); `others`: the names of weights
    other pipeline stages hold, passed over; `expert_names`: the model's gate, up and down
    expert projections."""
    with safe_open(str(file), framework="pt") as f:
        for name in f.keys():
            if name in others or _expert_stack(name) in others:
                continue
            if name not in params and _load_expert(name, f.get_tensor(name), params, loaded):
                continue
            if name not in params and _load_stacked_experts(name, f, expert_names, params, others, loaded):
                continue
            if name not in params:
                if "rotary_emb" in name or (tied and name == "lm_head.weight"):
                    continue
                raise ValueError(f"unexpected weight {name!r} in {file.name}")
            tensor, param = f.get_tensor(name), params[name]
            if tuple(tensor.shape) != full_shape(param):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {full_shape(param)}")
            param.data.copy_(local_part(param, tensor))
            loaded.add(name)
