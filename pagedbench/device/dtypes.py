"""Device and dtype from user-facing names; dtype names as reports print them."""

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,  # vLLM's and torch's other names
    "float": torch.float32,
}


def resolve_device_dtype(device: str | None, dtype: str | torch.dtype | None) -> tuple[torch.device, torch.dtype]:
    """Defaults (dtype None or "auto"): cuda if available else cpu; bf16 on cuda, fp32 on cpu."""
    try:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as e:
        raise ValueError(f"bad device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but CUDA is not available")
    if dtype is None or dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dev, dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto or one of {', '.join(DTYPES)}")
    return dev, DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")
