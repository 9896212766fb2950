"""flash-attn backend. On CPU: every unavailable reason with the machine faked, the provider
strings, and the kernel calls checked through fakes that have the real signatures and compute
attention from the arguments they are given (the only way to run the call path without a GPU).
On CUDA: the real kernels against `reference`, on pages of 256 tokens."""
import random
import sys
import types

import pytest
import torch
import torch.nn.attention.varlen

from pagedbench.attention_batch import random_attention_batch
from pagedbench.backends import flash_attn
from pagedbench.backends.flash_attn import FlashAttnBackend
from pagedbench.backends.registry import get_backend
from tests.helpers import backend_id
from tests.test_backends import HEADS, ragged_batch_spec, run_backend

SCALE = 0.3  # not head_dim ** -0.5, so a dropped scale argument shows


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, causal):
    """What every kernel computes, from its own arguments: q [T, H, D]; sequence i's queries
    attend to its first seq_lens[i] keys, found through block_table [B, max_blocks], with the
    causal mask aligned to the bottom right (FlashAttention's convention). Returns [T, H, D]."""
    assert causal is True and isinstance(scale, float)
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        pos = torch.arange(int(seq_lens[i]))
        pages = block_table[i, pos // block_size].long()
        k = k_cache[pages, pos % block_size].float().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v_cache[pages, pos % block_size].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        q_pos = len(pos) - (end - start) + torch.arange(end - start)
        scores.masked_fill_(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def check_index_tensors(*tensors):
    for t in tensors:
        assert t.dtype == torch.int32 and t.is_contiguous()


def check_max_lengths(cu_seqlens_q, seq_lens, max_q, max_k):
    assert max_q == int(cu_seqlens_q.diff().max()) and max_k == int(seq_lens.max())


def fake_fa2(calls):
    """`flash_attn` 2.8.3: the two entry points, with their real parameters."""
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        calls.append("flash_attn_varlen_func")
        check_index_tensors(cu_seqlens_q, cu_seqlens_k, block_table)
        seq_lens = cu_seqlens_k.diff()  # no seqused_k here: key lengths come from cu_seqlens_k
        check_max_lengths(cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k)
        return paged_attention(q, k, v, cu_seqlens_q, seq_lens, block_table, softmax_scale, causal)

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
        calls.append("flash_attn_with_kvcache")
        assert q.dim() == 4 and q.shape[1] == 1 and k is None and v is None  # [B, 1, H, D]; the cache is written already
        check_index_tensors(cache_seqlens, block_table)
        cu_seqlens_q = torch.arange(q.shape[0] + 1, dtype=torch.int32)
        return paged_attention(q[:, 0], k_cache, v_cache, cu_seqlens_q, cache_seqlens, block_table,
                               softmax_scale, causal).unsqueeze(1)

    module = types.ModuleType("flash_attn")
    module.__version__ = "2.8.3"
    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    return module


def fake_fa3(calls):
    """`flash_attn_interface` (hopper/): flash_attn_with_kvcache with page_table and varlen queries."""
    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                                cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                                q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                                window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                                scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                                return_softmax_lse=False):
        calls.append("flash_attn_with_kvcache")
        assert q.dim() == 3 and k is None and v is None  # [T, H, D] with cu_seqlens_q
        check_index_tensors(cu_seqlens_q, cache_seqlens, page_table)
        check_max_lengths(cu_seqlens_q, cache_seqlens, max_seqlen_q, int(cache_seqlens.max()))
        return paged_attention(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, page_table, softmax_scale, causal)

    module = types.ModuleType("flash_attn_interface")
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    return module


def fake_varlen_attn(calls):
    """torch 2.13's `varlen_attn`, same parameters; causal is window_size (-1, 0)."""
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        calls.append("varlen_attn")
        assert num_splits == 1  # split-KV is wrong on the paged varlen path (pytorch#194167)
        assert enable_gqa == (query.shape[1] != key.shape[2])
        check_index_tensors(cu_seq_q, seqused_k, block_table)
        check_max_lengths(cu_seq_q, seqused_k, max_q, max_k)
        return paged_attention(query, key, value, cu_seq_q, seqused_k, block_table, scale, window_size == (-1, 0))
    return varlen_attn


def varlen_attn_without_paging(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                               return_aux=None):
    """The shape of varlen_attn before seqused_k/block_table (torch 2.10-era)."""
    raise AssertionError("never called")


def fake_cuda(monkeypatch, capability=(9, 0), torch_has_flash=True):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: torch_has_flash)


