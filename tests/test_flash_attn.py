"""flash-attn backend. On CPU: every unavailable reason with the machine faked, the provider
strings and order, and the kernel calls of all four providers (FA3, FA4, FA2, torch) checked
through fakes that have the real signatures, assert each kernel's documented argument contract
and compute attention from the arguments they are given (the only way to run the call path
without a GPU). On CUDA: the real kernels against `reference`, on every page size the provider takes."""

import random
import sys
import types

import pytest
import torch
import torch.nn.attention.varlen
from pagedbench.backends import flash_attn, flash_attn_providers
from pagedbench.backends.base import AttentionVariant
from pagedbench.backends.flash_attn import FlashAttnBackend
from pagedbench.backends.registry import get_backend

from pagedbench.bench.problems import random_attention_batch
from tests.helpers import backend_id
from tests.test_backends import HEADS, ragged_batch_spec, run_backend

SCALE = 0.3  # not head_dim ** -0.5, so a dropped scale argument shows


def paged_attention(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    seq_lens,
    block_table,
    scale,
    causal,
    window_size=(-1, -1),
    softcap=0.0,
    sink=None,
):
    """What every kernel computes, from its own arguments: q [T, H, D]; sequence i's queries
    attend to its first seq_lens[i] keys, found through block_table [B, max_blocks], with the
    causal mask aligned to the bottom right (FlashAttention's convention), a query at p seeing
    keys from p - window_size[0] (-1: all), scores soft-capped, a sink logit per head [H] in the
    denominator. Returns [T, H, Dv]."""
    assert causal is True and isinstance(scale, float)
    left = -1 if window_size[0] is None else window_size[0]
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = q.new_empty(*q.shape[:-1], v_cache.shape[-1])  # [T, H, Dv]
    bounds = cu_seqlens_q.tolist()
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        pos = torch.arange(int(seq_lens[i]))
        pages = block_table[i, pos // block_size].long()
        k = k_cache[pages, pos % block_size].float().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v_cache[pages, pos % block_size].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = len(pos) - (end - start) + torch.arange(end - start)
        scores.masked_fill_(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        if left >= 0:
            scores.masked_fill_(pos[None, None, :] < q_pos[None, :, None] - left, float("-inf"))
        if sink is not None:
            scores = torch.cat([scores, sink.float()[:, None, None].expand(-1, end - start, 1)], dim=-1)
        probs = scores.softmax(-1)[..., : len(pos)]
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def check_index_tensors(*tensors):
    for t in tensors:
        assert t.dtype == torch.int32 and t.is_contiguous()


def check_max_lengths(cu_seqlens_q, seq_lens, max_q, max_k):
    assert max_q == int(cu_seqlens_q.diff().max()) and max_k == int(seq_lens.max())


def fake_fa2(calls):
    """`flash_attn` 2.8.3: the two entry points, with their real parameters."""

    def flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
    ):
        calls.append("flash_attn_varlen_func")
        check_index_tensors(cu_seqlens_q, cu_seqlens_k, block_table)
        seq_lens = cu_seqlens_k.diff()  # no seqused_k here: key lengths come from cu_seqlens_k
        check_max_lengths(cu_seqlens_q, seq_lens, max_seqlen_q, max_seqlen_k)
        return paged_attention(
            q, k, v, cu_seqlens_q, seq_lens, block_table, softmax_scale, causal, window_size, softcap
        )

    def flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k=None,
        v=None,
        rotary_cos=None,
        rotary_sin=None,
        cache_seqlens=None,
        cache_batch_idx=None,
        cache_leftpad=None,
        block_table=None,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        rotary_interleaved=True,
        alibi_slopes=None,
        num_splits=0,
        return_softmax_lse=False,
    ):
        calls.append("flash_attn_with_kvcache")
        assert (
            q.dim() == 4 and q.shape[1] == 1 and k is None and v is None
        )  # [B, 1, H, D]; the cache is written already
        check_index_tensors(cache_seqlens, block_table)
        cu_seqlens_q = torch.arange(q.shape[0] + 1, dtype=torch.int32)
        return paged_attention(
            q[:, 0],
            k_cache,
            v_cache,
            cu_seqlens_q,
            cache_seqlens,
            block_table,
            softmax_scale,
            causal,
            window_size,
            softcap,
        ).unsqueeze(1)

    module = types.ModuleType("flash_attn")
    module.__version__ = "2.8.3"
    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    return module


