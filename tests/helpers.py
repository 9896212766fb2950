import pytest
import torch

from pagedbench.backends.registry import get_backend, list_backends

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def backend_params(dtype=torch.float32, head_dim=16, block_size=16):
    """pytest params for every registered backend on every device; unavailable ones are
    skipped with their reason (visible with `pytest -rs`)."""
    params = []
    for device in DEVICES:
        for name in list_backends():
            reason = get_backend(name).unavailable_reason(torch.device(device), dtype, head_dim, block_size)
            marks = [pytest.mark.skip(reason=f"{name} on {device}: {reason}")] if reason else []
            params.append(pytest.param(name, device, id=f"{name}-{device}", marks=marks))
    return params
