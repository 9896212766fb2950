"""Kernel level: every available backend equals `reference` on randomized ragged batches over
fragmented block tables (decode, prefill, mixed; MHA/GQA/MQA; head dims; block sizes; dtypes)."""
import random

import pytest
import torch

from pagedbench.attention_batch import random_attention_batch
from pagedbench.backends.registry import get_backend, list_backends, probe
from tests.helpers import DEVICES, backend_id

HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def ragged_batch_spec(phase: str, block_size: int, rng: random.Random) -> list[tuple[int, int]]:
    """(context_len, query_len) per sequence, decodes first, with lengths on and around
    page boundaries, single-token sequences and partial last pages."""
    edge = [1, block_size - 1, block_size, block_size + 1, 2 * block_size]

    def length():
        return rng.choice(edge) if rng.random() < 0.4 else rng.randint(1, 3 * block_size)

    decodes = [(length() - 1, 1) for _ in range(rng.randint(1, 5))]
    prefills = [(0, length()) for _ in range(rng.randint(1, 3))]
    chunks = [(length(), rng.randint(2, block_size + 3)) for _ in range(rng.randint(1, 3))]
    return {"decode": decodes, "prefill": prefills, "mixed": decodes + prefills + chunks}[phase]


def run_backend(name, batch, num_heads, num_kv_heads, head_dim, block_size, dtype, device, **kwargs):
    backend = get_backend(name)(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, block_size,
                                torch.device(device), dtype, **kwargs)
    state = backend.prepare(batch.metadata)
    return backend.forward(batch.q, batch.k_cache, batch.v_cache, state)


def cases() -> list:
    params = []
    for device in DEVICES:
        for dtype in (torch.float32, torch.bfloat16):
            for head_dim in (64, 128):
                for block_size in (16, 128):
                    for name in list_backends():
                        if name == "reference":
                            continue
                        _, reason = probe(get_backend(name), torch.device(device), dtype, head_dim, block_size)
                        marks = [pytest.mark.skip(reason=f"{name}: {reason}")] if reason else []
                        dt = str(dtype).removeprefix("torch.")
                        params.append(pytest.param(name, device, dtype, head_dim, block_size, marks=marks,
                                                   id=f"{backend_id(name)}-{device}-{dt}-d{head_dim}-bs{block_size}"))
    return params


@pytest.mark.parametrize("name,device,dtype,head_dim,block_size", cases())
@pytest.mark.parametrize("phase", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("heads", HEADS)
def test_backend_matches_reference(name, device, dtype, head_dim, block_size, phase, heads):
    num_heads, num_kv_heads = HEADS[heads]
    rng = random.Random(f"{phase}-{heads}-{head_dim}-{block_size}")
    for trial in range(2):
        spec = ragged_batch_spec(phase, block_size, rng)
        batch = random_attention_batch(spec, num_heads, num_kv_heads, head_dim, block_size, dtype, device,
                                       seed=trial)
        args = (batch, num_heads, num_kv_heads, head_dim, block_size, dtype, device)
        expected = run_backend("reference", *args)
        got = run_backend(name, *args)
        assert got.shape == expected.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype],
                                   msg=lambda m: f"{name} vs reference on {spec}: {m}")


def test_reference_matches_dense_causal_attention():
    """The ground truth itself: one prefill on a fragmented table equals plain causal SDPA."""
    batch = random_attention_batch([(0, 37)], 4, 2, 64, 16)
    out = run_backend("reference", batch, 4, 2, 64, 16, torch.float32, "cpu")
    slots = batch.metadata.slot_mapping
    k = batch.k_cache.view(-1, 2, 64)[slots].repeat_interleave(2, dim=1).transpose(0, 1)
    v = batch.v_cache.view(-1, 2, 64)[slots].repeat_interleave(2, dim=1).transpose(0, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(batch.q.transpose(0, 1), k, v, is_causal=True)
    torch.testing.assert_close(out, dense.transpose(0, 1), atol=1e-5, rtol=1e-5)