def fake_fa3(calls):
    """`flash_attn_interface` (hopper/): flash_attn_with_kvcache with page_table and varlen queries."""

    def flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k=None,
        v=None,
        qv=None,
        rotary_cos=None,
        rotary_sin=None,
        cache_seqlens=None,
        cache_batch_idx=None,
        cache_leftpad=None,
        page_table=None,
        cu_seqlens_q=None,
        cu_seqlens_k_new=None,
        max_seqlen_q=None,
        rotary_seqlens=None,
        q_descale=None,
        k_descale=None,
        v_descale=None,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        attention_chunk=0,
        softcap=0.0,
        rotary_interleaved=True,
        scheduler_metadata=None,
        num_splits=0,
        pack_gqa=None,
        sm_margin=0,
        return_softmax_lse=False,
    ):
        calls.append("flash_attn_with_kvcache")
        assert q.dim() == 3 and k is None and v is None  # [T, H, D] with cu_seqlens_q
        check_index_tensors(cu_seqlens_q, cache_seqlens, page_table)
        check_max_lengths(cu_seqlens_q, cache_seqlens, max_seqlen_q, int(cache_seqlens.max()))
        for t in (q, k_cache, v_cache, qv):
            assert t is None or t.stride(-1) == 1  # hopper/flash_api.cpp: contiguous last dims
        if qv is not None:  # scores q.k + qv.v (hopper/flash_api.cpp's checks on q_v)
            assert q.shape[-1] <= 64 and 256 <= v_cache.shape[-1] <= 512 and k_cache.shape[-1] == q.shape[-1]
            assert qv.shape == (*q.shape[:-1], v_cache.shape[-1]) and qv.dtype == q.dtype
            q, k_cache = torch.cat([qv, q], dim=-1), torch.cat([v_cache, k_cache], dim=-1)
        return paged_attention(
            q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, page_table, softmax_scale, causal, window_size, softcap
        )

    module = types.ModuleType("flash_attn_interface")
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    return module


