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
    prefix = tokenizer.decode(tokens[seq.prefix_offset : seq.read_offset], skip_special_tokens=True)
    full = tokenizer.decode(tokens[seq.prefix_offset :], skip_special_tokens=True)
    if len(full) > len(prefix) and (flush or not full.endswith("\ufffd")):
        new_text = full[len(prefix) :]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(tokens)
        seq.output_text += new_text
        return new_text
    return ""
