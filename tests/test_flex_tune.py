"""flex's decode kernel-option search, its disk cache and its flag, with a fake timing source (the
real one times CUDA kernels), and a CPU search timed for real; what it searches on (never 1-page
rows, never inside a capture) and the key it caches under."""

import dataclasses
import functools
import json

import pytest
import torch
from pagedbench.backends import flex as flex_module
from pagedbench.backends import flex_compile, flex_tune
from pagedbench.backends.flex import FlexBackend
from pagedbench.backends.flex_tune import (
    DecodeOptionsCache,
    DecodeProblem,
    DecodeShape,
    describe,
    search,
    split_choices,
)

from pagedbench.bench.problems import random_attention_batch


def fake_seconds(best: dict, calls: list):
    """A bowl around `best`: each option's distance from it adds time; a stage count of 4 fails."""

    def seconds(options: dict) -> float:
        calls.append(dict(options))
        if options.get("num_stages") == 4:
            return float("inf")  # a candidate the template could not build
        return 1.0 + sum(abs(options.get(k, 0) - v) for k, v in best.items())

    return seconds


SHAPE = DecodeShape("Fake GPU", torch.__version__, "3.9.0", 32, 8, 128, 16, "bfloat16", 16, 1, 64, 4096)


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
    other = dataclasses.replace(SHAPE, batch=64)  # another batch bucket: its own entry
    assert again.get(other) is None


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
    monkeypatch.setattr(flex_tune, "attend_compiling", lambda kind, args, limit, fn: compiled.append(args[5]))
    monkeypatch.setattr(flex_tune, "cuda_seconds", lambda fn: seconds(compiled[-1]))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    backend = FlexBackend(32, 8, 128, 128**-0.5, 16, torch.device("cpu"), torch.float32)
    backend.tuned_decode, backend.kernel_options = True, {"decode": {"BLOCK_N": 16}, "prefill": None}
    call = flex_module.FlexCall("decode", 16, 1, None, None, None, None, None, context_pages=64)
    k = v = cache_view(8, 128, 2048 * 16)
    first = backend._options(call, k, v, None)
    assert {k: first[k] for k in best} == best and backend.compile_seconds > 0
    searched = len(calls)
    assert backend._options(call, k, v, None) is first and len(calls) == searched
    assert "batch 16: stages 2, warps 8, split 2" in backend.decode_options_used
    assert (tmp_path / flex_tune.CACHE_FILE).exists()


@pytest.mark.parametrize("kind", ["prefill"])
def test_prefill_calls_keep_their_fixed_options(kind):
    backend = FlexBackend(8, 2, 64, 0.125, 16, torch.device("cpu"), torch.float32)
    backend.tuned_decode = True
    call = flex_module.FlexCall(kind, 1, 64, None, None, None, None, None)
    assert backend._options(call, None, None, None) is backend.kernel_options[kind]


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


def cache_view(num_kv_heads: int, head_dim: int, slots: int) -> torch.Tensor:
    """A layer's K (or V) as flex reads the engine's cache, [1, H_kv, slots, D], with no memory behind it."""
    return torch.zeros(1, num_kv_heads, 1, head_dim).expand(1, num_kv_heads, slots, head_dim)