def fake_fa4(calls, compile_cache=None):
    """`flash_attn.cute` (flash-attn-4 4.0.0b36): flash_attn_varlen_func with its real parameters,
    checking the paged contract FA4 documents and asserts: q [total_q, H, D]; k/v [num_pages,
    page_size, H_kv, D] of q's dtype; page_table int32 [B, max_pages], contiguous in its last dim,
    never combined with cu_seqlens_k; cu_seqlens_q [B+1] and seqused_k [B] int32 contiguous;
    rows past seqused_k in a sequence's last page finite (whole pages are loaded). Returns
    (out, lse). A new (dtype, head_dim, page_size, decode?) shape "JIT-compiles" into the cache."""

    def flash_attn_varlen_func(
        q,
        k,
        v,
        qv=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        min_seqlen_k=None,
        seqused_q=None,
        seqused_k=None,
        gather_kv_indices=None,
        page_table=None,
        softmax_scale=None,
        causal=False,
        window_size=(None, None),
        learnable_sink=None,
        softcap=0.0,
        num_splits=1,
        pack_gqa=None,
        deterministic=False,
        score_mod=None,
        score_mod_bwd=None,
        mask_mod=None,
        block_sparse_tensors=None,
        aux_tensors=None,
        aux_scalars=None,
        return_lse=False,
        scheduler_metadata=None,
        seqlen_k_per_split=None,
        disable_scheduler_metadata=False,
        gather_bwd_recompute_p=False,
        gather_bwd_token_chunk=None,
    ):
        calls.append("flash_attn_varlen_func")
        assert cu_seqlens_k is None, "page_table is not supported with cu_seqlens_k"
        total_q, num_heads, head_dim = q.shape
        num_pages, page_size, num_kv_heads, _ = k.shape
        assert v.shape == k.shape and q.dtype == k.dtype == v.dtype and num_heads % num_kv_heads == 0
        batch = cu_seqlens_q.shape[0] - 1
        assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1 and page_table.dim() == 2
        assert page_table.shape[0] == batch and seqused_k.shape == (batch,)
        check_index_tensors(cu_seqlens_q, seqused_k)
        assert int(cu_seqlens_q[-1]) == total_q and int(cu_seqlens_q[0]) == 0
        assert isinstance(max_seqlen_q, int) and max_seqlen_q >= int(cu_seqlens_q.diff().max())
        assert max_seqlen_k is None or max_seqlen_k >= int(seqused_k.max())
        assert int(seqused_k.max()) <= page_table.shape[1] * page_size
        assert 0 <= int(page_table.min()) and int(page_table.max()) < num_pages
        assert isinstance(num_splits, int) and num_splits >= 0
        for i, used in enumerate(seqused_k.tolist()):
            if used % page_size:  # the rest of the last page is loaded too
                last = int(page_table[i, used // page_size])
                assert (
                    torch.isfinite(k[last, used % page_size :]).all()
                    and torch.isfinite(v[last, used % page_size :]).all()
                )
        if compile_cache is not None:
            compile_cache.setdefault((q.dtype, head_dim, page_size, max_seqlen_q == 1), "compiled kernel")
        assert learnable_sink is None or (
            learnable_sink.dtype == torch.bfloat16 and learnable_sink.shape == (num_heads,)
        )
        out = paged_attention(
            q, k, v, cu_seqlens_q, seqused_k, page_table, softmax_scale, causal, window_size, softcap, learnable_sink
        )
        return out, torch.zeros(num_heads, total_q, dtype=torch.float32)

    module = types.ModuleType("flash_attn.cute")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    if compile_cache is not None:  # where flash_attn.cute.interface keeps its compiled forward kernels
        module.interface = types.SimpleNamespace(
            _flash_attn_fwd=types.SimpleNamespace(compile_cache=types.SimpleNamespace(cache=compile_cache))
        )
    return module


def fake_varlen_attn(calls):
    """torch 2.13's `varlen_attn`, same parameters; causal is window_size (-1, 0)."""

    def varlen_attn(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
        enable_gqa=False,
        seqused_k=None,
        block_table=None,
        num_splits=None,
    ):
        calls.append("varlen_attn")
        assert num_splits == 1  # split-KV is wrong on the paged varlen path (pytorch#194167)
        assert enable_gqa == (query.shape[1] != key.shape[2])
        check_index_tensors(cu_seq_q, seqused_k, block_table)
        check_max_lengths(cu_seq_q, seqused_k, max_q, max_k)
        causal = window_size[1] == 0
        return paged_attention(query, key, value, cu_seq_q, seqused_k, block_table, scale, causal, window_size)

    return varlen_attn


def varlen_attn_without_paging(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """The shape of varlen_attn before seqused_k/block_table (torch 2.10-era)."""
    raise AssertionError("never called")


def fake_cuda(monkeypatch, capability=(9, 0), torch_has_flash=True):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: torch_has_flash)


def install(monkeypatch, fa3=None, fa4=None, fa2=None, varlen=None):
    """Exactly these providers import (None: absent)."""
    monkeypatch.delenv(flash_attn_providers.PROVIDER_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fa4)
    monkeypatch.setitem(sys.modules, "flash_attn", fa2)
    if varlen is None:
        monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)
    else:
        monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", varlen)


def install_only(monkeypatch, kind, calls=None, **fake_kwargs):
    calls = [] if calls is None else calls
    fakes = {
        "fa3": lambda: dict(fa3=fake_fa3(calls)),
        "fa4": lambda: dict(fa4=fake_fa4(calls, **fake_kwargs)),
        "fa2": lambda: dict(fa2=fake_fa2(calls)),
        "torch": lambda: dict(varlen=fake_varlen_attn(calls)),
    }
    install(monkeypatch, **fakes[kind]())


def reason(device="cuda", dtype=torch.bfloat16, head_dim=128, block_size=256, **kwargs):
    return FlashAttnBackend.unavailable_reason(torch.device(device), dtype, head_dim, block_size, **kwargs)


def chosen(**settings):
    found, why_not = flash_attn_providers.select_provider(**settings)
    return found.kind if found else why_not


NOT_INSTALLED = (
    "fa3: flash_attn_interface not installed; "
    "fa4: flash_attn.cute not installed (pip install 'pagedbench[fa4]'); "
    "fa2: flash_attn not installed (pip install 'pagedbench[flash-attn]'); "
)


# --- unavailable_reason -------------------------------------------------------------------


def test_cpu_reason_names_every_provider(monkeypatch):
    install(monkeypatch, varlen=fake_varlen_attn([]))
    assert reason("cpu", torch.float32, 512, 16) == (
        f"no CUDA device (device is cpu); {NOT_INSTALLED}torch: torch {torch.__version__} varlen_attn importable"
    )
    install_only(monkeypatch, "fa4")
    assert "fa4: flash_attn.cute (FA4) " in reason("cpu") and reason("cpu").startswith("no CUDA device")


def test_cuda_requested_without_a_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert reason("cuda").startswith("no CUDA device (torch.cuda.is_available() is False); fa3: ")


def test_no_provider_names_everything_tried(monkeypatch):
    fake_cuda(monkeypatch)
    install(monkeypatch)
    assert reason() == (
        f"no FlashAttention provider runs these settings; {NOT_INSTALLED}"
        f"torch: torch {torch.__version__} has no torch.nn.attention.varlen"
    )


def test_torch_without_paged_varlen_is_no_provider(monkeypatch):
    fake_cuda(monkeypatch)
    install(monkeypatch, varlen=varlen_attn_without_paging)
    assert f"torch {torch.__version__}'s varlen_attn has no seqused_k, block_table, scale, window_size" in reason()


def test_fa3_without_page_table_falls_back(monkeypatch):
    old_fa3 = types.ModuleType("flash_attn_interface")
    old_fa3.flash_attn_with_kvcache = lambda q, k_cache, v_cache, cache_seqlens=None: None
    install(monkeypatch, fa3=old_fa3, fa4=fake_fa4([]), fa2=fake_fa2([]))
    assert chosen() == "fa4"
    assert flash_attn_providers.probe("fa3") == (
        "flash_attn_interface: flash_attn_with_kvcache has no page_table, cu_seqlens_q, max_seqlen_q"
    )


def test_fa2_without_paged_varlen_is_skipped(monkeypatch):
    old_fa2 = types.ModuleType("flash_attn")
    old_fa2.__version__ = "2.5.6"
    old_fa2.__file__ = "/site-packages/flash_attn/__init__.py"
    old_fa2.flash_attn_varlen_func = lambda q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: None
    old_fa2.flash_attn_with_kvcache = lambda q, k_cache, v_cache: None
    install(monkeypatch, fa2=old_fa2)
    assert "fa2: flash_attn 2.5.6: flash_attn_varlen_func has no block_table" in chosen()


def test_empty_flash_attn_namespace_package_is_not_fa2(monkeypatch):
    """FA4 installs flash_attn/cute/ with no flash_attn/__init__.py: `import flash_attn` succeeds, empty."""
    fake_cuda(monkeypatch)
    namespace = types.ModuleType("flash_attn")
    namespace.__path__ = []
    install(monkeypatch, fa2=namespace)
    assert "fa2: flash_attn is an empty namespace package (FA4's flash_attn/cute/ without FlashAttention-2)" in reason()
    install(monkeypatch, fa2=namespace, fa4=fake_fa4([]))
    assert reason(block_size=16) is None and chosen() == "fa4"


def test_a_provider_that_raises_anything_at_import_is_a_reason(monkeypatch, tmp_path):
    """A broken install (a missing CUDA library, say) raises OSError or RuntimeError, not ImportError."""
    (tmp_path / "flash_attn_interface.py").write_text(
        "raise OSError('libcudart.so.12: cannot open shared object file')\n"
    )
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("raise RuntimeError('no CUDA driver')\n")
    install(monkeypatch, varlen=fake_varlen_attn([]))
    for name in ("flash_attn_interface", "flash_attn.cute", "flash_attn"):
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    fake_cuda(monkeypatch)
    r = reason(block_size=16)  # torch's FA2 needs pages of 256: no provider runs this
    assert "fa3: import flash_attn_interface: OSError: libcudart.so.12: cannot open shared object file" in r
    assert "fa4: import flash_attn.cute: RuntimeError: no CUDA driver" in r
    assert "fa2: flash_attn is an empty namespace package" in r
    assert chosen(device="cuda", dtype=torch.bfloat16, head_dim=128, block_size=256) == "torch"


@pytest.mark.parametrize("kind", ["fa3", "fa4", "fa2", "torch"])
def test_supported_settings_have_no_reason(monkeypatch, kind):
    fake_cuda(monkeypatch)
    install_only(monkeypatch, kind)
    for dtype in (torch.float16, torch.bfloat16):
        for head_dim in (64, 128, 256):
            assert reason(dtype=dtype, head_dim=head_dim, block_size=512, num_heads=8, num_kv_heads=2) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype(monkeypatch, dtype):
    fake_cuda(monkeypatch)
    install_only(monkeypatch, "fa4")
    name = str(dtype).removeprefix("torch.")
    assert reason(dtype=dtype).startswith(f"dtype {name} unsupported: FlashAttention takes float16 or bfloat16; fa3: ")


@pytest.mark.parametrize("head_dim", [264, 100, 4])
def test_head_dim(monkeypatch, head_dim):
    fake_cuda(monkeypatch)
    install_only(monkeypatch, "fa3")
    assert "fa3: flash_attn_interface (FA3) " in reason(head_dim=head_dim)
    assert reason(head_dim=head_dim).endswith(
        f"head_dim {head_dim} unsupported: needs a multiple of 8 in 8..256; "
        f"fa4: flash_attn.cute not installed (pip install 'pagedbench[fa4]'); "
        f"fa2: flash_attn not installed (pip install 'pagedbench[flash-attn]'); "
        f"torch: torch {torch.__version__} has no torch.nn.attention.varlen"
    )


@pytest.mark.parametrize(
    "capability,head_dim,ok",
    [
        ((9, 0), 64, True),
        ((9, 0), 192, True),
        ((9, 0), 256, True),
        ((9, 0), 264, False),
        ((9, 0), 4, False),
        ((10, 0), 128, True),
        ((10, 0), 192, False),
        ((10, 0), 256, True),
        ((11, 0), 96, True),
    ],
)
def test_fa4_head_dims_follow_its_arch_rules(monkeypatch, capability, head_dim, ok):
    fake_cuda(monkeypatch, capability=capability)
    install_only(monkeypatch, "fa4")
    r = reason(head_dim=head_dim, block_size=16)
    assert (r is None) == ok, r
    if not ok:
        assert f"head_dim {head_dim} unsupported" in r


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (12, 0)])
def test_fa4_has_no_paged_kv_on_ampere_or_sm120(monkeypatch, capability):
    fake_cuda(monkeypatch, capability=capability)
    install(monkeypatch, fa4=fake_fa4([]), fa2=fake_fa2([]))
    major, minor = capability
    assert (
        f"fa4: flash_attn.cute (FA4) (version unknown): compute capability {major}.{minor}: FA4 has paged KV "
        f"only on 9.x (Hopper) and 10.x/11.x (Blackwell)"
    ) in reason(block_size=16)
    assert chosen(device="cuda", dtype=torch.bfloat16, head_dim=128, block_size=256) == "fa2"  # next in order


