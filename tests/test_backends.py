"""Kernel level: every backend that runs here equals the dense oracle on random ragged batches over
random page layouts (hypothesis). The fixed grid of cases (dtypes, head dims, page sizes, shared
pages, placement) is `pagedbench check`'s, run by tests/test_check.py; helpers for other tests."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagedbench.backends.base import AttentionVariant
from pagedbench.backends.registry import get_backend, list_backends, probe

from pagedbench.bench.problems import attend_dense, place, random_attention_batch, random_problem
from tests.helpers import backend_id

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
    backend = get_backend(name)(
        num_heads, num_kv_heads, head_dim, head_dim**-0.5, block_size, torch.device(device), dtype, **kwargs
    )
    state = backend.plan(batch.metadata)
    return backend.forward(batch.q, batch.k_cache, batch.v_cache, state)


@st.composite
def ragged_batches(draw, block_size: int = 16) -> list[tuple[int, int]]:
    """(context_len, query_len) per sequence, decodes first: lengths drawn around page boundaries."""
    near_page = st.sampled_from([0, 1, block_size - 1, block_size, block_size + 1, 2 * block_size, 3 * block_size - 1])
    length = st.one_of(near_page, st.integers(0, 4 * block_size))
    decodes = draw(st.lists(length, max_size=6))
    others = draw(
        st.lists(st.tuples(length, st.integers(1, 2 * block_size + 3)), min_size=0 if decodes else 1, max_size=4)
    )
    return [(c, 1) for c in decodes] + others


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, id=backend_id(n), marks=[pytest.mark.skip(reason=f"{n} on cpu: {reason}")] if reason else [])
        for n in list_backends()
        for reason in [probe(get_backend(n), "cpu", torch.float32, 64, 16)[1]]
    ],
)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=ragged_batches(), heads=st.sampled_from(sorted(HEADS)), seed=st.integers(0, 2**16))
def test_random_ragged_batches_match_the_oracle(name, spec, heads, seed):
    """Every backend that runs on this CPU, on random ragged batches over random page layouts,
    equals the dense oracle of the same logical problem (flex: one compiled graph per call kind
    and head configuration, shared with `check`'s quick grid)."""
    num_heads, num_kv_heads = HEADS[heads]
    problem = random_problem(spec, num_heads, num_kv_heads, 64, seed=seed)
    batch = place(problem, 16, layout_seed=seed)
    got = run_backend(name, batch, num_heads, num_kv_heads, 64, 16, torch.float32, "cpu")
    expected = attend_dense(problem, 64**-0.5, torch.float64)
    torch.testing.assert_close(
        got.double(),
        expected,
        atol=TOLERANCE[torch.float32],
        rtol=TOLERANCE[torch.float32],
        msg=lambda m: f"{name} on {spec}: {m}",
    )


def test_reference_matches_dense_causal_attention():
    """The ground truth itself: one prefill on a fragmented table equals plain causal SDPA."""
    batch = random_attention_batch([(0, 37)], 4, 2, 64, 16)
    out = run_backend("reference", batch, 4, 2, 64, 16, torch.float32, "cpu")
    slots = batch.metadata.slot_mapping
    k = batch.k_cache.view(-1, 2, 64)[slots].repeat_interleave(2, dim=1).transpose(0, 1)
    v = batch.v_cache.view(-1, 2, 64)[slots].repeat_interleave(2, dim=1).transpose(0, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(batch.q.transpose(0, 1), k, v, is_causal=True)
    torch.testing.assert_close(out, dense.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_sdpa_names_its_cuda_kernel():
    """On CUDA sdpa picks the memory-efficient kernel itself (cuDNN plans per shape); the
    provider column says so. On CPU it is plain torch."""
    from pagedbench.backends.sdpa import CUDA_KERNELS, SDPABackend
    from torch.nn.attention import SDPBackend

    assert SDPABackend.provider(device="cuda").endswith("SDPA memory-efficient kernel (cuDNN excluded)")
    assert SDPABackend.provider(device="cpu") == f"torch {torch.__version__}"
    assert SDPBackend.CUDNN_ATTENTION not in CUDA_KERNELS


@pytest.mark.parametrize("heads", [(8, 2), (8, 1), (4, 4)], ids=["gqa4", "mqa", "mha"])
@pytest.mark.parametrize(
    "variant",
    [AttentionVariant(), AttentionVariant(sliding_window=6), AttentionVariant(softcap=2.0, sinks=True)],
    ids=["plain", "window", "softcap-sinks"],
)
def test_sdpa_packs_gqa_heads_into_query_rows(heads, variant):
    """sdpa packs the G query heads of each KV head into query rows (K/V never repeated, the mask
    and the sinks repeated per row): every head must still see its own KV head, window and sink."""
    from pagedbench.backends.reference import ReferenceBackend
    from pagedbench.backends.sdpa import SDPABackend

    from pagedbench.bench.problems import random_attention_batch

    num_heads, num_kv_heads = heads
    batch = random_attention_batch([(30, 1), (9, 1), (0, 20), (5, 7)], num_heads, num_kv_heads, 16, 16)
    args = (num_heads, num_kv_heads, 16, 0.25, 16, torch.device("cpu"), torch.float32, variant)
    sinks = torch.randn(num_heads) if variant.sinks else None
    out = []
    for cls in (SDPABackend, ReferenceBackend):
        backend = cls(*args)
        out.append(backend.forward(batch.q, batch.k_cache, batch.v_cache, backend.plan(batch.metadata), sinks=sinks))
    torch.testing.assert_close(out[0], out[1])
    state = SDPABackend(*args).plan(batch.metadata)
    assert [g.mask.shape[2] for g in state] == [g.max_q * num_heads // num_kv_heads for g in state]
