"""Server-sent events in OpenAI's chunk format: one chunk per new token and choice, text that could
start a stop string held back until it cannot (vLLM's rule), usage at the end on request."""

import json

from pagedbench.entrypoints.openai import responses
from pagedbench.entrypoints.openai.protocol import APIError, error_body
from pagedbench.sample.sampling_params import SamplingParams


async def achain(first, stream):
    yield first
    async for item in stream:
        yield item


class _Deltas:
    """What each choice (prompt i, sample c.index) has been sent so far, and its next chunks."""

    def __init__(self, params: SamplingParams, chat: bool):
        self.params, self.chat = params, chat
        self.holdback = max(map(len, params.stop), default=1) - 1
        self.sent: dict[tuple[int, int], int] = {}  # text characters streamed per choice
        self.tokens_sent: dict[tuple[int, int], int] = {}

    def choices(self, i: int, out) -> list[dict]:
        """The chunk choices of prompt i's latest output."""
        choices = []
        for c in out.outputs:
            key, index = (i, c.index), i * self.params.n + c.index
            # Hold back what could be the start of a stop string until the end (vLLM's rule).
            end = len(c.text) if out.finished else max(self.sent.get(key, 0), len(c.text) - self.holdback)
            delta = c.text[self.sent.get(key, 0) : end]
            if self.chat and key not in self.sent:
                choices.append({"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            self.sent[key] = end
            reason = c.finish_reason if out.finished else None
            done_tokens = self.tokens_sent.get(key, 0)
            self.tokens_sent[key] = len(c.token_ids)
            # A chunk per token, as vLLM sends them (the text may lag a partial character).
            if len(c.token_ids) > done_tokens or reason:
                piece = {"content": delta} if self.chat else {"text": delta}
                choice = {"index": index, "delta": piece} if self.chat else {"index": index, **piece}
                logprobs = responses.choice_logprobs(c, self.chat, self.params.logprobs or 0, done_tokens)
                choices.append(choice | {"logprobs": logprobs, "finish_reason": reason})
        return choices


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
            yield f"data: {json.dumps(head | {'choices': [], 'usage': responses.usage(finals.values())})}\n\n"
        yield "data: [DONE]\n\n"
    except APIError as e:
        yield f"data: {json.dumps(error_body(e.status, str(e), e.kind))}\n\n"
    finally:
        await stream.aclose()
