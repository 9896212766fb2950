"""Tokenizer loading and incremental detokenization."""

from pathlib import Path

from pagedbench.sequence import Sequence


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def detokenize_incrementally(tokenizer, seq: Sequence, flush: bool = False) -> str:
    """Append the text of `seq`'s newest output token to `seq.output_text`; return the new text.

    Decodes only a short window of recent tokens, and holds text back while it ends in an
    incomplete UTF-8 character (decoded as U+FFFD), as vLLM does, unless `flush` (the end).
    """
    tokens = seq.output_token_ids
    skip = seq.params.skip_special_tokens
    prefix = tokenizer.decode(tokens[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(tokens[seq.prefix_offset :], skip_special_tokens=skip)
    if len(full) > len(prefix) and (flush or not full.endswith("\ufffd")):
        new_text = full[len(prefix) :]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(tokens)
        seq.output_text += new_text
        return new_text
    return ""


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Token sequences of each bad word, alone and after a space (vLLM's two spellings)."""
    out = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out
