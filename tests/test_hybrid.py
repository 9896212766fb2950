"""Hybrid models (Qwen3.5 and Qwen3-Next: gated DeltaNet layers beside gated attention, Qwen3-Next
with MoE layers): greedy tokens equal Hugging Face's through the engine, with chunked prefill,
preemption (recompute and swap) and forked samples, and every state slot comes back after a run."""

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pagedbench import LLM, SamplingParams
from pagedbench.bench.check_linear import delta_rule_oracle
from pagedbench.model.config import ModelConfig
from tests.conftest import hf_greedy

PROMPTS = [[5, 17, 33, 42, 8, 9, 100, 7], [3, 4, 5], list(range(10, 90)), list(range(200, 140, -1))]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SETTINGS = {
    "roomy": dict(num_blocks=64),
    # 16-token chunks: the long prompts' DeltaNet states continue from chunk to chunk
    "chunked": dict(num_blocks=64, max_num_batched_tokens=16, block_size=4),
    # 30 pages of 4 for four sequences that need 46 at full length: preempted, then recomputed (or
    # swapped out and back, the state staying in its slot)
    "recompute": dict(num_blocks=30, block_size=4, max_num_batched_tokens=32, max_model_len=96),
    "swap": dict(
        num_blocks=30,
        block_size=4,
        max_num_batched_tokens=32,
        max_model_len=96,
        preemption_mode="swap",
        swap_space=0.01,
    ),
}


@pytest.fixture(scope="module", params=["qwen3.5", "qwen3-next"])
def qwen35(hybrid_models, request):
    """(model directory, Hugging Face's greedy tokens for PROMPTS) of each tiny hybrid model."""
    path, hf = hybrid_models[request.param]
    return path, [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]


def generate(path, backend="reference", **settings):
    llm = LLM(path, backend=backend, device="cpu", dtype="float32", **settings)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_config_reads_the_hybrid_layout(qwen35):
    cfg = ModelConfig.from_dir(Path(qwen35[0]))
    assert cfg.linear.layers == (True, True, True, False) and cfg.linear.conv_dim == 2 * 32 + 64
    assert cfg.attn_output_gate and cfg.norm_offset and cfg.rotary_dim == 8  # a quarter of 32
    if cfg.architecture == "Qwen3NextForCausalLM":
        assert cfg.linear.projection == "grouped" and cfg.moe.layers == (True, False, True, True)
        assert cfg.moe.gated_shared_expert_size == 48 and cfg.moe.num_experts == 4


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_hf(qwen35, setting):
    path, want = qwen35
    llm, got = generate(path, **SETTINGS[setting])
    assert got == want
    bm = llm.engine.block_manager
    assert bm.state_slots.num_free == bm.num_state_slots == llm.engine.config.max_num_seqs  # every slot back


def test_tight_budgets_really_preempt(qwen35):
    path, want = qwen35
    for setting in ("recompute", "swap"):
        llm = LLM(path, backend="reference", device="cpu", dtype="float32", **SETTINGS[setting])
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert sum(o.metrics.num_preemptions for o in outs) > 0, setting
    # swapped out, a sequence's DeltaNet state left its device slot for a CPU one and came back
    assert llm.engine.stats.swap_outs > 0 and llm.engine.executor.kv_size.num_cpu_state_slots > 0


def test_swap_moves_the_state_to_a_cpu_slot_and_back():
    from pagedbench.engine.block_manager import BlockManager
    from pagedbench.engine.sequence import Sequence

    bm = BlockManager(8, 2, num_cpu_blocks=8, num_state_slots=2, num_cpu_state_slots=1)
    seq = Sequence("a", None, [1, 2, 3], SamplingParams())
    bm.allocate(seq, 3)
    device_slot = seq.state_slot
    assert bm.can_swap_out(seq)
    bm.swap_out(seq)  # its state goes to CPU slot 2 (after the two device slots); its device slot is free
    assert bm.take_state_copies() == [(device_slot, 2)] and seq.state_slot == 2 and bm.state_slots.num_free == 2
    other = Sequence("b", None, [4], SamplingParams())
    assert not bm.can_swap_out(other)  # (no pages, and the one CPU state slot is taken)
    bm.swap_in(seq)
    bm.allocate(seq, 3)
    assert bm.take_state_copies() == [(2, seq.state_slot)] and 0 <= seq.state_slot < 2
    bm.free(seq)
    assert bm.state_slots.num_free == 2 and list(bm.state_slots.cpu_free) == [2]


