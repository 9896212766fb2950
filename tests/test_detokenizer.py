"""Incremental detokenization (tokenizers' DecodeStream, primed with the prompt's last tokens): a
sequence's streamed text, flushed at the end, equals decoding all its output tokens at once, for
random token ids (lone UTF-8 bytes, multibyte characters and emoji split across tokens, special
tokens) on the tests' byte-level tokenizers, a SentencePiece one read from a GGUF file and the real
SmolLM2 tokenizer; through the engine too, streamed and forked (n > 1)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedbench import LLM, SamplingParams
from pagedbench.engine.detokenizer import IncrementalDetokenizer
from pagedbench.model.tokenizer import preset_tokenizer
from tests.conftest import train_tokenizer
from tests.test_gguf import REAL, needs_real

TEXTS = st.text(alphabet=st.sampled_from("ab é€ñ中😀🦀\n\ufffd<>.,"), max_size=12)
RANDOM = settings(max_examples=150, deadline=None)


def streamed(tokenizer, prompt: list[int], output: list[int], skip: bool) -> str:
    """The text the detokenizer gives token by token, then its flush."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip)
    text = ""
    for token in output:
        text += detok.step(token)
    return text + detok.flush()


def token_ids(tokenizer):
    """Random ids of any token, or the tokens of random text (emoji and multibyte characters)."""
    ids = st.lists(st.integers(0, len(tokenizer) - 1), max_size=20)
    encoded = TEXTS.map(lambda t: tokenizer.encode(t, add_special_tokens=False))
    return st.one_of(ids, encoded, st.tuples(ids, encoded, ids).map(lambda parts: sum(parts, [])))


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    """The tiny models' trained byte-level BPE, and a preset's byte tokenizer."""
    return [train_tokenizer(tmp_path_factory.mktemp("tokenizer")), preset_tokenizer(512, [0])]


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory):
    """The SentencePiece vocabulary (byte fallback) of a tiny Gemma GGUF file, as transformers reads it."""
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from tests.test_gguf import write_tiny_gguf

    path = tmp_path_factory.mktemp("gguf-tokenizer") / "tiny-gemma2.gguf"
    write_tiny_gguf("gemma2", path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("which", [0, 1], ids=["trained-bpe", "preset-bytes"])
@pytest.mark.parametrize("skip", [True, False])
@RANDOM
@given(data=st.data())
def test_streamed_text_is_the_whole_decode_on_byte_level_tokenizers(byte_level, which, skip, data):
    tok = byte_level[which]
    prompt, output = data.draw(token_ids(tok)), data.draw(token_ids(tok))
    assert streamed(tok, prompt, output, skip) == tok.decode(output, skip_special_tokens=skip)


@settings(max_examples=100, deadline=None)
@given(prompt=TEXTS, output=TEXTS, skip=st.booleans())
def test_streamed_text_is_the_whole_decode_on_a_sentencepiece_tokenizer(sentencepiece, prompt, output, skip):
    """Text's tokens (byte-fallback tokens for the characters outside the vocabulary) decode whole
    and streamed alike. (Random byte tokens need not: an invalid run of byte-fallback tokens decodes
    as one U+FFFD per token, so no decoding of pieces matches the whole.)"""
    tok = sentencepiece
    prompt_ids, output_ids = tok.encode(prompt), tok.encode(output, add_special_tokens=False)
    assert streamed(tok, prompt_ids, output_ids, skip) == tok.decode(output_ids, skip_special_tokens=skip)


@needs_real
@pytest.mark.slow
def test_streamed_text_is_the_whole_decode_on_the_real_smollm2_tokenizer():
    from transformers import AutoTokenizer

    from pagedbench.model import gguf

    path = gguf.real_model_file(REAL)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    @settings(max_examples=200, deadline=None)
    @given(data=st.data(), skip=st.booleans())
    def check(data, skip):
        prompt, output = data.draw(token_ids(tok)), data.draw(token_ids(tok))
        assert streamed(tok, prompt, output, skip) == tok.decode(output, skip_special_tokens=skip)

    check()


def test_a_character_split_across_tokens_waits_for_its_last_byte(byte_level):
    tok = byte_level[1]  # the preset's: one token per byte
    detok = IncrementalDetokenizer(tok, tok.encode("hi "), True)
    emoji = tok.encode("😀")
    assert len(emoji) == 4 and [detok.step(t) for t in emoji] == ["", "", "", "😀"]
    assert [detok.step(t) for t in emoji[:2]] == ["", ""] and detok.flush() == "\ufffd"  # held back, then flushed


def test_the_prompt_primes_a_sentencepiece_words_leading_space():
    """A decoder that strips the text's leading space (Llama's SentencePiece) keeps the space before
    the first output word: the prompt's last tokens are the context it decodes in."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert tok.decode([2, 3]) == "world!"
    assert streamed(tok, [1], [2, 3], True) == " world!" and streamed(tok, [], [2, 3], True) == "world!"


def test_byte_fallback_tokens_that_decode_differently_together_restart_the_stream():
    """é as two byte-fallback tokens, then a lone byte and a word: the window decodes as three
    U+FFFD, not as the é already emitted; the stream restarts (as vLLM's does) instead of raising."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": b + 1 for b in range(256)}, "x": 257}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert streamed(tok, [], [0xC3 + 1, 0xA9 + 1, 0xE2 + 1, 257], True) == "é\ufffdx"


def test_a_fork_decodes_on_its_own(byte_level):
    tok = byte_level[1]
    parent = IncrementalDetokenizer(tok, [], True)
    euro = tok.encode("€")
    assert parent.step(euro[0]) == ""
    child = parent.fork()
    assert [parent.step(t) for t in euro[1:]] == ["", "€"]
    assert child.step(tok.encode("a")[0]) == "\ufffda" and child.flush() == "" and parent.flush() == ""


def test_a_tokenizer_without_a_tokenizers_backend_is_refused(byte_level):
    class Slow:
        def decode(self, ids, skip_special_tokens=False):
            return ""

    with pytest.raises(TypeError, match="needs a fast tokenizer.*got Slow"):
        IncrementalDetokenizer(Slow(), [], True)


def test_engine_streams_and_forks_decode_to_the_whole_text():
    """Sampled bytes (multibyte characters split anywhere, lone continuation bytes), n = 3 samples
    forked from one request: each step's text extends the last, and the final text is the decode."""
    llm = LLM("tiny-llama", device="cpu", max_model_len=128)
    tok = llm.get_tokenizer()
    allowed = sorted(set(tok.encode("aé€😀中 ")))
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed)
    engine = llm.engine
    engine.add_request("Hi 😀", params)
    seen: dict[int, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                assert c.text.startswith(seen.get(c.index, ""))
                seen[c.index] = c.text
    assert len(out.outputs) == 3 and any(ord(ch) > 127 and ch != "\ufffd" for c in out.outputs for ch in c.text)
    for c in out.outputs:
        assert len(c.token_ids) == 24 and c.text == tok.decode(c.token_ids, skip_special_tokens=True)