def install(monkeypatch, fa3=None, fa2=None, varlen=None):
    """Exactly these providers import (None: absent)."""
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3)
    monkeypatch.setitem(sys.modules, "flash_attn", fa2)
    if varlen is None:
        monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)
    else:
        monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", varlen)


def install_only(monkeypatch, kind, calls=None):
    calls = [] if calls is None else calls
    fakes = {"fa3": dict(fa3=fake_fa3(calls)), "fa2": dict(fa2=fake_fa2(calls)),
             "torch": dict(varlen=fake_varlen_attn(calls))}
    install(monkeypatch, **fakes[kind])


def reason(device="cuda", dtype=torch.bfloat16, head_dim=128, block_size=256, **kwargs):
    return FlashAttnBackend.unavailable_reason(torch.device(device), dtype, head_dim, block_size, **kwargs)


# --- unavailable_reason -------------------------------------------------------------------

def test_cpu_is_refused_first(monkeypatch):
    assert reason("cpu", torch.float32, 512, 16) == "no CUDA device (device is cpu)"
    install_only(monkeypatch, "fa2")
    assert reason("cpu").startswith("no CUDA device")


def test_cuda_requested_without_a_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert reason("cuda") == "no CUDA device (torch.cuda.is_available() is False)"


def test_no_provider_names_everything_tried(monkeypatch):
    fake_cuda(monkeypatch)
    install(monkeypatch)
    r = reason()
    assert r.startswith("no FlashAttention provider importable; tried ")
    assert "flash_attn_interface (FA3)" in r and "flash_attn:" in r and "has no torch.nn.attention.varlen" in r


def test_torch_without_paged_varlen_is_no_provider(monkeypatch):
    fake_cuda(monkeypatch)
    install(monkeypatch, varlen=varlen_attn_without_paging)
    assert f"torch {torch.__version__}'s varlen_attn has no seqused_k, block_table, scale, window_size" in reason()


def test_fa3_without_page_table_falls_back_to_fa2(monkeypatch):
    old_fa3 = types.ModuleType("flash_attn_interface")
    old_fa3.flash_attn_with_kvcache = lambda q, k_cache, v_cache, cache_seqlens=None: None
    install(monkeypatch, fa3=old_fa3, fa2=fake_fa2([]))
    provider, why_not = flash_attn.find_provider()
    assert provider.kind == "fa2"
    assert why_not == ["flash_attn_interface (FA3): flash_attn_with_kvcache has no page_table, cu_seqlens_q, "
                       "max_seqlen_q"]


def test_fa2_without_paged_varlen_is_skipped(monkeypatch):
    old_fa2 = types.ModuleType("flash_attn")
    old_fa2.__version__ = "2.5.6"
    old_fa2.flash_attn_varlen_func = lambda q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: None
    install(monkeypatch, fa2=old_fa2)
    provider, why_not = flash_attn.find_provider()
    assert provider is None and "flash_attn 2.5.6: flash_attn_varlen_func has no block_table" in why_not


@pytest.mark.parametrize("kind", ["fa3", "fa2", "torch"])
def test_supported_settings_have_no_reason(monkeypatch, kind):
    fake_cuda(monkeypatch)
    install_only(monkeypatch, kind)
    for dtype in (torch.float16, torch.bfloat16):
        for head_dim in (64, 128, 256):
            assert reason(dtype=dtype, head_dim=head_dim, block_size=512, num_heads=8, num_kv_heads=2) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype(monkeypatch, dtype):
    fake_cuda(monkeypatch)
    install_only(monkeypatch, "fa2")
    name = str(dtype).removeprefix("torch.")
    assert reason(dtype=dtype) == f"dtype {name} unsupported: FlashAttention takes float16 or bfloat16"


@pytest.mark.parametrize("head_dim", [264, 100, 4])
def test_head_dim(monkeypatch, head_dim):
    fake_cuda(monkeypatch)
    install_only(monkeypatch, "fa3")
    assert reason(head_dim=head_dim).startswith(f"head_dim {head_dim} unsupported: FlashAttention needs a multiple of 8")