def test_state_moves_run_as_their_queue_says():
    """A fork's child swapped out in the next schedule takes its parent's state to its CPU slot (the
    queued copies collapse to each slot's final source); the copies read every source first."""
    from pagedbench.engine.block_manager import BlockManager
    from pagedbench.engine.sequence import Sequence
    from pagedbench.model.config import LinearAttention
    from pagedbench.worker.linear_state import LinearStateCache

    bm = BlockManager(8, 2, num_cpu_blocks=8, num_state_slots=3, num_cpu_state_slots=2)
    parent = Sequence("a", None, [1, 2, 3], SamplingParams())
    bm.allocate(parent, 3)
    child = parent.fork(1)
    bm.fork(parent, child)
    bm.swap_out(child)
    moves = bm.take_state_copies()  # (the copy into the child's freed device slot 1 may stay: harmless)
    assert child.state_slot == 3 and (parent.state_slot, 3) in moves and all(src != 1 for src, _ in moves)
    lin = LinearAttention(1, 1, 2, 2, 2, (True,))
    cache = LinearStateCache.allocate(
        SimpleNamespace(linear=lin, is_linear_layer=lambda i: True), [0], 3, "cpu", torch.float32, num_cpu_slots=2
    )
    for slot in range(3):
        cache.recurrent[0][slot] = slot + 1.0
    cache.copy([(0, 1), (1, 4), (4, 2)])  # sources read before any write: slot 2 gets CPU slot 4's old zeros
    assert cache.recurrent[0][:, 0, 0, 0].tolist() == [1.0, 1.0, 0.0]
    assert cache.host_recurrent[0][:, 0, 0, 0].tolist() == [0.0, 2.0]


@pytest.mark.parametrize("backend", ["sdpa", *(pytest.param(b, marks=pytest.mark.slow) for b in ("flex", "triton"))])
@pytest.mark.parametrize("setting", ["chunked", "recompute", "swap"])
def test_every_attention_backend_gives_the_tokens(qwen35, backend, setting):
    """Chunked prefill, and a tight KV budget preempting by recompute (resumed from snapshots) or swap
    (states to CPU slots and back), through each CPU attention backend: HF's tokens."""
    path, want = qwen35
    llm, got = generate(path, backend, **SETTINGS[setting])
    assert got == want
    if setting != "chunked":
        assert llm.engine.stats.preemptions > 0


@pytest.mark.slow
# (sdpa: the test below; flex at TP 2: test_tensor_parallel, its compiles in each rank cost ~10 s here)
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_tensor_parallel_2_through_each_attention_backend(hybrid_models, backend):
    """TP 2 on the tiny Qwen3.5 through the other CPU attention backends: HF's tokens."""
    path, hf = hybrid_models["qwen3.5"]
    llm = LLM(path, backend=backend, device="cpu", dtype="float32", tensor_parallel_size=2, **SETTINGS["chunked"])
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module", params=["qwen3.5", "qwen3-next"])
def hybrid(hybrid_models, request):
    """(model directory, Hugging Face's model) of each tiny hybrid model."""
    return hybrid_models[request.param]