def test_compute_capability(monkeypatch):
    fake_cuda(monkeypatch, capability=(7, 5))
    install_only(monkeypatch, "fa2")
    assert (
        "fa2: flash_attn 2.8.3: compute capability 7.5 unsupported: FlashAttention needs 8.0 (Ampere) or newer"
        in reason()
    )


def test_torch_built_without_flash_kernels(monkeypatch):
    fake_cuda(monkeypatch, torch_has_flash=False)
    install_only(monkeypatch, "torch")
    assert f"torch {torch.__version__} was built without its FlashAttention kernels" in reason()
    install_only(monkeypatch, "fa2")  # the flash_attn package brings its own kernels
    assert reason() is None


@pytest.mark.parametrize("kind", ["fa2", "torch"])
@pytest.mark.parametrize("block_size", [16, 128, 255, 384])
def test_fa2_kernels_need_pages_of_256(monkeypatch, kind, block_size):
    fake_cuda(monkeypatch)
    install_only(monkeypatch, kind)
    r = reason(block_size=block_size)
    assert f"{kind}: {FlashAttnBackend.provider()}: block_size {block_size} is not a multiple of 256 " in r


@pytest.mark.parametrize("kind", ["fa3", "fa4"])
@pytest.mark.parametrize("block_size", [1, 16, 100, 256])
def test_fa3_and_fa4_take_any_block_size(monkeypatch, kind, block_size):
    fake_cuda(monkeypatch)
    install_only(monkeypatch, kind)
    assert reason(block_size=block_size) is None


