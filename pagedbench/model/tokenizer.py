"""Tokenizers: a model directory's Hugging Face tokenizer, a preset's byte-level one, chat prompts."""

import logging
from pathlib import Path

from pagedbench.backends.base import one_line
from pagedbench.model.chat_messages import validate_messages

logger = logging.getLogger(__name__)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(path: Path, required: bool = True):
    """The directory's Hugging Face tokenizer. A model directory need not have one (required
    False): then None, and prompts must be token ids, as for a preset."""
    from transformers import AutoTokenizer

    if not required and not any((Path(path) / name).exists() for name in TOKENIZER_FILES):
        logger.warning("%s has no tokenizer files: prompts must be token ids (or pass tokenizer=)", path)
        return None
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {path}: {one_line(e)}") from None


EOS_TEXT = "<|endoftext|>"
# A preset's chat template (documented in docs/usage.md), so llm.chat and /v1/chat/completions work on
# presets and the trained pair: each message as "<|role|>\ncontent\n", then the assistant's turn.
PRESET_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def preset_tokenizer(vocab_size: int, eos_token_ids: list[int]):
    """A byte-level tokenizer for a preset (which has random weights and no tokenizer of its
    own), so text prompts, stop strings and the server work on it: each UTF-8 byte of a text is
    one token (ids: the first 256 not taken by EOS), the first EOS decodes as <|endoftext|>
    (others as <|eos_k|>) and every other id as "<id>". Lengths in tokens are bytes, as with any
    byte-fallback vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    eos = [t for t in eos_token_ids if 0 <= t < vocab_size]
    if vocab_size < 256 + len(eos):
        return None
    byte_ids = [i for i in range(256 + len(eos)) if i not in eos][:256]
    vocab = {f"<{i}>": i for i in range(vocab_size)}
    for byte, char in bytes_to_unicode().items():  # the byte-level alphabet: byte -> its character
        del vocab[f"<{byte_ids[byte]}>"]
        vocab[char] = byte_ids[byte]
    specials = [EOS_TEXT, *(f"<|eos_{k}|>" for k in range(1, len(eos)))]  # one per EOS id
    for i, text in zip(eos, specials):
        del vocab[f"<{i}>"]
        vocab[text] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if eos:
        tok.add_special_tokens(specials[: len(eos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TEXT if eos else None)
    fast.chat_template = PRESET_CHAT_TEMPLATE
    return fast


def chat_prompt(tokenizer, messages: list[dict], param: str = "messages") -> dict:
    """The prompt of a conversation (OpenAI-style messages, checked as OpenAI checks them: a
    MessageError naming the field, `param` being the list's name) under the tokenizer's chat
    template, with the assistant's turn opened; ValueError when there is no template or the
    messages don't fit it."""
    messages = validate_messages(messages, param)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 (a malformed message list)
        raise ValueError(f"messages could not be formatted: {e}") from None
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def tokenizer_for(tokenizer_dir: str | None, model_path: Path | None, vocab_size: int, eos_token_ids: list[int]):
    """The engine's tokenizer: the `tokenizer` setting's directory, else the model directory's
    (which may have none: None), else, for a preset, a byte-level one."""
    if tokenizer_dir is not None:
        return load_tokenizer(tokenizer_dir)
    if model_path is not None:
        return load_tokenizer(model_path, required=False)
    return preset_tokenizer(vocab_size, eos_token_ids)