def test_prefix_caching_resumes_from_state_snapshots(hybrid):
    """A shared 45-token prefix, pages of 4, snapshots at the last multiple of 12 each step reaches:
    a warm-up request (a 46-token prompt in one chunk) snapshots 36. A batch of three: the first
    matches pages to 44 and resumes at 36, snapshotting its junction at 44; the other two wait that
    step and resume at 44, as does the next batch. Tokens equal Hugging Face's and prefix caching
    off; most prompt tokens hit; every slot comes back."""
    path, hf = hybrid
    prefix = [(7 * i + 3) % 240 + 5 for i in range(45)]
    warm, *batches = [
        [prefix + [100 + 9 * j + t for t in range(1 + j % 5)] for j in range(k, k + 3)] for k in (0, 3, 6)
    ]
    settings = dict(block_size=4, num_blocks=128, mamba_block_size=12, max_num_seqs=4)
    runs = {}
    for caching in (True, False):
        llm = LLM(path, backend="sdpa", device="cpu", dtype="float32", enable_prefix_caching=caching, **settings)
        outs = [
            llm.generate([{"prompt_token_ids": p} for p in group], GREEDY, use_tqdm=False)
            for group in (warm[:1], *batches)
        ]
        runs[caching] = llm, outs
    llm, outs = runs[True]
    assert [[o.outputs[0].token_ids for o in g] for g in outs] == [
        [o.outputs[0].token_ids for o in g] for g in runs[False][1]
    ]
    assert [o.num_cached_tokens for o in outs[1]] == [36, 44, 44] and [o.num_cached_tokens for o in outs[2]] == [44] * 3
    assert outs[2][0].outputs[0].token_ids == hf_greedy(hf, batches[1][0], MAX_TOKENS)
    bm = llm.engine.block_manager
    assert bm.prefix_cache.hits >= 0.5 * bm.prefix_cache.queries and bm.snapshots.restored == 6
    assert bm.state_slots.num_free == bm.num_state_slots  # every running slot back


@pytest.mark.slow
def test_tensor_parallel_2_splits_the_deltanet_heads(qwen35):
    """TP 2: each rank holds one of the two key heads with its two value heads (their q/k/v rows and
    conv channels, z/b/a, A_log/dt_bias; out_proj row-parallel) and those heads' states. Under
    recompute preemption with prefix caching (restores from snapshots on every rank), and for a
    forked request: Hugging Face's tokens, and every slot back on rank 0."""
    path, want = qwen35
    llm = LLM(path, backend="sdpa", device="cpu", dtype="float32", tensor_parallel_size=2, **SETTINGS["recompute"])
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert sum(o.metrics.num_preemptions for o in outs) > 0
        pair = llm.generate(
            [{"prompt_token_ids": PROMPTS[2]}],
            SamplingParams(temperature=0, max_tokens=8, n=2, ignore_eos=True),
            use_tqdm=False,
        )
        assert [c.token_ids for c in pair[0].outputs] == [want[2][:8]] * 2
        recurrent = llm.engine.runner.local.linear_states.recurrent[0]
        assert recurrent.shape[1] == 2  # this rank's two value heads of four
        bm = llm.engine.block_manager
        assert bm.state_slots.num_free == bm.num_state_slots
    finally:
        llm.shutdown()


def test_forked_samples_continue_their_parents_state(qwen35):
    """n=3 seeded samples fork after the prompt: each equals the same seed run alone."""
    path, _ = qwen35
    llm = LLM(path, backend="reference", device="cpu", dtype="float32", num_blocks=64)
    prompt = {"prompt_token_ids": PROMPTS[2]}
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, n=3, seed=7)
    forked = sorted(c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2)
    pair = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs
    assert pair[0].token_ids == pair[1].token_ids == qwen35[1][2][:8]  # greedy forks agree with HF
    assert len(forked) == 3 and llm.engine.block_manager.state_slots.num_free == llm.engine.config.max_num_seqs


