"""Beam search equals Hugging Face's `generate(num_beams=k, do_sample=False)` token for token on a
tiny fp32 model (its default early_stopping=False), with and without an end-of-sequence token in
play, several length penalties, on every CPU backend and under KV pressure (preemption). Beams
fork through the block manager: pages are shared and copied on write, never leaked."""

import random

import pytest
import torch

from pagedbench import LLM, BeamSearchParams
from tests.conftest import VOCAB
from tests.helpers import ENGINE_BACKENDS

MAX_NEW = 8
SETUPS = {
    "roomy": dict(block_size=4),
    "pressure": dict(block_size=4, num_blocks=11, max_num_batched_tokens=16, max_model_len=40),
}


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 17, 30)]


def hf_beams(hf, prompt, k, length_penalty, eos):
    """Hugging Face's k returned beams, prompt + output, cut after the end token (HF pads after it)."""
    out = hf.generate(
        torch.tensor([prompt]),
        num_beams=k,
        num_return_sequences=k,
        do_sample=False,
        max_new_tokens=MAX_NEW,
        length_penalty=length_penalty,
        eos_token_id=eos,
        pad_token_id=0,
    )
    beams = []
    for row in out.tolist():
        generated = row[len(prompt) :]
        if eos is not None and eos in generated:
            generated = generated[: generated.index(eos) + 1]
        beams.append(prompt + generated)
    return beams


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("backend", ENGINE_BACKENDS)
def test_beam_search_matches_hf(tiny_models, prompts, backend, setup):
    path, hf = tiny_models["llama"]
    llm = LLM(path, backend=backend, dtype="float32", device="cpu", **SETUPS[setup])
    engine = llm.engine
    ended_early = 0
    for prompt in prompts:
        no_eos = hf_beams(hf, prompt, 3, 1.0, None)
        # An end token the beams really produce: the best beam's third token.
        for k, length_penalty, eos in [
            (3, 1.0, None),
            (2, 0.5, None),
            (4, 1.0, no_eos[0][len(prompt) + 2]),
            (3, 2.0, no_eos[1][len(prompt) + 1]),
        ]:
            engine.model_config.eos_token_ids = [] if eos is None else [eos]
            params = BeamSearchParams(beam_width=k, max_tokens=MAX_NEW, length_penalty=length_penalty)
            out = llm.beam_search([{"prompt_token_ids": prompt}], params)[0]
            assert [s.tokens for s in out.sequences] == hf_beams(hf, prompt, k, length_penalty, eos)
            scores = [s.score for s in out.sequences]
            assert scores == sorted(scores, reverse=True)
            ended_early += sum(s.finish_reason == "stop" for s in out.sequences)
            assert all(s.stop_reason == (eos if s.finish_reason == "stop" else None) for s in out.sequences)
    assert ended_early > 0, "no beam ever ended on the end token: the EOS path went untested"
    bm = engine.block_manager
    assert engine.stats.block_copies > 0 and engine.stats.peak_shared_blocks > 0
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.pool.ref_counts)
    if setup == "pressure":
        assert engine.stats.preemptions > 0


def test_beam_search_text_and_batch(tiny_models):
    """Several prompts at once give what each gives alone; text prompts decode."""
    path, _ = tiny_models["llama"]
    llm = LLM(path, dtype="float32", device="cpu")
    params = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)
    texts = ["the quick brown fox", "paged attention stores keys"]
    together = llm.beam_search(texts, params)
    alone = [llm.beam_search(text, params)[0] for text in texts]
    assert [[s.tokens for s in o.sequences] for o in together] == [[s.tokens for s in o.sequences] for o in alone]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    best = together[0].sequences[0]
    assert best.text == tok.decode(best.tokens, skip_special_tokens=True) and best.text.startswith(texts[0])
    assert all(len(s.tokens) == len(tok.encode(texts[0])) + 5 for s in together[0].sequences)
