"""DeepSeek-V3.2's sparse attention (DSA): a tiny random DeepseekV32ForCausalLM, whose index_topk (8) is
far below its contexts, gives greedy tokens identical to Hugging Face's in fp32 for every backend that
reads selected slots (the others say why), under chunked prefill, preemption and prefix caching; the
indexer's selection equals a brute-force one over fragmented pages; the index keys count in a page."""

import random
from pathlib import Path

import pytest
import torch
import transformers
from pagedbench.backends.base import AttentionVariant
from pagedbench.backends.registry import get_backend, list_backends, probe

from pagedbench import LLM, SamplingParams
from pagedbench.model.config import ModelConfig
from pagedbench.model.sparse_index import SparseStep, sequence_slots
from pagedbench.worker.model_runner import kv_bytes_per_block
from tests.conftest import VOCAB, build_hf_model, hf_greedy
from tests.helpers import DEVICES, assert_swap_and_tp2_keep_the_tokens, backend_id

TOPK = 8
SPARSE = dict(
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    first_k_dense_replace=1,  # layer 0 dense, layer 1 DeepSeek's MoE
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_group=1,
    topk_group=1,
    index_topk=TOPK,
    index_head_dim=16,
    index_n_heads=16,  # a tie at 0 (every head ReLU-ed away) needs all 16 negative: top-k ties stay out
    # no padding row: a generated pad token's zero embedding would score every key 0, and which of a
    # tie's tokens top-k keeps is the sort's choice
    pad_token_id=None,
)
MODELS = {"deepseek-v3.2": ("DeepseekV32Config", SPARSE)}
PROMPT_LENS = [1, 5, 9, 17, 30, 41]
MAX_NEW = 10
SETUPS = {
    "roomy": dict(block_size=16),
    "pressure": dict(block_size=4, num_blocks=24, max_model_len=64, max_num_batched_tokens=16),
    "prefix-cache": dict(block_size=4, enable_prefix_caching=True),
    # each rank runs the whole indexer on its replicated index pages: the same picks on every rank
    "tp2": dict(block_size=4, tensor_parallel_size=2),
}


@pytest.fixture(scope="module")
def sparse_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsa")
    return str(root / "deepseek-v3.2"), build_hf_model("deepseek-v3.2", root / "deepseek-v3.2", MODELS)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    shared = [rng.randrange(3, VOCAB) for _ in range(12)]  # a shared 12-token prefix for the prefix cache
    return [(shared if n > 12 else []) + [rng.randrange(3, VOCAB) for _ in range(n - (12 if n > 12 else 0))]
            for n in PROMPT_LENS]  # fmt: skip


def sparse_params():
    """Every backend on every device, skipped with its reason where it cannot read selected slots."""
    params = []
    variant = AttentionVariant(value_dim=32, topk=TOPK)
    for device in DEVICES:
        for name in list_backends():
            _, reason = probe(get_backend(name), torch.device(device), torch.float32, 40, 16, num_heads=4,
                              num_kv_heads=1, **variant.settings())  # fmt: skip
            marks = [pytest.mark.skip(reason=f"{name} on {device}: {reason}")] if reason else []
            if device == "cpu" and name in ("flex", "triton"):  # compiled flex, Triton's interpreter: full tier
                marks.append(pytest.mark.slow)
            params.append(pytest.param(name, device, id=f"{backend_id(name)}-{device}", marks=marks))
    return params


@pytest.mark.parametrize("setup", [pytest.param(s, marks=pytest.mark.slow) if s == "tp2" else s for s in SETUPS])
@pytest.mark.parametrize("backend,device", sparse_params())
def test_greedy_matches_hf(sparse_model, prompts, backend, device, setup):
    path, hf = sparse_model
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    llm = LLM(path, backend=backend, device=device, dtype="float32", **SETUPS[setup])
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == expected
    if setup == "pressure":
        assert llm.engine.stats.preemptions > 0
    if setup == "prefix-cache":
        assert sum(o.num_cached_tokens for o in outs) > 0