def test_compute_capability(monkeypatch):
    fake_cuda(monkeypatch, capability=(7, 5))
    install_only(monkeypatch, "fa2")
    assert reason() == "compute capability 7.5 unsupported: FlashAttention needs 8.0 (Ampere) or newer"


def test_torch_built_without_flash_kernels(monkeypatch):
    fake_cuda(monkeypatch, torch_has_flash=False)
    install_only(monkeypatch, "torch")
    assert reason() == f"torch {torch.__version__} was built without its FlashAttention kernels"
    install_only(monkeypatch, "fa2")  # the flash_attn package brings its own kernels
    assert reason() is None


@pytest.mark.parametrize("kind", ["fa2", "torch"])
@pytest.mark.parametrize("block_size", [16, 128, 255, 384])
def test_fa2_kernels_need_pages_of_256(monkeypatch, kind, block_size):
    fake_cuda(monkeypatch)
    install_only(monkeypatch, kind)
    r = reason(block_size=block_size)
    assert r.startswith(f"block_size {block_size} is not a multiple of 256, as the paged FlashAttention-2 kernels of ")
    assert FlashAttnBackend.provider() in r


@pytest.mark.parametrize("block_size", [1, 16, 100, 256])
def test_fa3_takes_any_block_size(monkeypatch, block_size):
    fake_cuda(monkeypatch)
    install_only(monkeypatch, "fa3")
    assert reason(block_size=block_size) is None


def test_heads_must_group(monkeypatch):
    fake_cuda(monkeypatch)
    install_only(monkeypatch, "fa2")
    assert reason(num_heads=6, num_kv_heads=4) == "num_heads 6 is not a multiple of num_kv_heads 4"


# --- provider -----------------------------------------------------------------------------

def test_provider_prefers_fa3_then_fa2_then_torch(monkeypatch):
    monkeypatch.setattr(flash_attn.metadata, "version", lambda dist: {"flash_attn_3": "3.0.0b1"}[dist])
    install(monkeypatch, fa3=fake_fa3([]), fa2=fake_fa2([]), varlen=fake_varlen_attn([]))
    assert FlashAttnBackend.provider() == "flash_attn_interface (FA3) 3.0.0b1"
    assert backend_id("flash-attn") == "flash-attn[flash_attn_interface-FA3-3.0.0b1]"
    install(monkeypatch, fa2=fake_fa2([]), varlen=fake_varlen_attn([]))
    assert FlashAttnBackend.provider() == "flash_attn 2.8.3"
    assert backend_id("flash-attn") == "flash-attn[flash_attn-2.8.3]"
    install(monkeypatch, varlen=fake_varlen_attn([]))
    assert FlashAttnBackend.provider() == f"torch {torch.__version__} varlen_attn"
    install(monkeypatch)
    assert FlashAttnBackend.provider() == "none"
    assert backend_id("sdpa") == "sdpa"


def test_fa3_version_unknown_without_distribution(monkeypatch):
    def no_dist(dist):
        raise flash_attn.metadata.PackageNotFoundError(dist)
    monkeypatch.setattr(flash_attn.metadata, "version", no_dist)
    install_only(monkeypatch, "fa3")
    assert FlashAttnBackend.provider() == "flash_attn_interface (FA3) (version unknown)"


def test_init_without_provider_raises(monkeypatch):
    install(monkeypatch)
    with pytest.raises(RuntimeError, match="no FlashAttention provider importable"):
        FlashAttnBackend(4, 4, 64, SCALE, 16, torch.device("cpu"), torch.float32)


# --- dispatch through fakes ---------------------------------------------------------------

EXPECTED_CALL = {
    ("fa3", "decode"): "flash_attn_with_kvcache", ("fa3", "prefill"): "flash_attn_with_kvcache",
    ("fa3", "mixed"): "flash_attn_with_kvcache",
    ("fa2", "decode"): "flash_attn_with_kvcache", ("fa2", "prefill"): "flash_attn_varlen_func",
    ("fa2", "mixed"): "flash_attn_varlen_func",
    ("torch", "decode"): "varlen_attn", ("torch", "prefill"): "varlen_attn", ("torch", "mixed"): "varlen_attn",
}


def make_batch(phase, heads, block_size=16, seed=0):
    spec = ragged_batch_spec(phase, block_size, random.Random(f"{phase}-{heads}-{seed}"))
    num_heads, num_kv_heads = HEADS[heads]
    return random_attention_batch(spec, num_heads, num_kv_heads, 64, block_size, seed=seed), num_heads, num_kv_heads