def test_heads_must_group(monkeypatch):
    fake_cuda(monkeypatch)
    install_only(monkeypatch, "fa2")
    assert reason(num_heads=6, num_kv_heads=4).startswith("num_heads 6 is not a multiple of num_kv_heads 4; fa3: ")


# --- provider -----------------------------------------------------------------------------


def test_provider_prefers_fa3_then_fa4_then_fa2_then_torch(monkeypatch):
    versions = {"flash_attn_3": "3.0.0b1", "flash-attn-4": "4.0.0b36"}
    monkeypatch.setattr(flash_attn_providers.metadata, "version", lambda dist: versions[dist])
    install(monkeypatch, fa3=fake_fa3([]), fa4=fake_fa4([]), fa2=fake_fa2([]), varlen=fake_varlen_attn([]))
    assert FlashAttnBackend.provider() == "flash_attn_interface (FA3) 3.0.0b1"
    assert backend_id("flash-attn") == "flash-attn[FA3]"
    install(monkeypatch, fa4=fake_fa4([]), fa2=fake_fa2([]), varlen=fake_varlen_attn([]))
    assert FlashAttnBackend.provider() == "flash_attn.cute (FA4) 4.0.0b36"
    assert backend_id("flash-attn") == "flash-attn[FA4]"
    install(monkeypatch, fa2=fake_fa2([]), varlen=fake_varlen_attn([]))
    assert FlashAttnBackend.provider() == "flash_attn 2.8.3"
    assert backend_id("flash-attn") == "flash-attn"
    install(monkeypatch, varlen=fake_varlen_attn([]))
    assert FlashAttnBackend.provider() == f"torch {torch.__version__} varlen_attn"
    install(monkeypatch)
    assert FlashAttnBackend.provider() == "none"
    assert backend_id("sdpa") == "sdpa"


def test_provider_is_the_one_that_runs_these_settings(monkeypatch):
    """With FA4 and FA2 installed: FA4 on Hopper at any page size; FA2 on Ampere, where FA4 has no paged KV."""
    install(monkeypatch, fa4=fake_fa4([]), fa2=fake_fa2([]))
    settings = dict(device="cuda", dtype=torch.bfloat16, head_dim=128, block_size=256)
    fake_cuda(monkeypatch, capability=(9, 0))
    assert FlashAttnBackend.provider(**settings) == "flash_attn.cute (FA4) (version unknown)"
    fake_cuda(monkeypatch, capability=(8, 0))
    assert FlashAttnBackend.provider(**settings) == "flash_attn 2.8.3"
    assert FlashAttnBackend.provider(**{**settings, "device": "cpu"}) == "flash_attn.cute (FA4) (version unknown)"


def test_forced_provider(monkeypatch):
    fake_cuda(monkeypatch)
    install(monkeypatch, fa3=fake_fa3([]), fa4=fake_fa4([]), fa2=fake_fa2([]))
    monkeypatch.setenv(flash_attn_providers.PROVIDER_ENV, "fa2")
    assert chosen() == "fa2" and FlashAttnBackend.provider() == "flash_attn 2.8.3"
    assert reason(block_size=16) == (
        "no FlashAttention provider runs these settings; PAGEDBENCH_FLASH_PROVIDER forces "
        "fa2: flash_attn 2.8.3: block_size 16 is not a multiple of 256 (FlashAttention-2's "
        "paged kernels)"
    )
    monkeypatch.setenv(flash_attn_providers.PROVIDER_ENV, "FA4")
    assert chosen() == "fa4"
    monkeypatch.setenv(flash_attn_providers.PROVIDER_ENV, "fa5")
    assert reason() == "PAGEDBENCH_FLASH_PROVIDER='fa5' is not one of fa3, fa4, fa2, torch"
    assert FlashAttnBackend.provider() == "none"


def test_forced_provider_that_cannot_run_is_a_one_line_error(monkeypatch):
    from pagedbench.config import EngineConfig
    from pagedbench.engine.llm_engine import LLMEngine

    fake_cuda(monkeypatch)
    install(monkeypatch, fa2=fake_fa2([]))
    monkeypatch.setenv(flash_attn_providers.PROVIDER_ENV, "fa4")
    with pytest.raises(ValueError) as e:
        LLMEngine(EngineConfig(model="tiny-llama", backend="flash-attn", device="cuda", dtype="bf16"))
    assert str(e.value) == (
        "backend 'flash-attn' is unavailable here: no FlashAttention provider runs these settings; "
        "PAGEDBENCH_FLASH_PROVIDER forces fa4: flash_attn.cute not installed "
        "(pip install 'pagedbench[fa4]')"
    )