def test_the_selection_matters(sparse_model, prompts):
    """The same weights attending densely (index_topk above every context) give other tokens, so
    the equality above holds only if the selection is the indexer's."""
    path, hf = sparse_model
    dense = transformers.AutoModelForCausalLM.from_pretrained(path, index_topk=4096).eval()
    long = [p for p in prompts if len(p) > 2 * TOPK]
    assert [hf_greedy(dense, p, MAX_NEW) for p in long] != [hf_greedy(hf, p, MAX_NEW) for p in long]


def brute_force_scores(q, k_by_pos, weights, scale):
    """One query's index score for every past position, transformers' formula in float64."""
    return weights.double() @ torch.relu((q.double() @ k_by_pos.double().T) * scale)  # [L]


def test_the_selection_is_the_top_k_of_the_causal_past_over_fragmented_pages():
    """SparseStep.select on a ragged batch (three decodes, two prefills, one of them a later chunk)
    whose sequences own shuffled pages: each query's slots are exactly the top-k positions of its
    past under transformers' scores (float64 brute force), mapped through its block table."""
    torch.manual_seed(0)
    block, heads, dim, topk = 4, 3, 8, 5
    seq_lens, q_lens = [9, 3, 14, 11, 20], [1, 1, 1, 6, 7]
    num_blocks = 40
    owned = torch.randperm(num_blocks).tolist()
    tables, at = [], 0
    for n in seq_lens:
        need = -(-n // block)
        tables.append(owned[at : at + need] + [0] * (8 - need))
        at += need
    block_table = torch.tensor(tables, dtype=torch.int32)
    positions, slot_mapping, qsl = [], [], [0]
    for b, (n, q) in enumerate(zip(seq_lens, q_lens)):
        for p in range(n - q, n):
            positions.append(p)
            slot_mapping.append(tables[b][p // block] * block + p % block)
        qsl.append(qsl[-1] + q)
    cache = torch.randn(num_blocks, block, dim)  # earlier steps' keys; this step's are written by select
    meta = SimpleMeta(block_table, torch.tensor(seq_lens), torch.tensor(slot_mapping), torch.tensor(positions),
                      qsl, seq_lens, block)  # fmt: skip
    step = SparseStep([(cache, None)], meta.slot_mapping, sequence_slots(meta), meta.positions, qsl, 3, topk, dim**-0.5)
    q, k, w = torch.randn(qsl[-1], heads, dim), torch.randn(qsl[-1], dim), torch.randn(qsl[-1], heads)
    selected = step.select(0, q, k, w)
    flat = cache.view(-1, dim)
    for b, n in enumerate(seq_lens):
        slots_by_pos = torch.tensor([tables[b][p // block] * block + p % block for p in range(n)])
        for t in range(qsl[b], qsl[b + 1]):
            p = positions[t]
            scores = brute_force_scores(q[t], flat[slots_by_pos[: p + 1]], w[t], dim**-0.5)
            got = selected[t][selected[t] >= 0].tolist()
            position = {slot.item(): i for i, slot in enumerate(slots_by_pos[: p + 1])}
            assert len(set(got)) == len(got) == min(topk, p + 1) and set(got) <= set(position), (b, t)
            kept = torch.zeros(p + 1, dtype=torch.bool)
            kept[[position[slot] for slot in got]] = True
            if not kept.all():  # a top-k: nothing left out scores above anything kept (ties either way)
                assert scores[~kept].max() <= scores[kept].min() + 1e-9, (b, t)


class SimpleMeta:
    """The AttentionMetadata fields SparseStep reads."""

    def __init__(self, block_table, seq_lens, slot_mapping, positions, qsl, seq_lens_cpu, block_size):
        self.block_table, self.seq_lens, self.slot_mapping = block_table, seq_lens, slot_mapping
        self.positions = positions
        self.query_start_loc_cpu, self.seq_lens_cpu, self.block_size = qsl, seq_lens_cpu, block_size


def test_index_keys_live_in_the_latent_pages_and_count_in_their_bytes(sparse_model):
    path, _ = sparse_model
    cfg = ModelConfig.from_dir(Path(path))
    assert (cfg.indexer.n_heads, cfg.indexer.head_dim, cfg.indexer.topk) == (16, 16, TOPK)
    latent = cfg.num_layers * 16 * cfg.mla.latent_dim * 4
    assert kv_bytes_per_block(cfg, 16, torch.float32) == latent + cfg.num_layers * 16 * 16 * 4
    llm = LLM(path, backend="sdpa", device="cpu", dtype="float32", num_blocks=20, block_size=16)
    runner = llm.engine.runner
    keys, scales = runner.index_caches[0]
    assert keys.shape == (21, 16, 16) and scales is None
    assert any(t.data_ptr() == keys.data_ptr() for t in runner.paged)  # copied and swapped
    settings = dict(backend="sdpa", device="cpu", dtype="float32", num_blocks=20, block_size=16)
    fp8 = LLM(path, index_cache_dtype="fp8", **settings)
    keys, scales = fp8.engine.runner.index_caches[0]
    assert keys.dtype == torch.float8_e4m3fn and scales.shape == (21, 16)
    assert {keys.data_ptr(), scales.data_ptr()} <= {t.data_ptr() for t in fp8.engine.runner.paged}
    fp8_keys = cfg.num_layers * 16 * (16 + 4)  # a byte per dim and an fp32 scale per token
    assert kv_bytes_per_block(cfg, 16, torch.float32, index_cache_dtype="fp8") == latent + fp8_keys


def test_backends_say_whether_they_read_selected_slots():
    """reference and sdpa gather each query's selected slots, triton's latent kernel reads them; every other
    backend names why not."""
    for name in list_backends():
        cls = get_backend(name)
        reason = cls.sparse_reason(topk=TOPK)
        if name in ("reference", "sdpa", "triton", "flex"):
            assert reason is None
        else:
            assert reason.startswith(f"top-{TOPK} sparse attention") and cls.sparse_selection_reason in reason


def test_flex_lists_only_the_selected_blocks_and_keeps_only_the_selected_slots():
    """The sparse BlockMask of two query blocks: each lists the distinct KV blocks its rows picked,
    and the mask_mod keeps a row's own picks (not its block-mates'); the tile efficiency is the
    picks over the listed blocks' slots."""
    from pagedbench.backends.flex_sparse import selected_share, sparse_block_mask

    selected = torch.full((20, 3), -1, dtype=torch.long)
    selected[0] = torch.tensor([5, 40, 41])  # blocks 0 and 2 of 16-slot blocks
    selected[1] = torch.tensor([70, -1, -1])  # block 4
    selected[19] = torch.tensor([17, 18, 200])  # query block 1: blocks 1 and 12
    mask, words, padded = sparse_block_mask(selected, 256, 16, 16)
    assert padded == 32 and mask.kv_num_blocks[0, 0].tolist() == [3, 2]
    assert mask.kv_indices[0, 0, 0, :3].tolist() == [0, 2, 4] and mask.kv_indices[0, 0, 1, :2].tolist() == [1, 12]
    keep = mask.mask_mod
    q, kv = torch.arange(32)[:, None], torch.arange(256)[None, :]
    kept = keep(0, 0, q, kv)
    assert kept[0].nonzero().flatten().tolist() == [5, 40, 41] and kept[1].nonzero().flatten().tolist() == [70]
    assert kept[19].nonzero().flatten().tolist() == [17, 18, 200] and not kept[2:19].any()
    # picks 3 + 1 + 3 = 7; listed: block row 0 has 16 rows x 3 blocks, row 1 has 4 real rows x 2 blocks
    assert selected_share(selected, mask, 16) == 7 / ((16 * 3 + 4 * 2) * 16)
    # two query heads per KV head packed as rows 2t, 2t + 1: both rows of token 19 keep its picks
    mask, _, _ = sparse_block_mask(selected, 256, 8, 16, rows_per_token=2)
    assert mask.BLOCK_SIZE == (16, 16) and mask.kv_num_blocks[0, 0].tolist() == [3, 0, 2]
    kept = mask.mask_mod(0, 0, torch.arange(48)[:, None], kv)
    assert kept[38].nonzero().flatten().tolist() == kept[39].nonzero().flatten().tolist() == [17, 18, 200]


def test_flex_gathered_mask_lists_the_top_k_not_the_pages():
    """The gathered call's BlockMask: token t's rows over its own gathered keys [t * K', (t + 1) * K'),
    ceil(picks / 64) blocks each, full but the last, which the mask_mod cuts at the pick count;
    MLA-128's 128 rows in two query blocks of 64. Several tokens to a block (4 rows each): all partial."""
    from pagedbench.backends.flex_sparse import GatheredMasks, gathered_share

    masks = GatheredMasks(128, 64, 64, torch.device("cpu"), full_blocks=True)
    counts = torch.tensor([2048, 100, 0], dtype=torch.int32)  # the last a padding token
    mask = masks.block_mask(counts, 2048)
    assert mask.BLOCK_SIZE == (64, 64) and mask.full_kv_num_blocks[0, 0].tolist() == [32, 32, 1, 1, 0, 0]
    assert mask.kv_num_blocks[0, 0].tolist() == [0, 0, 1, 1, 0, 0]
    assert mask.full_kv_indices[0, 0, 2, :1].tolist() == [32] and mask.kv_indices[0, 0, 2, :1].tolist() == [33]
    kept = mask.mask_mod(0, 0, torch.arange(3 * 128)[:, None], torch.arange(3 * 2048)[None, :])
    assert kept[0].nonzero().flatten().tolist() == list(range(2048))
    assert kept[200].nonzero().flatten().tolist() == list(range(2048, 2148)) and not kept[300].any()
    assert gathered_share(counts, 64) == (2048 + 100) / (2048 + 128)
    small = GatheredMasks(4, 16, 16, torch.device("cpu"), full_blocks=True)
    mask = small.block_mask(torch.tensor([16, 5, 0, 0], dtype=torch.int32), 32)  # 4 tokens of 4 rows: one block
    assert mask.full_kv_num_blocks is None and mask.kv_num_blocks[0, 0].tolist() == [2]
    assert mask.kv_indices[0, 0, 0, :2].tolist() == [0, 2]  # token 0's first block, token 1's first (32 / 16)


@pytest.mark.parametrize("path", ["gather", "pages"])
def test_flex_sparse_paths_equal_the_reference(path, monkeypatch):
    """Both ways flex reads the picks (eager here; compiled in `check`'s sparse cases) give the reference's
    output on a ragged batch over fragmented pages, with a head group that is not a power of two; the
    rule picks the page BlockMask only where every sequence fits the top-k, over 8 query tokens or more."""
    from pagedbench.backends.flex import FlexBackend
    from pagedbench.backends.reference import ReferenceBackend

    from pagedbench.bench.problems import random_attention_batch

    cpu, variant = torch.device("cpu"), AttentionVariant(value_dim=32, topk=TOPK)
    batch = random_attention_batch([(3, 1), (40, 1), (20, 6), (2, 5)], 6, 1, 40, 4, torch.float32, cpu,
                                   value_dim=32, topk=TOPK)  # fmt: skip
    ref = ReferenceBackend(6, 1, 40, 0.2, 4, cpu, torch.float32, variant)
    expected = ref.forward(batch.q, batch.k_cache, batch.v_cache, ref.plan(batch.metadata), selected=batch.selected)
    flex = FlexBackend(6, 1, 40, 0.2, 4, cpu, torch.float32, variant, compile=False)
    assert flex.plan(batch.metadata).sparse_path == "gather"  # sequences past the top-k
    monkeypatch.setenv("PAGEDBENCH_FLEX_SPARSE", path)
    state = flex.plan(batch.metadata)
    got = flex.forward(batch.q, batch.k_cache, batch.v_cache, state, selected=batch.selected)
    assert state.sparse_path == path and 0 < flex.tile_efficiency(state) <= 1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    monkeypatch.delenv("PAGEDBENCH_FLEX_SPARSE")
    for seqs, expected_path in (([(3, 1), (1, 6), (0, 3)], "pages"), ([(3, 1), (2, 5)], "gather")):
        short = random_attention_batch(seqs, 6, 1, 40, 4, torch.float32, cpu, value_dim=32, topk=TOPK)
        assert flex.plan(short.metadata).sparse_path == expected_path  # every query selects its whole past


@pytest.mark.slow
def test_swap_preemption_and_tensor_parallelism_keep_the_tokens(sparse_model, prompts):
    """Swapped sequences take their index keys out and back with their latents; at TP 2 each rank
    runs the whole indexer on its replicated index pages and the same selection: HF's tokens."""
    path, hf = sparse_model
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    assert_swap_and_tp2_keep_the_tokens(path, prompts, expected, MAX_NEW, **SETUPS["pressure"])


@pytest.mark.slow
def test_fp8_index_keys_keep_the_top_k(tmp_path):
    """fp8 index keys with a scale per token (V3.2's 64 index heads of 128 here), teacher-forced over
    held-out text: where a query's past exceeds its top-256, the fp8 keys keep >= 95 % of its picks
    (`check --index-cache-dtype fp8`; a wrong scale would keep a random share)."""
    from pagedbench.bench.kv_quality import index_key_quality

    spec = {
        "m": ("DeepseekV32Config", SPARSE | dict(index_n_heads=64, index_head_dim=128, index_topk=256, hidden_size=256))
    }
    build_hf_model("m", tmp_path / "m", spec)
    quality = index_key_quality(str(tmp_path / "m"))
    assert quality["contested_queries"] > 1000 and quality["topk_overlap"] >= 0.95, quality


def test_index_key_quality_needs_a_sparse_model(tiny_models):
    from pagedbench.bench.kv_quality import index_key_quality

    with pytest.raises(ValueError, match="has no sparse-attention indexer"):
        index_key_quality(tiny_models["llama"][0])


@pytest.mark.slow
def test_compare_reports_the_indexer_apart_from_attention(sparse_model, tmp_path):
    """compare on the tiny V3.2: the indexer's share of the forward (its timer span), apart from
    attention's, in the CSV and the table; both backends' tokens the same."""
    import pandas as pd

    from pagedbench.entrypoints.cli.main import main

    args = ["compare", "--model", sparse_model[0], "--scenario", "synthetic", "--scale", "0.125", "--repeats", "1"]
    assert main([*args, "--backends", "reference,sdpa", "--out", str(tmp_path)]) == 0
    df = pd.read_csv(tmp_path / "compare-synthetic.csv")
    assert (df["indexer_share"] > 0).all() and (df["attention_share"] > 0).all()
    assert (df["identical_token_share"] == 1).all()
    assert "indexer % of forward" in (tmp_path / "compare-synthetic.md").read_text()


def test_run_takes_fp8_index_keys(sparse_model, tmp_path):
    """`run --index-cache-dtype fp8` on the tiny V3.2: the engine stores its index keys in fp8 (a scenario
    override inside the hash), and the rows say so; the KV budget keeps its memory, so more pages."""
    import pandas as pd

    from pagedbench.entrypoints.cli.main import main

    args = ["run", "--model", sparse_model[0], "--scenario", "synthetic", "--scale", "0.05", "--no-warmup"]
    args += ["--num-blocks", "40", "--device", "cpu", "--dtype", "fp32", "--backend", "sdpa"]
    for stored in ("auto", "fp8"):
        assert main([*args, "--index-cache-dtype", stored, "--out", str(tmp_path / stored)]) == 0
    auto, fp8 = (pd.read_csv(tmp_path / stored / "run-synthetic.csv") for stored in ("auto", "fp8"))
    assert list(auto["index_cache_dtype"]) == ["auto"] and list(fp8["index_cache_dtype"]) == ["fp8"]
    assert (fp8["status"] == "ok").all() and fp8["num_blocks"].iloc[0] > auto["num_blocks"].iloc[0]
    assert fp8["scenario_hash"].iloc[0] != auto["scenario_hash"].iloc[0]


def test_fp8_index_keys_need_a_sparse_model(tiny_models, tmp_path, capsys):
    """A model without V3.2's indexer has no index keys to store in fp8: one line on stderr, exit 2."""
    from pagedbench.entrypoints.cli.main import main

    for command in (["run"], ["compare", "--backends", "sdpa"]):
        args = [*command, "--model", tiny_models["llama"][0], "--scenario", "synthetic", "--scale", "0.05"]
        assert main([*args, "--index-cache-dtype", "fp8", "--device", "cpu", "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "has no sparse-attention indexer" in err, err
