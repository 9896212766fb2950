"""Preemption by swap: a preempted sequence's pages go to CPU swap space and come back (no
recompute); when swap space is full it falls back to recompute. Greedy outputs are identical to
recompute's and to Hugging Face's, on every CPU backend, with forks and prefix caching in play."""

import pytest

from pagedbench import LLM, SamplingParams
from tests.conftest import hf_greedy
from tests.helpers import ENGINE_BACKENDS

PROMPTS = [[(7 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate([5, 17, 30, 9, 26, 40])]
PRESSURE = dict(block_size=4, num_blocks=14, max_model_len=52, max_num_batched_tokens=12)


def run(path, backend, mode, swap_space=4.0, caching=True):
    llm = LLM(
        path,
        backend=backend,
        dtype="float32",
        device="cpu",
        preemption_mode=mode,
        swap_space=swap_space,
        enable_prefix_caching=caching,
        **PRESSURE,
    )
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("backend", ENGINE_BACKENDS)
def test_swap_and_recompute_give_identical_outputs(tiny_models, backend, caching):
    path, hf = tiny_models["llama"]
    swapped, engine = run(path, backend, "swap", caching=caching)
    recomputed, other = run(path, backend, "recompute", caching=caching)
    assert swapped == recomputed == [hf_greedy(hf, p, 10) for p in PROMPTS]
    assert engine.stats.swap_outs > 0 and engine.scheduler.num_swap_outs == engine.stats.preemptions
    assert other.stats.swap_outs == 0 and other.stats.preemptions > 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and len(bm.swap_space.free) == bm.num_cpu_blocks


def test_full_swap_space_falls_back_to_recompute(tiny_models):
    path, hf = tiny_models["llama"]
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4  # K and V, 2 layers, page of 4, 2 KV heads x 16, fp32
    outputs, engine = run(path, "sdpa", "swap", swap_space=3 * block_bytes / 2**30)  # room for 3 pages
    assert engine.block_manager.num_cpu_blocks == 3
    assert outputs == [hf_greedy(hf, p, 10) for p in PROMPTS]
    assert 0 < engine.scheduler.num_swap_outs < engine.stats.preemptions  # some swapped, some recomputed


def test_swapped_samples_and_beams(tiny_models):
    """Forked samples and beams survive swapping (a beam forked while swapped out recomputes)."""
    path, _ = tiny_models["llama"]
    kwargs = dict(dtype="float32", device="cpu", **PRESSURE)
    swap, recompute = LLM(path, preemption_mode="swap", **kwargs), LLM(path, **kwargs)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    a = [[c.token_ids for c in o.outputs] for o in swap.generate(prompts, params, use_tqdm=False)]
    b = [[c.token_ids for c in o.outputs] for o in recompute.generate(prompts, params, use_tqdm=False)]
    assert a == b and swap.engine.stats.swap_outs > 0
    from pagedbench import BeamSearchParams

    beams = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    assert [[s.tokens for s in o.sequences] for o in swap.beam_search(prompts, beams)] == [
        [s.tokens for s in o.sequences] for o in recompute.beam_search(prompts, beams)
    ]


def test_bad_preemption_settings(tiny_models):
    with pytest.raises(ValueError, match="preemption_mode must be 'recompute' or 'swap'"):
        LLM(tiny_models["llama"][0], device="cpu", preemption_mode="drop")
    with pytest.raises(ValueError, match="swap_space must be >= 0"):
        LLM(tiny_models["llama"][0], device="cpu", preemption_mode="swap", swap_space=-1)