def test_fa3_version_unknown_without_distribution(monkeypatch):
    def no_dist(dist):
        raise flash_attn_providers.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(flash_attn_providers.metadata, "version", no_dist)
    install_only(monkeypatch, "fa3")
    assert FlashAttnBackend.provider() == "flash_attn_interface (FA3) (version unknown)"


def test_init_without_provider_raises(monkeypatch):
    install(monkeypatch)
    with pytest.raises(ValueError, match="flash-attn cannot run here: no CUDA device"):
        FlashAttnBackend(4, 4, 64, SCALE, 16, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("capability,splits", [((9, 0), 1), ((10, 0), 0), ((11, 0), 0)])
def test_fa4_splits_kv_only_on_blackwell(capability, splits):
    """FA4 asserts "SplitKV not supported on SM 9.0"; 0 asks for its own heuristic on Blackwell."""
    assert flash_attn.fa4_num_splits(capability) == splits


# --- dispatch through fakes ---------------------------------------------------------------

EXPECTED_CALL = {
    ("fa3", "decode"): "flash_attn_with_kvcache",
    ("fa3", "prefill"): "flash_attn_with_kvcache",
    ("fa3", "mixed"): "flash_attn_with_kvcache",
    ("fa4", "decode"): "flash_attn_varlen_func",
    ("fa4", "prefill"): "flash_attn_varlen_func",
    ("fa4", "mixed"): "flash_attn_varlen_func",
    ("fa2", "decode"): "flash_attn_with_kvcache",
    ("fa2", "prefill"): "flash_attn_varlen_func",
    ("fa2", "mixed"): "flash_attn_varlen_func",
    ("torch", "decode"): "varlen_attn",
    ("torch", "prefill"): "varlen_attn",
    ("torch", "mixed"): "varlen_attn",
}


def make_batch(phase, heads, block_size=16, seed=0):
    spec = ragged_batch_spec(phase, block_size, random.Random(f"{phase}-{heads}-{seed}"))
    num_heads, num_kv_heads = HEADS[heads]
    return random_attention_batch(spec, num_heads, num_kv_heads, 64, block_size, seed=seed), num_heads, num_kv_heads


def attend(name, batch, num_heads, num_kv_heads, block_size=16):
    backend = get_backend(name)(num_heads, num_kv_heads, 64, SCALE, block_size, torch.device("cpu"), torch.float32)
    state = backend.plan(batch.metadata)
    return backend, state, backend.forward(batch.q, batch.k_cache, batch.v_cache, state)


@pytest.mark.parametrize("heads", ["mha", "gqa", "mqa"])
@pytest.mark.parametrize("phase", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("kind", ["fa3", "fa4", "fa2", "torch"])
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


VARIANT_SUPPORT = {  # what each provider's real signature offers
    "fa3": {"window", "softcap"},
    "fa4": {"window", "softcap", "sinks"},
    "fa2": {"window", "softcap"},
    "torch": {"window"},
}


@pytest.mark.parametrize("feature", ["window", "softcap", "sinks"])
@pytest.mark.parametrize("kind", ["fa3", "fa4", "fa2", "torch"])
def test_variants_reach_the_kernel_or_say_why_not(monkeypatch, kind, feature):
    """A window becomes window_size=(window - 1, 0), soft-cap softcap=, sinks FA4's bf16
    learnable_sink; the kernel's answer equals the reference's. A provider whose signature lacks
    the keyword is passed over with that as the reason."""
    install_only(monkeypatch, kind)
    variant = {
        "window": AttentionVariant(sliding_window=9),
        "softcap": AttentionVariant(softcap=2.0),
        "sinks": AttentionVariant(sinks=True),
    }[feature]
    if feature not in VARIANT_SUPPORT[kind]:
        with monkeypatch.context() as m:
            fake_cuda(m)
            wanted = "attention sinks" if feature == "sinks" else feature
            assert f"takes no {wanted}" in reason(num_heads=8, num_kv_heads=2, **variant.settings())
        return
    batch, num_heads, num_kv_heads = make_batch("mixed", "gqa", seed=3)
    sinks = torch.randn(num_heads).to(torch.bfloat16).float() if variant.sinks else None  # bf16-exact for FA4
    outputs = []
    for name in ("flash-attn", "reference"):
        backend = get_backend(name)(num_heads, num_kv_heads, 64, SCALE, 16, torch.device("cpu"), torch.float32, variant)
        outputs.append(backend.forward(batch.q, batch.k_cache, batch.v_cache, backend.plan(batch.metadata), sinks))
    torch.testing.assert_close(*outputs, atol=1e-4, rtol=1e-4)


LATENT = AttentionVariant(value_dim=256)  # FA3's qv takes latent dims 256..512 beside <= 64 rope dims


@pytest.mark.parametrize("phase", ["decode", "prefill", "mixed"])
def test_fa3_runs_latent_attention_through_qv(monkeypatch, phase):
    """Absorbed MLA as vLLM's FLASH_ATTN_MLA calls FA3: q's rope dims against the pages' rope
    dims, qv (q's latent dims) against the latent, which is also the values; equal to reference."""
    calls = []
    install_only(monkeypatch, "fa3", calls)
    spec = ragged_batch_spec(phase, 16, random.Random(f"latent-{phase}"))
    head_dim, heads = 256 + 64, (8, 1)
    batch = random_attention_batch(spec, *heads, head_dim, 16, seed=5, value_dim=LATENT.value_dim)
    outputs = []
    for name in ("flash-attn", "reference"):
        backend = get_backend(name)(*heads, head_dim, SCALE, 16, torch.device("cpu"), torch.float32, LATENT)
        outputs.append(backend.forward(batch.q, batch.k_cache, batch.v_cache, backend.plan(batch.metadata)))
    assert calls == ["flash_attn_with_kvcache"] and outputs[0].shape == (len(batch.q), 8, 256)
    torch.testing.assert_close(*outputs, atol=1e-4, rtol=1e-4)


def test_latent_attention_is_fa3_on_hopper_only(monkeypatch):
    fake_cuda(monkeypatch)
    install(monkeypatch, fa3=fake_fa3([]), fa4=fake_fa4([]), fa2=fake_fa2([]), varlen=fake_varlen_attn([]))
    settings = dict(num_heads=16, num_kv_heads=1, value_dim=512)
    assert reason(head_dim=576, block_size=64, **settings) is None
    assert FlashAttnBackend.provider(
        device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=576, block_size=64, **settings
    ).endswith(", latent absorbed through qv")
    assert "latent attention 128 + 64: FA3's qv takes" in reason(head_dim=192, **settings | {"value_dim": 128})
    assert "not wired for FA3's qv path" in reason(head_dim=576, sliding_window=8, **settings)
    install(monkeypatch, fa4=fake_fa4([]), fa2=fake_fa2([]), varlen=fake_varlen_attn([]))  # no FA3
    why = reason(head_dim=576, block_size=256, **settings)
    for label in ("flash_attn.cute (FA4)", "flash_attn ", "varlen_attn"):
        assert label in why and "takes no qv (FA3's MLA path, Hopper)" in why

    def paged_without_qv(q, k_cache, v_cache, cache_seqlens=None, page_table=None, cu_seqlens_q=None, max_seqlen_q=0):
        return None

    old_fa3 = types.ModuleType("flash_attn_interface")  # an FA3 from before qv
    old_fa3.flash_attn_with_kvcache = paged_without_qv
    install(monkeypatch, fa3=old_fa3)
    assert "takes no qv" in reason(head_dim=576, **settings)
    install_only(monkeypatch, "fa3")
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
        assert "FA3's qv runs on Hopper only" in reason(head_dim=576, **settings)


def test_a_provider_without_qv_refuses_latent_attention_on_cpu_too(monkeypatch):
    install_only(monkeypatch, "fa4")
    with pytest.raises(ValueError, match="takes no qv"):
        FlashAttnBackend(8, 1, 320, SCALE, 16, torch.device("cpu"), torch.float32, LATENT)


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


@pytest.mark.parametrize("kind", ["fa4", "fa2"])
def test_plan_refills_static_buffers_in_place(monkeypatch, kind):
    """Each step's index tensors are views of the same storage (what a captured CUDA graph reads),
    grown only when a step is larger; a smaller step after a larger one still attends correctly."""
    install_only(monkeypatch, kind)
    big, num_heads, num_kv_heads = make_batch("mixed", "gqa", seed=1)
    backend = FlashAttnBackend(num_heads, num_kv_heads, 64, SCALE, 16, torch.device("cpu"), torch.float32)
    first = backend.plan(big.metadata)
    pointers = [t.data_ptr() for t in (first.cu_seqlens_q, first.seq_lens, first.block_table)]
    small, _, _ = make_batch("decode", "gqa", seed=2)
    assert small.metadata.num_seqs <= big.metadata.num_seqs
    assert small.metadata.block_table.shape[1] <= big.metadata.block_table.shape[1]
    second = backend.plan(small.metadata)
    assert [t.data_ptr() for t in (second.cu_seqlens_q, second.seq_lens, second.block_table)] == pointers
    assert second.block_table.is_contiguous() and second.block_table.shape[0] == small.metadata.num_seqs
    width = small.metadata.block_table.shape[1]
    assert torch.equal(second.block_table[:, :width], small.metadata.block_table)
    assert not second.block_table[:, width:].any()  # no stale pages of the larger step
    got = backend.forward(small.q, small.k_cache, small.v_cache, second)
    _, _, expected = attend("reference", small, num_heads, num_kv_heads)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_fa4_jit_compiles_are_announced_and_counted(monkeypatch, caplog):
    compile_cache = {}
    install_only(monkeypatch, "fa4", compile_cache=compile_cache)
    caplog.set_level("INFO", logger=flash_attn.logger.name)
    batch, num_heads, num_kv_heads = make_batch("decode", "gqa")
    backend, state, _ = attend("flash-attn", batch, num_heads, num_kv_heads)
    backend.forward(batch.q, batch.k_cache, batch.v_cache, state)  # same shape: no new compile
    messages = [r.getMessage() for r in caplog.records]
    assert len(compile_cache) == 1 and backend.compile_seconds > 0
    assert sum("JIT-compiles on first use" in m for m in messages) == 1
    assert sum("JIT-compiled a kernel in" in m for m in messages) == 1
    prefill, _, _ = make_batch("prefill", "gqa")
    state = backend.plan(prefill.metadata)
    backend.forward(prefill.q, prefill.k_cache, prefill.v_cache, state)
    assert len(compile_cache) == 2
    assert sum("JIT-compiled a kernel in" in r.getMessage() for r in caplog.records) == 2


def test_fakes_notice_wrong_arguments(monkeypatch):
    """The dispatch test can fail: a block table off by one row, or no causal mask, changes the answer."""
    install_only(monkeypatch, "fa2")
    batch, num_heads, num_kv_heads = make_batch("mixed", "mha")
    backend, state, good = attend("flash-attn", batch, num_heads, num_kv_heads)
    state.block_table = state.block_table.roll(1, dims=0).contiguous()
    bad = backend.forward(batch.q, batch.k_cache, batch.v_cache, state)
    assert not torch.allclose(bad, good, atol=1e-2)
    with pytest.raises(AssertionError):
        paged_attention(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            state.cu_seqlens_q,
            state.seq_lens,
            state.block_table,
            SCALE,
            causal=False,
        )


def test_fa4_fake_enforces_its_contract(monkeypatch):
    """The FA4 fake refuses what the real kernel refuses: int64 or strided page tables,
    cu_seqlens_k beside page_table, and a NaN row past seqused_k in a sequence's last page."""
    install_only(monkeypatch, "fa4")
    batch, num_heads, num_kv_heads = make_batch("decode", "gqa")
    backend, state, _ = attend("flash-attn", batch, num_heads, num_kv_heads)
    api = backend.impl.api
    args = dict(
        cu_seqlens_q=state.cu_seqlens_q, max_seqlen_q=1, seqused_k=state.seq_lens, causal=True, softmax_scale=SCALE
    )
    for bad in (
        dict(page_table=state.block_table.long()),
        dict(page_table=state.block_table.t().contiguous().t()),
        dict(page_table=state.block_table, cu_seqlens_k=state.cu_seqlens_k),
    ):
        if bad["page_table"].stride(-1) == 1 and bad["page_table"].dtype == torch.int32 and "cu_seqlens_k" not in bad:
            continue  # a 1-column table is contiguous either way
        with pytest.raises(AssertionError):
            api.flash_attn_varlen_func(batch.q, batch.k_cache, batch.v_cache, **args, **bad)
    i = next(i for i, n in enumerate(batch.metadata.seq_lens_cpu) if n % 16)
    n = batch.metadata.seq_lens_cpu[i]
    batch.v_cache[int(state.block_table[i, n // 16]), n % 16] = float("nan")
    with pytest.raises(AssertionError):
        api.flash_attn_varlen_func(batch.q, batch.k_cache, batch.v_cache, **args, page_table=state.block_table)


def test_model_runner_cache_starts_finite(tiny_models):
    """FA4 loads whole pages, so cache rows past a sequence's length must be finite: the cache starts zeroed."""
    from pagedbench import LLM

    llm = LLM(tiny_models["llama"][0], backend="sdpa", dtype="float32", device="cpu", num_blocks=8)
    assert not llm.engine.runner.kv_cache.any()


# --- the real kernels ---------------------------------------------------------------------

FP16_TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 2e-2}


def cuda_cases() -> list:
    """Page sizes each provider takes: FA3/FA4 any (16, 128, 256), FA2 and torch's 256 only."""
    params = []
    for block_size in (16, 128, 256):
        for dtype in (torch.float16, torch.bfloat16):
            why = reason(dtype=dtype, block_size=block_size, num_heads=8, num_kv_heads=2)
            marks = [pytest.mark.skip(reason=f"flash-attn on cuda, block_size {block_size}: {why}")] if why else []
            params.append(pytest.param(block_size, dtype, marks=marks, id=f"bs{block_size}-{str(dtype)[6:]}"))
    return params


@pytest.mark.parametrize("block_size,dtype", cuda_cases())
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("phase", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("heads", HEADS)
def test_kernels_match_reference_on_cuda(block_size, dtype, head_dim, phase, heads):
    num_heads, num_kv_heads = HEADS[heads]
    rng = random.Random(f"{phase}-{heads}-{head_dim}-{block_size}")
    for trial in range(2):
        spec = ragged_batch_spec(phase, block_size, rng)
        batch = random_attention_batch(spec, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda", seed=trial)
        args = (batch, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda")
        expected = run_backend("reference", *args)
        got = run_backend("flash-attn", *args)
        assert got.shape == expected.shape and got.dtype == dtype
        tol = FP16_TOLERANCE[dtype]
        torch.testing.assert_close(
            got.float(),
            expected.float(),
            atol=tol,
            rtol=tol,
            msg=lambda m, spec=spec: f"flash-attn ({FlashAttnBackend.provider()}) on {spec}: {m}",
        )


def test_fa4_gets_max_seqlen_k_only_where_its_signature_names_it():
    from pagedbench.backends.flash_attn_providers import accepts

    def narrow(q, k, v, cu_seqlens_q=None, max_seqlen_q=None, seqused_k=None, page_table=None):
        pass

    def wide(q, k, v, max_seqlen_k=None):
        pass

    assert not accepts(narrow, "max_seqlen_k") and accepts(wide, "max_seqlen_k")
    assert accepts(lambda *a, **kw: None, "max_seqlen_k")
