"""OpenAI's response bodies from RequestOutputs: choices, usage and logprobs (completion and chat
forms), and vLLM's prompt_logprobs entries."""

import itertools


def usage(outputs) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def choice(index: int, c, chat: bool, top_k: int) -> dict:
    common = {"index": index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    logprobs = choice_logprobs(c, chat, top_k)
    if chat:
        return common | {"message": {"role": "assistant", "content": c.text}, "logprobs": logprobs}
    return common | {"text": c.text, "logprobs": logprobs}


def echoed(out, c, decode) -> dict:
    """A completion choice's `text` and `logprobs` with the prompt in front, as vLLM echoes it: the
    first prompt token has no logprob (nothing predicts it), the others the engine's prompt logprobs.
    `decode(ids)`: text of token ids."""
    prompt_text = out.prompt if out.prompt is not None else decode(out.prompt_token_ids)
    fields = {"text": prompt_text + c.text}
    if c.logprobs is None or out.prompt_logprobs is None:
        return fields
    ids = out.prompt_token_ids
    head = _completion_logprobs(out.prompt_logprobs[1:], ids[1:], len(first := decode(ids[:1])))
    offset = len(first) + sum(map(len, head["tokens"]))
    tail = _completion_logprobs(c.logprobs, c.token_ids, offset)
    return fields | {
        "logprobs": {
            "tokens": [first, *head["tokens"], *tail["tokens"]],
            "token_logprobs": [None, *head["token_logprobs"], *tail["token_logprobs"]],
            "top_logprobs": [None, *head["top_logprobs"], *tail["top_logprobs"]],
            "text_offset": [0, *head["text_offset"], *tail["text_offset"]],
        }
    }


def prompt_position(entry: dict | None) -> dict | None:
    """vLLM's prompt_logprobs entry: token id -> {logprob, rank, decoded_token}."""
    if entry is None:
        return None
    return {
        str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token} for t, lp in entry.items()
    }


def choice_logprobs(c, chat: bool, top_k: int, start: int = 0) -> dict | None:
    """OpenAI's logprobs object for c's tokens from `start` on (a stream's new tokens), or None."""
    if c.logprobs is None:
        return None
    entries, token_ids = c.logprobs[start:], c.token_ids[start:]
    if chat:
        return _chat_logprobs(entries, token_ids, top_k)
    offset = sum(len(_token_text(entry, t)) for entry, t in zip(c.logprobs[:start], c.token_ids[:start]))
    return _completion_logprobs(entries, token_ids, offset)


def _token_text(entry: dict, token: int) -> str:
    """A logprob entry's token as text; vLLM's "token_id:N" where it was not decoded (detokenize=False)."""
    text = entry[token].decoded_token
    return text if text is not None else f"token_id:{token}"


def _completion_logprobs(entries: list[dict], token_ids: list[int], offset: int = 0) -> dict:
    """OpenAI's completion logprobs; text_offset counts from the start of the completion."""
    tokens = [_token_text(entry, t) for entry, t in zip(entries, token_ids)]
    starts = list(itertools.accumulate(map(len, tokens), initial=offset))[: len(tokens)]
    return {
        "tokens": tokens,
        "token_logprobs": [entry[t].logprob for entry, t in zip(entries, token_ids)],
        "top_logprobs": [{_token_text(entry, t): lp.logprob for t, lp in entry.items()} for entry in entries],
        "text_offset": starts,
    }


def _chat_entry(entry: dict, token: int, logprob: float) -> dict:
    """OpenAI's chat logprob entry: the token's text, its logprob and its UTF-8 bytes (None where it
    was not decoded)."""
    text = entry[token].decoded_token
    return {
        "token": _token_text(entry, token),
        "logprob": logprob,
        "bytes": None if text is None else list(text.encode()),
    }


def _chat_logprobs(entries: list[dict], token_ids: list[int], top_k: int) -> dict:
    content = []
    for entry, t in zip(entries, token_ids):
        ranked = sorted(entry.items(), key=lambda item: item[1].rank)
        top = [_chat_entry(entry, i, lp.logprob) for i, lp in ranked if lp.rank <= top_k]
        content.append(_chat_entry(entry, t, entry[t].logprob) | {"top_logprobs": top})
    return {"content": content}
