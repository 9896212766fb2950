"""flex's decode kernel-option search, its disk cache and its flag, with a fake timing source (the
real one times CUDA kernels)."""

import pytest
import torch
from pagedbench.backends import flex as flex_module
from pagedbench.backends import flex_compile, flex_tune
from pagedbench.backends.flex import FlexBackend
from pagedbench.backends.flex_tune import DecodeOptionsCache, DecodeShape, describe, search, split_choices


def fake_seconds(best: dict, calls: list):
    """A bowl around `best`: each option's distance from it adds time; a stage count of 4 fails."""

    def seconds(options: dict) -> float:
        calls.append(dict(options))
        if options.get("num_stages") == 4:
            return float("inf")  # a candidate the template could not build
        return 1.0 + sum(abs(options.get(k, 0) - v) for k, v in best.items())

    return seconds


SHAPE = DecodeShape("Fake GPU", torch.__version__, 32, 8, 128, 16, "bfloat16", 16)


def test_split_candidates_fill_the_sms():
    assert split_choices(132, 64, 8) == [1]  # 512 programs already fill 132 SMs twice
    assert split_choices(132, 16, 8) == [1, 2, 4]
    assert split_choices(132, 1, 1)[-1] == flex_tune.MAX_SPLIT


def test_search_finds_the_fastest_options_and_the_cache_remembers_them(tmp_path):
    best, calls = {"SPLIT_KV": 4, "num_stages": 3, "num_warps": 4, "BLOCK_N": 16}, []
    cache = DecodeOptionsCache(tmp_path / "options.json")
    base = {"BLOCK_N": 16}
    found, spent = flex_tune.tuned_decode_options(SHAPE, base, 16, 132, fake_seconds(best, calls), cache)
    assert found == best and spent >= 0
    assert len(calls) <= len(split_choices(132, 16, 8)) + 4 + 3 + 1  # a coordinate search, not the product
    again = DecodeOptionsCache(tmp_path / "options.json")  # another process reads the file
    assert again.get(SHAPE) == best
    more: list = []
    assert flex_tune.tuned_decode_options(SHAPE, base, 16, 132, fake_seconds(best, more), again) == (best, 0.0)
    assert more == [], "a cached shape is never searched again"
    other = DecodeShape(*[*vars_of(SHAPE)[:-1], 64])  # another batch bucket: its own entry
    assert again.get(other) is None


def vars_of(shape: DecodeShape) -> list:
    return [getattr(shape, f) for f in shape.__slots__]


def test_search_skips_failing_candidates():
    found, count = search({}, [("num_stages", [1, 4]), ("num_warps", [2, 4])], fake_seconds({"num_stages": 1}, []))
    assert found["num_stages"] == 1 and count == 4


def test_describe_names_the_options_as_the_provider_does():
    options = {"num_stages": 3, "num_warps": 4, "SPLIT_KV": 4, "BLOCK_N": 64}
    assert describe(options) == "stages 3, warps 4, split 4, tile 64"
    assert describe(None) == "template defaults"


def test_the_flag_turns_the_search_off(monkeypatch):
    monkeypatch.setenv("PAGEDBENCH_FLEX_TUNE", "0")
    assert not flex_tune.tune_enabled()
    assert FlexBackend.provider(device="cuda").endswith("decode options untuned")
    monkeypatch.delenv("PAGEDBENCH_FLEX_TUNE")
    assert FlexBackend.provider(device="cuda").endswith("decode options tuned per batch")
    assert "tuned" not in FlexBackend.provider(device="cpu")


