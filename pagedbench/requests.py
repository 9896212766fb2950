"""Turning a user's prompt into token ids, and refusing a request before anything is queued."""

from pagedbench.sampling_params import SamplingParams, is_int


def is_single_prompt(prompts) -> bool:
    """A str, a prompt dict, or a list of token ids (nano-vllm's form) is one prompt; any other
    iterable is a batch of them."""
    return isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and bool(prompts) and all(is_int(t) for t in prompts)
    )


def tokenize(prompt, tokenizer, model_name: str) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt in any of vLLM's forms: a str, {'prompt': str},
    {'prompt_token_ids': [...]} (optionally with its 'prompt' text), or a list of token ids."""
    if isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
        return None, list(prompt)
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                f"model {model_name!r} has no tokenizer; pass {{'prompt_token_ids': [...]}} prompts (or tokenizer=)"
            )
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)) or not all(is_int(t) for t in ids):
            raise ValueError("prompt_token_ids must be a list of ints")
        return prompt.get("prompt"), list(ids)
    raise ValueError(
        "a prompt is a str, {'prompt': str}, {'prompt_token_ids': [...]} or a list of token ids, "
        f"got {type(prompt).__name__}"
    )


def validate_request(
    token_ids: list[int],
    params: SamplingParams,
    max_model_len: int,
    vocab_size: int,
    has_tokenizer: bool,
    max_logprobs: int = 20,
) -> None:
    """ValueError/TypeError naming what is wrong; nothing else happens."""
    params.validate()
    if not token_ids:
        raise ValueError("prompt is empty")
    if len(token_ids) > max_model_len:
        raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len={max_model_len}")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
    if params.bad_words and not has_tokenizer:
        raise ValueError(
            "bad_words need a tokenizer; this model has none (use allowed_token_ids or a logits processor)"
        )
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > max_logprobs:
            raise ValueError(
                f"{name}={value} is more than the {max_logprobs} logprobs a request may ask for (max_logprobs)"
            )
    listed = (params.allowed_token_ids or []) + params.stop_token_ids + list(params.logit_bias or {})
    outside = [t for t in listed if not 0 <= t < vocab_size]
    if outside:
        raise ValueError(
            f"allowed_token_ids/stop_token_ids/logit_bias: token id {outside[0]} is outside the vocabulary "
            f"[0, {vocab_size})"
        )
