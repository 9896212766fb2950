"""The flashinfer backend on a machine without CUDA: its CSR page metadata (what plan() reads)
matches the block table exactly, and it says why it cannot run here. Its kernels run only on
CUDA: the shared matrix (tests/test_backends.py, `-k cuda`) checks them against `reference` there."""

import numpy as np
import pytest
import torch
from pagedbench.backends.flashinfer import FlashInferBackend, paged_kv_csr
from pagedbench.backends.registry import get_backend, list_backends

from pagedbench.bench.problems import place, random_problem


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_csr_pages_are_the_block_tables_pages_in_order(page_size):
    problem = random_problem([(0, 1), (63, 1), (64, 1), (5, 60), (130, 7)], 4, 2, 64, seed=1)
    meta = place(problem, page_size, layout_seed=4).metadata
    csr = paged_kv_csr(meta.seq_lens_cpu, page_size)
    kv_indices = meta.block_table[torch.from_numpy(csr.rows), torch.from_numpy(csr.cols)]
    for b, seq_len in enumerate(meta.seq_lens_cpu):
        pages = -(-seq_len // page_size)
        assert csr.kv_indptr[b + 1] - csr.kv_indptr[b] == pages
        own = kv_indices[csr.kv_indptr[b] : csr.kv_indptr[b + 1]]
        assert torch.equal(own, meta.block_table[b, :pages])
        assert 1 <= csr.last_page_len[b] <= page_size
        assert (pages - 1) * page_size + csr.last_page_len[b] == seq_len
    assert csr.kv_indptr.dtype == np.int32 and csr.last_page_len.dtype == np.int32


def test_registered_and_unavailable_without_cuda_with_the_reason():
    assert "flashinfer" in list_backends() and get_backend("flashinfer") is FlashInferBackend
    reason = FlashInferBackend.unavailable_reason(torch.device("cpu"), torch.bfloat16, 128, 16)
    assert reason.startswith("no CUDA device (device is cpu)")
    with pytest.raises(ValueError, match="flashinfer backend: no CUDA device"):
        FlashInferBackend(8, 2, 128, 0.1, 16, torch.device("cpu"), torch.bfloat16)
    assert FlashInferBackend.kv_cache_reason("int8").startswith("kv_cache_dtype int8: FlashInfer reads fp8 pages")
    assert FlashInferBackend.kv_cache_reason("fp8") is None
    assert "fp8 MLA path" in FlashInferBackend.kv_cache_reason("fp8", value_dim=512)
