"""Server-sent events in OpenAI's chunk format: one chunk per new token and choice from the engine's
deltas (text that could start a stop string held back until it cannot), usage at the end on request."""

import json

from pagedbench.entrypoints.openai import responses
from pagedbench.entrypoints.openai.protocol import APIError, error_body
from pagedbench.sample.sampling_params import SamplingParams


async def achain(first, stream):
    yield first
    async for item in stream:
        yield item


class _Deltas:
    """What each choice (prompt i, sample c.index) has been sent so far, and its next chunks. The
    outputs are the engine's deltas (RequestOutputKind.DELTA), whose text already waits while it
    could start a stop string (vLLM's rule)."""

    def __init__(self, params: SamplingParams, chat: bool):
        self.params, self.chat = params, chat
        self.tokens_sent: dict[tuple[int, int], int] = {}  # output tokens streamed per choice
        self.text_offset: dict[tuple[int, int], int] = {}  # a completion's logprob tokens' characters so far

    def choices(self, i: int, out) -> list[dict]:
        """The chunk choices of prompt i's latest output."""
        choices = []
        for c in out.outputs:
            key, index = (i, c.index), i * self.params.n + c.index
            if self.chat and key not in self.tokens_sent:
                choices.append({"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            self.tokens_sent[key] = self.tokens_sent.get(key, 0) + len(c.token_ids)
            reason = c.finish_reason if out.finished else None
            # A chunk per token, as vLLM sends them (the text may lag a partial character).
            if c.token_ids or reason:
                piece = {"content": c.text} if self.chat else {"text": c.text}
                choice = {"index": index, "delta": piece} if self.chat else {"index": index, **piece}
                choices.append(choice | {"logprobs": self._logprobs(key, c), "finish_reason": reason})
        return choices

    def usage(self, finals) -> dict:
        """OpenAI's usage of the streamed requests (their outputs held only the last deltas)."""
        prompt = sum(len(o.prompt_token_ids) for o in finals)
        completion = sum(self.tokens_sent.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _logprobs(self, key: tuple[int, int], c) -> dict | None:
        """The delta's logprobs; a completion's text_offset counts from the start of its choice's text."""
        logprobs = responses.choice_logprobs(c, self.chat, self.params.logprobs or 0)
        if logprobs is not None and not self.chat:
            offset = self.text_offset.get(key, 0)
            logprobs["text_offset"] = [offset + o for o in logprobs["text_offset"]]
            self.text_offset[key] = offset + sum(map(len, logprobs["tokens"]))
        return logprobs


async def stream_events(request, first, stream, params: SamplingParams, chat: bool, head: dict, include_usage: bool):
    """The SSE lines of a streamed completion; `head` is the response's id, created and model. A
    client that goes away stops the stream (closing `stream` aborts its requests)."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": head["id"], "object": kind, "created": head["created"], "model": head["model"]}
    deltas, finals = _Deltas(params, chat), {}
    try:
        async for i, out in achain(first, stream):
            if await request.is_disconnected():
                return  # closing `stream` aborts the requests
            choices = deltas.choices(i, out)
            if out.finished:
                finals[i] = out
            for choice in choices:  # one choice per chunk, as vLLM and OpenAI send them
                yield f"data: {json.dumps(head | {'choices': [choice]})}\n\n"
        if include_usage:
            yield f"data: {json.dumps(head | {'choices': [], 'usage': deltas.usage(finals.values())})}\n\n"
        yield "data: [DONE]\n\n"
    except APIError as e:
        yield f"data: {json.dumps(error_body(e.status, str(e), e.kind))}\n\n"
    finally:
        await stream.aclose()
