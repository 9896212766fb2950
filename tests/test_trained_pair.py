"""The committed trained pair (pagedbench/model/trained_pair.py): it loads by name, predicts Python
source far better than chance, the engine reproduces Hugging Face's greedy tokens on it in fp32,
and its draft agrees with its target often enough to make speculation worth measuring."""

import json

import pytest
import torch

from pagedbench import LLM, SamplingParams
from pagedbench.model.trained_pair import EOS, SEQ, bits_per_byte, corpus, trained_models

pytestmark = pytest.mark.skipif(len(trained_models()) < 2, reason="the trained pair is not in this checkout")


@pytest.fixture(scope="module")
def pair():
    from transformers import AutoModelForCausalLM

    return {
        name: AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        for name, path in trained_models().items()
    }


def test_the_pair_predicts_python(pair):
    """Held-out bits per byte as recorded, and far under the 8 bits of a byte-level guess."""
    held_out = corpus()[1]
    for name, model in pair.items():
        record = json.loads((trained_models()[name] / "training.json").read_text())
        measured = bits_per_byte(model, held_out)
        # Another Python's stdlib is other held-out text: near the record, not equal.
        assert measured < 4.0 and abs(measured - record["held_out_bits_per_byte"]) < 0.3, (name, measured, record)


def test_engine_greedy_equals_hf_on_the_target(pair):
    prompt = list(b"def read_config(path):\n    with open(path) as f:\n")
    hf = (
        pair["py-byte-target"]
        .generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=EOS)[
            0, len(prompt) :
        ]
        .tolist()
    )
    llm = LLM("py-byte-target", backend="sdpa", device="cpu", dtype="float32")
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf
    assert llm.get_tokenizer().decode(prompt) == bytes(prompt).decode()  # the byte-level tokenizer round-trips


@torch.no_grad()
def test_the_draft_agrees_with_the_target_often(pair):
    """Teacher-forced on held-out source, the draft's top-1 byte equals the target's at most
    positions: what greedy speculation accepts (a random pair would agree 1 time in 260)."""
    held_out = torch.frombuffer(bytearray(corpus()[1]), dtype=torch.uint8).long()
    starts = torch.linspace(0, len(held_out) - SEQ - 1, 16).long().tolist()
    batch = torch.stack([held_out[s : s + SEQ] for s in starts])
    target, draft = (pair[n](input_ids=batch).logits.argmax(-1) for n in ("py-byte-target", "py-byte-draft"))
    assert (target == draft).float().mean() > 0.5
