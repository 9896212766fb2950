"""IncrementalDetokenizer: a sequence's output text token by token, through tokenizers' DecodeStream
(as vLLM v1's FastIncrementalDetokenizer), primed with the prompt's last tokens."""

import copy
import logging

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

logger = logging.getLogger(__name__)
INVALID_PREFIX = "Invalid prefix encountered"  # DecodeStream's error where the window decodes differently


def backend_tokenizer(tokenizer) -> Tokenizer:
    """The fast tokenizer's tokenizers.Tokenizer; TypeError for a tokenizer without one."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        name = type(tokenizer).__name__
        raise TypeError(f"decoding text needs a fast tokenizer (one the tokenizers library backs), got {name}")
    return backend


def prompt_prefix(tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> list[int]:
    """The prompt's last 4 to 23 tokens, the fewest that decode to whole characters (vLLM's choice):
    the context the first output tokens decode in (a SentencePiece word's leading space); none where
    no such suffix exists, so that no character of the prompt completes in the output."""
    n = len(prompt_token_ids)
    for count in range(min(4, n), min(n, 23) + 1):
        suffix = prompt_token_ids[n - count :]
        if count and "\ufffd" not in tokenizer.decode(suffix, skip_special_tokens=skip_special_tokens):
            return suffix
    return []


class IncrementalDetokenizer:
    """The text of one sequence's output tokens, one token at a time. A token that ends in an
    incomplete character yields nothing until a later one completes it; `flush` gives what is held
    back at the end (decoded as U+FFFD)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = backend_tokenizer(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        prefix = prompt_prefix(self.tokenizer, prompt_token_ids, skip_special_tokens)
        self.stream = DecodeStream(ids=prefix, skip_special_tokens=skip_special_tokens)
        self.pending: list[int] = []  # the tokens since the last text

    def step(self, token: int) -> str:
        """The new text that `token` completes ("" while a character is incomplete)."""
        self.pending.append(token)
        try:
            text = self.stream.step(self.tokenizer, token)
        except Exception as e:  # noqa: BLE001 (DecodeStream raises a bare Exception)
            if not str(e).startswith(INVALID_PREFIX):
                raise
            # The window decodes other than its emitted prefix (byte-fallback tokens that only form a
            # character together): restart from the tokens not yet emitted, as vLLM does.
            logger.debug("%s; restarting the decode stream", e)
            self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            text = self.stream.step(self.tokenizer, self.pending)
        if text is None:
            return ""
        self.pending = []
        return text

    def flush(self) -> str:
        """The text held back at the end: the incomplete character's replacement characters."""
        text = self.tokenizer.decode(self.pending, skip_special_tokens=self.skip_special_tokens) if self.pending else ""
        self.pending = []
        return text

    def fork(self) -> "IncrementalDetokenizer":
        """An independent copy at the same point (a forked sample or beam)."""
        child = copy.copy(self)
        child.stream, child.pending = copy.copy(self.stream), list(self.pending)
        return child