def attend(name, batch, num_heads, num_kv_heads, block_size=16):
    backend = get_backend(name)(num_heads, num_kv_heads, 64, SCALE, block_size, torch.device("cpu"), torch.float32)
    state = backend.prepare(batch.metadata)
    return backend, state, backend.forward(batch.q, batch.k_cache, batch.v_cache, state)


@pytest.mark.parametrize("heads", ["mha", "gqa", "mqa"])
@pytest.mark.parametrize("phase", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("kind", ["fa3", "fa2", "torch"])
def test_dispatch_passes_the_right_arguments(monkeypatch, kind, phase, heads):
    calls = []
    install_only(monkeypatch, kind, calls)
    for seed in range(2):
        batch, num_heads, num_kv_heads = make_batch(phase, heads, seed=seed)
        backend, state, got = attend("flash-attn", batch, num_heads, num_kv_heads)
        _, _, expected = attend("reference", batch, num_heads, num_kv_heads)
        assert backend.impl.kind == kind and state.decode_only == (phase == "decode")
        assert calls == [EXPECTED_CALL[kind, phase]]
        assert got.shape == batch.q.shape and got.dtype == batch.q.dtype
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        calls.clear()


def test_state_is_built_once_and_reused_by_every_layer(monkeypatch):
    calls = []
    install_only(monkeypatch, "fa2", calls)
    batch, num_heads, num_kv_heads = make_batch("mixed", "gqa")
    backend, state, first = attend("flash-attn", batch, num_heads, num_kv_heads)
    meta = batch.metadata
    assert state.cu_seqlens_q.tolist() == meta.query_start_loc_cpu
    assert state.seq_lens.tolist() == meta.seq_lens_cpu
    assert state.cu_seqlens_k.tolist() == [0, *torch.tensor(meta.seq_lens_cpu).cumsum(0).tolist()]
    assert (state.max_query_len, state.max_seq_len) == (meta.max_query_len, meta.max_seq_len)
    second = backend.forward(batch.q, batch.k_cache, batch.v_cache, state)
    torch.testing.assert_close(second, first, atol=0, rtol=0)


def test_fakes_notice_wrong_arguments(monkeypatch):
    """The dispatch test can fail: a block table off by one row, or no causal mask, changes the answer."""
    install_only(monkeypatch, "fa2")
    batch, num_heads, num_kv_heads = make_batch("mixed", "mha")
    backend, state, good = attend("flash-attn", batch, num_heads, num_kv_heads)
    state.block_table = state.block_table.roll(1, dims=0).contiguous()
    bad = backend.forward(batch.q, batch.k_cache, batch.v_cache, state)
    assert not torch.allclose(bad, good, atol=1e-2)
    with pytest.raises(AssertionError):
        paged_attention(batch.q, batch.k_cache, batch.v_cache, state.cu_seqlens_q, state.seq_lens,
                        state.block_table, SCALE, causal=False)


# --- the real kernels ---------------------------------------------------------------------

CUDA_REASON = reason()
FP16_TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 2e-2}


@pytest.mark.skipif(CUDA_REASON is not None, reason=f"flash-attn on cuda, block_size 256: {CUDA_REASON}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("phase", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("heads", HEADS)
def test_kernels_match_reference_on_cuda(dtype, head_dim, phase, heads):
    """test_backends uses pages of 16 and 128 tokens, which FA2's paged kernels refuse; 256 here."""
    num_heads, num_kv_heads = HEADS[heads]
    rng = random.Random(f"{phase}-{heads}-{head_dim}")
    for trial in range(2):
        spec = ragged_batch_spec(phase, 256, rng)
        batch = random_attention_batch(spec, num_heads, num_kv_heads, head_dim, 256, dtype, "cuda", seed=trial)
        args = (batch, num_heads, num_kv_heads, head_dim, 256, dtype, "cuda")
        expected = run_backend("reference", *args)
        got = run_backend("flash-attn", *args)
        assert got.shape == expected.shape and got.dtype == dtype
        tol = FP16_TOLERANCE[dtype]
        torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol,
                                   msg=lambda m: f"flash-attn ({FlashAttnBackend.provider()}) on {spec}: {m}")