def test_a_decode_call_searches_once_per_batch_and_counts_it_as_compile_time(monkeypatch, tmp_path):
    """The backend's own path with the GPU faked: the first decode of a batch searches on its inputs,
    later ones (and other layers) reuse the options; the search time is compile time."""
    monkeypatch.setenv("PAGEDBENCH_CACHE_DIR", str(tmp_path))
    best, calls = {"SPLIT_KV": 2, "num_stages": 2, "num_warps": 8}, []
    seconds = fake_seconds(best, calls)
    monkeypatch.setattr(flex_tune, "current_gpu", lambda device: ("Fake GPU", 132))
    compiled = []  # each candidate's options, as the backend compiles it before timing it
    monkeypatch.setattr(flex_tune, "attend_compiling", lambda kind, args, limit: compiled.append(args[5]))
    monkeypatch.setattr(flex_tune, "cuda_seconds", lambda fn: seconds(compiled[-1]))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    backend = FlexBackend(32, 8, 128, 128**-0.5, 16, torch.device("cpu"), torch.float32)
    backend.tuned_decode, backend.kernel_options = True, {"decode": {"BLOCK_N": 16}, "prefill": None}
    call = flex_module.FlexCall("decode", 16, 1, None, None, None, None, None)
    first = backend._options(call, None, None, None, None)
    assert {k: first[k] for k in best} == best and backend.compile_seconds > 0
    searched = len(calls)
    assert backend._options(call, None, None, None, None) is first and len(calls) == searched
    assert "batch 16: stages 2, warps 8, split 2" in backend.decode_options_used
    assert (tmp_path / flex_tune.CACHE_FILE).exists()


@pytest.mark.parametrize("kind", ["prefill"])
def test_prefill_calls_keep_their_fixed_options(kind):
    backend = FlexBackend(8, 2, 64, 0.125, 16, torch.device("cpu"), torch.float32)
    backend.tuned_decode = True
    call = flex_module.FlexCall(kind, 1, 64, None, None, None, None, None)
    assert backend._options(call, None, None, None, None) is backend.kernel_options[kind]


def test_the_search_stops_at_its_budget_with_the_best_so_far():
    calls: list = []
    found, count = search({}, [("num_warps", [2, 4, 8])], fake_seconds({"num_warps": 2}, calls), budget_s=0.0)
    assert count == 1 and found == {"num_warps": 2}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 576])
def test_cuda_prefill_tiles_fit_hopper_shared_memory_at_every_head_width(head_dim, dtype):
    """MLA's 576-wide latent heads (padded to 1024) overflowed 64 x 64 tiles on the H200, and 32 x 32 in
    fp32 ("Required: 262144 Hardware limit: 232448", issue 57): the tiles chosen fit, as wide as they can."""
    options = flex_module.kernel_options(torch.device("cuda"), 128, 64, head_dim, dtype)
    prefill, width = options["prefill"], 1 << (head_dim - 1).bit_length()

    def need(m: int, n: int, stages: int) -> int:
        return (m + n * stages) * width * dtype.itemsize

    stages = prefill.get("num_stages", 3)
    assert need(prefill["BLOCK_M"], prefill["BLOCK_N"], stages) <= flex_compile.HOPPER_SHARED_MEMORY
    assert need(32, 32, 1) == 262144 or dtype != torch.float32 or head_dim != 576  # the H200's figure
    m, n, limit = prefill["BLOCK_M"], prefill["BLOCK_N"], flex_compile.HOPPER_SHARED_MEMORY
    if stages == 2:  # three did not fit
        assert need(m, n, 3) > limit
    if stages == 1:  # two stages of 64 x 64 did not fit, nor one stage of tiles twice as wide
        assert need(64, 64, 2) > limit and (m == 64 or need(2 * m, 2 * n, 1) > limit)
    if head_dim <= 128:
        assert (prefill["BLOCK_M"], prefill["BLOCK_N"], stages) == (64, 64, 3)  # unchanged for common heads
    if head_dim > flex_compile.WIDE_HEAD_DIM:
        assert options["decode"] == {"BLOCK_M": 16, "BLOCK_N": prefill["BLOCK_N"], "num_stages": 1}


@pytest.mark.parametrize("q_block,kv_block", [(16, 64), (128, 16), (16, 16)])
def test_narrow_query_blocks_still_get_tiles_that_fit(q_block, kv_block):
    """A sparse call's 16-row query blocks over pages of 64 (MLA-16 in fp32) once kept 16 x 64 tiles of
    1024 padded dims, 320 KiB: the larger tile is halved until the pair fits."""
    tiles = flex_compile.prefill_tiles(q_block, kv_block, 576, 4, flex_compile.HOPPER_SHARED_MEMORY)
    assert (tiles["BLOCK_M"] + tiles["BLOCK_N"]) * 1024 * 4 <= flex_compile.HOPPER_SHARED_MEMORY
    assert min(tiles["BLOCK_M"], tiles["BLOCK_N"]) >= 16 and q_block % tiles["BLOCK_M"] == 0