def tuning_backend(monkeypatch, tmp_path, problems: list) -> FlexBackend:
    """A CPU flex backend whose decodes are tuned as on CUDA, each search's representative BlockMask kept
    in `problems` (rows' listed KV blocks) and timed by a fake timer."""
    monkeypatch.setenv("PAGEDBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flex_tune, "current_gpu", lambda device: ("Fake GPU", 132))
    backend = FlexBackend(4, 2, 32, 32**-0.5, 16, torch.device("cpu"), torch.float32)
    backend.tuned_decode, backend.kernel_options = True, {"decode": {"BLOCK_N": 16}, "prefill": None}

    def measure(args_for, limit):
        mask = args_for({})[3]
        full = mask.full_kv_num_blocks if mask.full_kv_num_blocks is not None else 0
        problems.append((mask.kv_num_blocks + full).flatten().tolist())
        return fake_seconds({"num_warps": 4}, [])

    backend.decode_tuner.measure = measure
    return backend


def decode_options(backend: FlexBackend, meta) -> dict:
    """The decode call's options of the step `meta`, as forward() asks for them."""
    state = backend.plan(meta)
    k = v = cache_view(2, 32, meta.num_cache_blocks * 16)
    (call,) = [c for c in state.calls if c.kind == "decode"]
    return backend._options(call, k, v, None)


def test_no_search_runs_on_one_page_rows(monkeypatch, tmp_path):
    """A CUDA graph's warm-up decodes 1-page padding rows with max_seq_len the longest context it serves,
    and real steps may hold 1-page rows too: the search times every row at its context class instead,
    the graph's at the class of its max_seq_len, never fewer than MIN_CONTEXT_PAGES pages."""
    problems: list = []
    backend = tuning_backend(monkeypatch, tmp_path, problems)
    batch = random_attention_batch([(3, 1)] * 8, 4, 2, 32, 16, spare_blocks=4096)
    graph_warmup = dataclasses.replace(batch.metadata, max_seq_len=4096)
    decode_options(backend, graph_warmup)
    assert problems[-1] == [4096 // 16] * len(problems[-1])  # 256 pages a row, however short the rows
    decode_options(backend, batch.metadata)  # an eager step of 1-page rows: the least class
    assert problems[-1] == [flex_tune.MIN_CONTEXT_PAGES] * len(problems[-1])
    assert all(min(rows) > 1 for rows in problems)
    assert sorted(p.context_pages for p in backend.decode_tuner.chosen) == [flex_tune.MIN_CONTEXT_PAGES, 256]


def test_no_search_runs_inside_a_capture(monkeypatch, tmp_path):
    problems: list = []
    backend = tuning_backend(monkeypatch, tmp_path, problems)
    monkeypatch.setattr(flex_tune, "capturing", lambda: True)
    batch = random_attention_batch([(40, 1)] * 4, 4, 2, 32, 16, spare_blocks=64)
    assert decode_options(backend, batch.metadata) is backend.kernel_options["decode"]
    assert problems == [] and not backend.decode_tuner.chosen and not (tmp_path / flex_tune.CACHE_FILE).exists()


def test_the_cache_key_holds_the_context_class_and_old_keys_are_dropped(tmp_path):
    tuner = FlexBackend(32, 8, 128, 0.1, 16, torch.device("cpu"), torch.float32).decode_tuner
    classes = [flex_tune.context_class(tokens, 16) for tokens in (900, 1024, 1025, 10)]
    assert classes == [64, 64, 128, flex_tune.MIN_CONTEXT_PAGES]
    keys = [tuner.shape(DecodeProblem(16, 1, c, 300_000)).key for c in classes]
    assert keys[0] == keys[1] and keys[1] != keys[2] != keys[3]
    key = tuner.shape(DecodeProblem(16, 1, 64, 300_000)).key
    for part in ("cpu", torch.__version__, flex_tune.triton_version(), "|32|8|128|16|float32|16|1|64|524288"):
        assert part in key
    old = "Fake GPU|" + torch.__version__ + "|32|8|128|16|bfloat16|16"  # the key before context classes
    (tmp_path / "options.json").write_text(json.dumps({old: {"SPLIT_KV": 2}, SHAPE.key: {"SPLIT_KV": 4}}))
    cache = DecodeOptionsCache(tmp_path / "options.json")
    assert list(cache.entries) == [SHAPE.key] and cache.get(SHAPE) == {"SPLIT_KV": 4}


def test_a_search_compiles_its_candidates_outside_the_serving_function(monkeypatch, tmp_path):
    """Candidates compile in flex_compile.attend_candidate, whose graphs are dropped after the search: the
    serving attend_compiled never sees them."""
    compiled, forgotten = [], []
    monkeypatch.setattr(flex_tune, "attend_compiling", lambda kind, args, limit, fn: compiled.append(fn))
    monkeypatch.setattr(flex_tune, "cuda_seconds", lambda fn: 1.0)
    monkeypatch.setattr(flex_tune, "forget_candidates", lambda: forgotten.append(True))
    monkeypatch.setenv("PAGEDBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flex_tune, "current_gpu", lambda device: ("Fake GPU", 132))
    backend = FlexBackend(4, 2, 32, 32**-0.5, 16, torch.device("cpu"), torch.float32)
    backend.tuned_decode, backend.kernel_options = True, {"decode": {"BLOCK_N": 16}, "prefill": None}
    batch = random_attention_batch([(40, 1)] * 4, 4, 2, 32, 16, spare_blocks=64)
    decode_options(backend, batch.metadata)
    assert compiled and set(compiled) == {flex_compile.attend_candidate} and forgotten == [True]


def cpu_tuner() -> tuple:
    backend = FlexBackend(8, 2, 32, 32**-0.5, 16, torch.device("cpu"), torch.float32)
    operands = (cache_view(2, 32, 32 * 16), cache_view(2, 32, 32 * 16), backend.scale, None, None)
    return backend.decode_tuner, DecodeProblem(2, 1, 8, 32), operands


def test_two_searches_of_one_problem_agree():
    """With a deterministic timer two searches pick the same options, and neither is cached."""
    tuner, problem, operands = cpu_tuner()
    tuner.measure = lambda args_for, limit: fake_seconds({"SPLIT_KV": 1, "num_stages": 2, "num_warps": 8}, [])
    first, second = tuner.repeat_search(problem, {"BLOCK_N": 16}, operands)
    assert first.options == second.options and flex_tune.agree(first, second, tolerance=0.0)
    assert not tuner.chosen, "a repeated search is neither cached nor remembered"


@pytest.mark.slow  # wall-clock timing on shared cores: another process's burst can outlast a whole search
def test_two_searches_timed_on_this_cpu_agree_within_noise():
    """Timed for real (eager flex, whose CPU kernel takes no options: only noise tells candidates apart),
    two searches' best times agree within 2x (after a first one, which pays the process's warm-up); about 5 s."""
    tuner, problem, operands = cpu_tuner()
    tuner.measure = functools.partial(flex_tune.eager_cpu_timer, repeats=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no OpenMP thread spinning for a sibling another process holds up
    try:
        runs = tuner.repeat_search(problem, {"BLOCK_N": 16}, operands, runs=3)[1:]
    finally:
        torch.set_num_threads(threads)
    assert all(0 < run.seconds < 1 for run in runs)
    assert flex_tune.agree(*runs, tolerance=1.0), [run.seconds for run in runs]