def test_what_hybrid_models_refuse_or_turn_off(qwen35, caplog):
    path, _ = qwen35
    with pytest.raises(ValueError, match="one pipeline stage"):
        LLM(path, device="cpu", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="roll its DeltaNet state back"):
        LLM(path, device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with caplog.at_level(logging.WARNING):
        llm = LLM(path, device="cpu", num_blocks=32, num_state_snapshots=0)
    assert not llm.engine.config.enable_prefix_caching and "prefix caching off" in caplog.text
    assert llm.engine.cuda_graphs.startswith("off")
    caches = llm.engine.runner.kv_caches  # pages for the attention layer only: the DeltaNet layers keep states
    assert caches[:3] == [None, None, None] and caches[3] is not None
    assert sorted(llm.engine.runner.linear_states.recurrent) == [0, 1, 2]
    assert torch.equal(
        llm.engine.runner.linear_states.recurrent[0], torch.zeros_like(llm.engine.runner.linear_states.recurrent[0])
    )


def test_default_max_num_seqs_runs_as_many_sequences_as_half_the_budget_holds_states(qwen35, caplog):
    """At the default max_num_seqs, the DeltaNet state slots take at most half the CPU KV budget
    (fewer sequences, with a note); an explicit max_num_seqs the budget cannot hold is an error."""
    from pagedbench.worker.linear_state import state_bytes_per_sequence

    path, want = qwen35
    per_slot = state_bytes_per_sequence(ModelConfig.from_dir(Path(path)), torch.float32)
    budget = 21 * per_slot  # 10 slots in half of it
    with caplog.at_level(logging.WARNING, logger="pagedbench"):
        llm, got = generate(path, cpu_kv_cache_bytes=budget)
    assert got == want and llm.engine.config.max_num_seqs == llm.engine.block_manager.num_state_slots == 10
    assert "hybrid model: max_num_seqs 256 -> 10: 10 DeltaNet state slots of " in caplog.text
    assert "fit half the " in caplog.text and "left to the KV pages and prefix-cache snapshots" in caplog.text
    llm = LLM(path, device="cpu", dtype="float32", cpu_kv_cache_bytes=budget, max_num_seqs=15)  # explicit, fits
    assert llm.engine.config.max_num_seqs == llm.engine.block_manager.num_state_slots == 15
    with pytest.raises(ValueError, match=r"^max_num_seqs 30 needs 30 DeltaNet state slots of .*\(20 would fit\)"):
        LLM(path, device="cpu", dtype="float32", cpu_kv_cache_bytes=budget, max_num_seqs=30)


@pytest.mark.slow
def test_the_qwen35_preset_starts_at_defaults_on_a_cpu(caplog):
    """Qwen3.5-0.8B's 19.3 MiB states: 26 fit half the 1 GiB CPU budget (256 would need 4.8 GiB)."""
    with caplog.at_level(logging.WARNING, logger="pagedbench"):
        llm = LLM("qwen3.5-0.8b", device="cpu")
    note = "hybrid model: max_num_seqs 256 -> 26: 26 DeltaNet state slots of 19.3 MiB fit half the 1 GiB KV budget"
    assert note in caplog.text and llm.engine.config.max_num_seqs == 26
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_a_hybrids_setting_errors_come_before_its_cache_is_sized(no_fla):
    """Refused before the model is built or its cache sized, each in its own words."""
    with pytest.raises(ValueError, match=r"^mamba_block_size 7 must be a multiple of block_size 16$"):
        LLM("qwen3.5-0.8b", device="cpu", mamba_block_size=7)
    with pytest.raises(ValueError, match=r"^linear_attention_kernel fla: fla not installed \(pip install"):
        LLM("qwen3.5-0.8b", device="cpu", linear_attention_kernel="fla")


def test_kv_calc_counts_the_state_each_sequence_holds(qwen35):
    from pagedbench.bench.kv_calc import kv_table
    from pagedbench.model.loader import resolve_model_config
    from pagedbench.worker.linear_state import state_bytes_per_sequence

    cfg = resolve_model_config("qwen3.5-0.8b")[0]
    state = state_bytes_per_sequence(cfg, torch.bfloat16)
    # 18 DeltaNet layers x (conv window 3 x 6144 channels in bf16 + 16 x 128 x 128 fp32)
    assert state == 18 * (3 * 6144 * 2 + 16 * 128 * 128 * 4)
    row = kv_table(cfg, torch.bfloat16, 8 << 30, [16], [4096]).iloc[0]
    per_seq_kv = row["blocks per seq"] * row["MiB per block"] * 2**20
    assert row["concurrent seqs"] == (8 << 30) // (per_seq_kv + state) < row["blocks"] // row["blocks per seq"]


@pytest.mark.slow
def test_compare_reports_the_deltanet_share_and_the_hf_peer(qwen35, tmp_path):
    """compare on the tiny hybrid with the HF peer (generate: continuous batching refuses linear
    layers): the peer's tokens, and the DeltaNet layers' share of the forward beside attention's."""
    import pandas as pd

    from pagedbench.entrypoints.cli.main import main

    args = ["compare", "--model", qwen35[0], "--scenario", "synthetic", "--scale", "0.125", "--repeats", "1"]
    assert main([*args, "--backends", "reference,sdpa", "--peer", "hf", "--out", str(tmp_path)]) == 0
    df = pd.read_csv(tmp_path / "compare-synthetic.csv")
    engine, hf = df[df["backend"] != "hf"], df[df["backend"] == "hf"].iloc[0]
    assert (engine["identical_token_share"] == 1).all() and "generate" in hf["provider"]
    # HF's own attention over random weights can flip a near-tie the engine's backends agree on
    # (test_greedy_matches_hf holds every token on chosen prompts); most tokens must still agree.
    assert hf["identical_token_share"] >= 0.9
    assert (engine["linear_attention_share"] > 0).all() and (engine["attention_share"] > 0).all()
    assert engine["enable_prefix_caching"].all()  # resumed from DeltaNet state snapshots
    assert (engine["state_snapshot_bytes"] > 0).all() and (engine["mamba_block_size"] % engine["block_size"] == 0).all()


@pytest.mark.parametrize("projection", ["split", "grouped"])
def test_deltanet_layer_matches_a_float64_oracle_across_chunks_and_ragged_batches(projection):
    """Three sequences of different lengths, fed as the engine does: ragged flat batches, the long
    ones over several chunks (continuing their slots' states), decodes of one token; each output
    row equals the float64 token-by-token oracle of its whole sequence."""
    from pagedbench.model.config import LinearAttention
    from pagedbench.model.hybrid import GatedDeltaNet
    from pagedbench.model.layers import AttentionContext
    from pagedbench.worker.linear_state import LinearStateCache, LinearStep

    lin = LinearAttention(2, 4, 8, 8, 4, (True,), projection)
    cfg = SimpleNamespace(linear=lin, hidden_size=32, rms_norm_eps=1e-6, is_linear_layer=lambda i: True)
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg, 0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    lengths = [37, 5, 70]
    xs = [torch.randn(n, 32) for n in lengths]
    cache = LinearStateCache.allocate(cfg, [0], 4, "cpu", torch.float32)
    slots = [2, 0, 3]
    done = [0, 0, 0]
    got = [[] for _ in lengths]
    for chunk in (16, 16, 1, 3, 1, 40):  # steps: up to `chunk` new tokens per unfinished sequence
        rows = [i for i in range(3) if done[i] < lengths[i]]
        take = [min(chunk, lengths[i] - done[i]) for i in rows]
        x = torch.cat([xs[i][done[i] : done[i] + n] for i, n in zip(rows, take)])
        qsl = [0]
        for n in take:
            qsl.append(qsl[-1] + n)
        step = LinearStep(cache, [slots[i] for i in rows], qsl, [done[i] for i in rows])
        ctx = AttentionContext([], [], None, [], linear=step)
        with torch.no_grad():
            out = layer(x, ctx)
        for j, i in enumerate(rows):
            got[i].append(out[qsl[j] : qsl[j + 1]])
            done[i] += take[j]
    assert done == lengths
    for i, x in enumerate(xs):
        want = delta_rule_oracle(layer, x)
        torch.testing.assert_close(torch.cat(got[i]).double(), want, atol=2e-5, rtol=2e-5)
