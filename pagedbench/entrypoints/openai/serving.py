"""The server's side of a request: its body read within limits, its SamplingParams, its prompts run
on the engine (all validated before any is queued), and the non-streamed response."""

import asyncio
import json
import time
import uuid

from pagedbench.entrypoints.async_llm import AsyncLLM, EngineFull
from pagedbench.entrypoints.openai import responses
from pagedbench.entrypoints.openai.metrics import ServerMetrics
from pagedbench.entrypoints.openai.protocol import (
    REQUEST_MODELS,
    SAMPLING_FIELDS,
    UNSUPPORTED,
    APIError,
    ServerLimits,
    check_fields,
    check_stream_and_user,
)
from pagedbench.entrypoints.openai.streaming import stream_events
from pagedbench.entrypoints.openai.structured import structured_outputs_of
from pagedbench.sample.sampling_params import RequestOutputKind, SamplingParams


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, model_name: str, limits: ServerLimits, metrics: ServerMetrics):
        self.llm, self.engine, self.model_name = llm, llm.engine, model_name
        self.limits, self.metrics = limits, metrics

    async def body_of(self, request, schema: str) -> dict:
        """The JSON object of the request's body: read up to the size limit, with only the fields of
        `schema` (protocol.ENDPOINT_FIELDS), for this model, with no field the server does not support."""
        limit = self.limits.max_body_bytes
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > limit:
            raise APIError(413, f"request body of {size} bytes is over the limit of {limit}")
        raw = bytearray()
        async for piece in request.stream():  # chunked uploads too: stop reading past the limit
            raw += piece
            if len(raw) > limit:
                raise APIError(413, f"request body is over the limit of {limit} bytes")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        check_fields(body, REQUEST_MODELS[schema])
        check_stream_and_user(body)
        if body.get("model") not in (None, self.model_name):
            message = f"model {body['model']!r} does not exist; this server has {self.model_name!r}"
            raise APIError(404, message, "not_found_error", "model")
        if body.get("use_beam_search") and structured_outputs_of(body)[0] is not None:
            raise APIError(400, "structured outputs do not run with beam search", param="use_beam_search")
        for name, default in UNSUPPORTED.items():
            if body.get(name, default) != default:
                raise APIError(400, f"{name} is not supported", param=name)
        return body

    async def tokenizer_body(self, request, schema: str) -> dict:
        if self.engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        return await self.body_of(request, schema)

    def sampling_params(self, body: dict, logprobs: int | None, default_max_tokens: int | None = 16) -> SamplingParams:
        """max_tokens None: up to max_model_len, or the server's max_tokens limit."""
        limits = self.limits
        kwargs = {k: v for k, v in body.items() if k in SAMPLING_FIELDS}
        kwargs.setdefault("max_tokens", default_max_tokens)
        kwargs["structured_outputs"] = structured_outputs_of(body)[0]
        if isinstance(kwargs.get("logit_bias"), dict):  # JSON object keys are strings
            try:
                kwargs["logit_bias"] = {int(k): v for k, v in kwargs["logit_bias"].items()}
            except ValueError:
                raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
        if kwargs["max_tokens"] is None:
            kwargs["max_tokens"] = limits.max_tokens
        limit = limits.max_tokens or self.engine.max_model_len
        if isinstance(kwargs["max_tokens"], int) and kwargs["max_tokens"] > limit:
            raise APIError(400, f"max_tokens={kwargs['max_tokens']} is over the limit of {limit}", param="max_tokens")
        if isinstance(kwargs.get("n"), int) and kwargs["n"] > limits.max_n:
            raise APIError(400, f"n={kwargs['n']} is over the limit of {limits.max_n}", param="n")
        try:
            return SamplingParams(**kwargs, logprobs=logprobs)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None

    def _admit(self, prompts: list, params: SamplingParams, priority: int) -> None:
        """Every prompt validated, and room for all of them, before any is queued."""
        engine, llm = self.engine, self.llm
        try:
            engine.validate_priority(priority)
            for prompt in prompts:
                ids = engine.tokenize(prompt)[1]
                engine.validate_request(ids, params)
                _check_context(len(ids), params.max_tokens, engine.max_model_len)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None
        if llm.error is not None:
            raise APIError(503, f"the engine stopped: {llm.error}", "service_unavailable")
        if llm.num_requests + len(prompts) > llm.max_pending:
            message = f"{llm.num_requests} requests in flight, the limit is {llm.max_pending}"
            raise APIError(429, message, "rate_limit_exceeded")

    async def run(self, prompts: list, params: SamplingParams, priority: int = 0):
        """One engine request per prompt; yields (prompt index, RequestOutput) as they progress."""
        self._admit(prompts, params, priority)
        queue: asyncio.Queue = asyncio.Queue()
        base = f"cmpl-{uuid.uuid4().hex}"

        async def pump(i, prompt):
            try:
                async for out in self.llm.generate(prompt, params, f"{base}-{i}", priority):
                    queue.put_nowait((i, out))
            except Exception as e:  # noqa: BLE001 (handed to the consumer)
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, prompt)) for i, prompt in enumerate(prompts)]
        live = len(tasks)
        try:
            while live:
                i, item = await queue.get()
                if item is None:
                    live -= 1
                    continue
                _raise_engine_error(item)
                if item.finished:
                    self.metrics.finished(item)
                yield i, item
        finally:  # a client gone, or done: cancelling a pump closes its generator, which aborts the request
            for task in tasks:
                task.cancel()

    def _decode(self, ids: list[int]) -> str:
        tokenizer = self.engine.tokenizer
        return tokenizer.decode(ids) if tokenizer is not None else "".join(f"token_id:{t}" for t in ids)

    async def compile_grammar(self, body: dict, params: SamplingParams) -> None:
        """The request's structured-output grammar compiled (or found in the cache) in a worker
        thread, off the event loop and the step loop; a 400 naming the field when it is refused."""
        if params.structured_outputs is None:
            return
        try:
            await asyncio.to_thread(self.engine.structured_outputs.compile, params.structured_outputs)
        except ValueError as e:
            raise APIError(400, str(e), param=structured_outputs_of(body)[1]) from None

    async def respond(self, request, body: dict, prompts: list, params: SamplingParams, chat: bool, echo=False):
        """The completion (or chat completion) of `prompts`: one JSON body, or an SSE stream.
        `echo`: each completion's text and logprobs start with its prompt's (a completion only)."""
        created, rid = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if body.get("stream") and params.best_of != params.n:
            raise APIError(400, "best_of != n cannot be streamed (the best samples are known only at the end)")
        # a stream sends what is new, a response the finished outputs: the engine makes only those
        params.output_kind = RequestOutputKind.DELTA if body.get("stream") else RequestOutputKind.FINAL_ONLY
        await self.compile_grammar(body, params)
        stream = self.run(prompts, params, body.get("priority", 0))  # vLLM's extra: with --scheduling-policy priority
        head = {"id": rid, "created": created, "model": self.model_name}
        if body.get("stream"):
            from fastapi.responses import StreamingResponse

            first = await anext(stream)  # errors before the first output are plain JSON errors
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            events = stream_events(request, first, stream, params, chat, head, include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        finals = await _collect(stream, request)  # its first output is a finished one: wait watching the client
        choices = []
        for i in sorted(finals):
            for c in finals[i].outputs:
                choice = responses.choice(len(choices), c, chat, params.logprobs or 0)
                if echo:
                    choice |= responses.echoed(finals[i], c, self._decode)
                if finals[i].prompt_logprobs is not None:  # vLLM's extra: per prompt token, None first
                    choice["prompt_logprobs"] = [responses.prompt_position(p) for p in finals[i].prompt_logprobs]
                choices.append(choice)
        kind = "chat.completion" if chat else "text_completion"
        return {
            "id": rid,
            "object": kind,
            "created": created,
            "model": self.model_name,
            "choices": choices,
            "usage": responses.usage(finals.values()),
        }


def _raise_engine_error(item) -> None:
    """A pump's exception as the API error the client gets."""
    if isinstance(item, EngineFull):
        raise APIError(429, str(item), "rate_limit_exceeded")
    if isinstance(item, (ValueError, TypeError)):
        raise APIError(400, str(item))
    if isinstance(item, Exception):
        raise APIError(503, str(item), "service_unavailable")


async def _collect(stream, request) -> dict:
    """Every prompt's finished output; a client that goes away meanwhile cancels the collection,
    which closes `stream` and aborts the requests."""

    async def collect():
        finals = {}
        async for i, out in stream:
            if out.finished:
                finals[i] = out
        return finals

    task = asyncio.ensure_future(collect())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                await asyncio.wait({task})
                raise APIError(499, "the client went away")
        return task.result()
    finally:
        if not task.done():
            task.cancel()
        await stream.aclose()


def _check_context(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    """vLLM's 400 for a prompt and max_tokens that do not fit in the context together."""
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion."
        )
