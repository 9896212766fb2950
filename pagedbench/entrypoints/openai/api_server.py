"""An OpenAI-compatible HTTP server over AsyncLLM (FastAPI; the `server` extra):
/v1/completions and /v1/chat/completions (SSE streaming in OpenAI's chunk format), /v1/models,
/health and Prometheus /metrics with vLLM's metric names. Bad input gets an OpenAI-style JSON
error (400/401/413/429/503) and never touches other requests; a client that disconnects
mid-stream has its request aborted and its blocks freed before the next step."""

import asyncio
import itertools
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields

from pagedbench.engine.outputs import RequestOutput
from pagedbench.entrypoints.async_llm import AsyncLLM, EngineFull
from pagedbench.model.tokenizer import chat_prompt
from pagedbench.sample.sampling_params import SamplingParams, is_int

# Request fields passed to SamplingParams as they are (OpenAI's and vLLM's extensions).
SAMPLING_FIELDS = {f.name for f in fields(SamplingParams) if not f.name.startswith("_")} - {"logprobs"}
UNSUPPORTED = {"suffix": None, "echo": False, "tools": None, "functions": None}


@dataclass(slots=True)
class ServerLimits:
    max_body_bytes: int = 1 << 20
    max_tokens: int | None = None  # default: the engine's max_model_len
    max_n: int = 16


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def build_app(llm: AsyncLLM, model_name: str, api_key: str | None = None, limits: ServerLimits | None = None):
    from fastapi import Depends, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    limits = limits or ServerLimits()
    engine = llm.engine
    metrics = ServerMetrics(llm)

    @asynccontextmanager
    async def lifespan(app):
        llm.start()
        yield
        await llm.stop()

    app = FastAPI(title="pagedbench", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(error_body(e.status, str(e), e.kind, e.param), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e):
        return JSONResponse(error_body(400, str(e), "invalid_request_error"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):  # unknown route (404), wrong method (405): OpenAI's JSON too
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(e.status_code, str(e.detail), kind), e.status_code, headers=e.headers)

    def authorize(request: Request) -> None:
        """/v1/* needs the API key when one is set. (A dependency, not an HTTP middleware: that
        would hide client disconnects from the routes.)"""
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise APIError(401, "invalid or missing API key", "authentication_error")

    @app.get("/health")
    async def health():
        if llm.error is not None:
            return JSONResponse(error_body(503, f"engine stopped: {llm.error}", "service_unavailable"), 503)
        return PlainTextResponse("ok")

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "pagedbench"}
        card["backend"] = engine.config.backend  # bench-serve's label for this server
        return {"object": "list", "data": [card | {"max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    async def body_of(request: Request) -> dict:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > limits.max_body_bytes:
            raise APIError(413, f"request body of {size} bytes is over the limit of {limits.max_body_bytes}")
        raw = bytearray()
        async for piece in request.stream():  # chunked uploads too: stop reading past the limit
            raw += piece
            if len(raw) > limits.max_body_bytes:
                raise APIError(413, f"request body is over the limit of {limits.max_body_bytes} bytes")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        if body.get("model") not in (None, model_name):
            raise APIError(
                404,
                f"model {body['model']!r} does not exist; this server has {model_name!r}",
                "not_found_error",
                "model",
            )
        for name, default in UNSUPPORTED.items():
            if body.get(name, default) != default:
                raise APIError(400, f"{name} is not supported", param=name)
        return body

    def sampling_params(body: dict, logprobs: int | None, default_max_tokens: int | None = 16) -> SamplingParams:
        """max_tokens None: up to max_model_len, or the server's max_tokens limit."""
        kwargs = {k: v for k, v in body.items() if k in SAMPLING_FIELDS}
        kwargs.setdefault("max_tokens", default_max_tokens)
        if isinstance(kwargs.get("logit_bias"), dict):  # JSON object keys are strings
            try:
                kwargs["logit_bias"] = {int(k): v for k, v in kwargs["logit_bias"].items()}
            except ValueError:
                raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
        if kwargs["max_tokens"] is None:
            kwargs["max_tokens"] = limits.max_tokens
        limit = limits.max_tokens or engine.max_model_len
        if isinstance(kwargs["max_tokens"], int) and kwargs["max_tokens"] > limit:
            raise APIError(400, f"max_tokens={kwargs['max_tokens']} is over the limit of {limit}", param="max_tokens")
        if isinstance(kwargs.get("n"), int) and kwargs["n"] > limits.max_n:
            raise APIError(400, f"n={kwargs['n']} is over the limit of {limits.max_n}", param="n")
        try:
            return SamplingParams(**kwargs, logprobs=logprobs)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None

    async def run(prompts: list, params: SamplingParams, priority: int = 0):
        """One engine request per prompt, all validated before any is queued; yields
        (prompt index, RequestOutput) as they progress."""
        try:
            engine.validate_priority(priority)
            for prompt in prompts:
                engine.validate_request(engine.tokenize(prompt)[1], params)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None
        if llm.error is not None:
            raise APIError(503, f"the engine stopped: {llm.error}", "service_unavailable")
        if llm.num_requests + len(prompts) > llm.max_pending:
            raise APIError(
                429, f"{llm.num_requests} requests in flight, the limit is {llm.max_pending}", "rate_limit_exceeded"
            )
        queue: asyncio.Queue = asyncio.Queue()
        base = f"cmpl-{uuid.uuid4().hex}"

        async def pump(i, prompt):
            try:
                async for out in llm.generate(prompt, params, f"{base}-{i}", priority):
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
                elif isinstance(item, EngineFull):
                    raise APIError(429, str(item), "rate_limit_exceeded")
                elif isinstance(item, (ValueError, TypeError)):
                    raise APIError(400, str(item))
                elif isinstance(item, Exception):
                    raise APIError(503, str(item), "service_unavailable")
                else:
                    if item.finished:
                        metrics.finished(item)
                    yield i, item
        finally:  # a client gone, or done: cancelling a pump closes its generator, which aborts the request
            for task in tasks:
                task.cancel()

    async def tokenizer_body(request: Request) -> dict:
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        return await body_of(request)

    @app.post("/tokenize", dependencies=[Depends(authorize)])
    async def tokenize(request: Request):
        """vLLM's: {"prompt": str} or {"messages": [...]} -> its token ids."""
        body = await tokenizer_body(request)
        prompt = body.get("prompt")
        if "messages" in body:
            try:
                ids = chat_prompt(engine.tokenizer, body["messages"])["prompt_token_ids"]
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
        elif isinstance(prompt, str):
            ids = engine.tokenizer.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))
        else:
            raise APIError(400, "prompt must be a string (or give messages)", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize", dependencies=[Depends(authorize)])
    async def detokenize(request: Request):
        """vLLM's: {"tokens": [...]} -> {"prompt": their text}."""
        tokens = (await tokenizer_body(request)).get("tokens")
        vocab = engine.model_config.vocab_size
        if not isinstance(tokens, list) or not all(is_int(t) and 0 <= t < vocab for t in tokens):
            raise APIError(400, f"tokens must be a list of token ids in [0, {vocab})", param="tokens")
        return {"prompt": engine.tokenizer.decode(tokens)}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request):
        body = await body_of(request)
        prompts = completion_prompts(body.get("prompt"))
        params = sampling_params(body, _int_or_none(body.get("logprobs"), "logprobs"))
        return await respond(request, body, prompts, params, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(request: Request):
        body = await body_of(request)
        try:
            prompt = chat_prompt(engine.tokenizer, body.get("messages"))
        except ValueError as e:
            hint = "; use /v1/completions" if "template" in str(e) else ""
            raise APIError(400, f"{e}{hint}", param="messages") from None
        if "max_completion_tokens" in body:
            body["max_tokens"] = body["max_completion_tokens"]
        top = _int_or_none(body.get("top_logprobs"), "top_logprobs")
        # A chat reply may run to the end of the context (vLLM's default); a completion stops at 16.
        params = sampling_params(body, (top or 0) if body.get("logprobs") else None, default_max_tokens=None)
        return await respond(request, body, [prompt], params, chat=True)

    async def respond(request, body, prompts, params, chat: bool):
        kind = "chat.completion" if chat else "text_completion"
        created, rid = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if body.get("stream") and params.best_of != params.n:
            raise APIError(400, "best_of != n cannot be streamed (the best samples are known only at the end)")
        stream = run(prompts, params, body.get("priority", 0))  # vLLM's extra: with --scheduling-policy priority
        first = await anext(stream)  # errors before the first output are plain JSON errors
        if not body.get("stream"):
            finals = await _collect(first, stream, request)
            choices, usage = [], _usage(finals.values())
            for i in sorted(finals):
                for c in finals[i].outputs:
                    choice = _choice(len(choices), c, chat, params.logprobs or 0)
                    if finals[i].prompt_logprobs is not None:  # vLLM's extra: per prompt token, None first
                        choice["prompt_logprobs"] = [_prompt_position(p) for p in finals[i].prompt_logprobs]
                    choices.append(choice)
            return {
                "id": rid,
                "object": kind,
                "created": created,
                "model": model_name,
                "choices": choices,
                "usage": usage,
            }

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        holdback = max(map(len, params.stop), default=1) - 1

        async def events():
            sent: dict[tuple[int, int], int] = {}  # text characters streamed per choice
            tokens_sent: dict[tuple[int, int], int] = {}
            finals = {}
            chunk_kind = "chat.completion.chunk" if chat else "text_completion"
            try:
                async for i, out in _achain(first, stream):
                    if await request.is_disconnected():
                        return  # closing `stream` aborts the requests
                    choices = []
                    for c in out.outputs:
                        key = (i, c.index)
                        index = i * params.n + c.index
                        # Hold back what could be the start of a stop string until the end (vLLM's rule).
                        end = len(c.text) if out.finished else max(sent.get(key, 0), len(c.text) - holdback)
                        delta = c.text[sent.get(key, 0) : end]
                        if chat and key not in sent:
                            choices.append(
                                {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                            )
                        sent[key] = end
                        reason = c.finish_reason if out.finished else None
                        done_tokens = tokens_sent.get(key, 0)
                        new_tokens = len(c.token_ids) > done_tokens
                        tokens_sent[key] = len(c.token_ids)
                        if new_tokens or reason:  # a chunk per token, as vLLM (text may lag a partial character)
                            piece = {"content": delta} if chat else {"text": delta}
                            choice = {"index": index, "delta": piece} if chat else {"index": index, **piece}
                            logprobs = _logprobs(c, chat, params.logprobs or 0, done_tokens)  # the new tokens'
                            choices.append(choice | {"logprobs": logprobs, "finish_reason": reason})
                    if out.finished:
                        finals[i] = out
                    for choice in choices:  # one choice per chunk, as vLLM and OpenAI send them
                        chunk = {
                            "id": rid,
                            "object": chunk_kind,
                            "created": created,
                            "model": model_name,
                            "choices": [choice],
                        }
                        yield f"data: {json.dumps(chunk)}\n\n"
                if include_usage:
                    chunk = {"id": rid, "object": chunk_kind, "created": created, "model": model_name, "choices": []}
                    yield f"data: {json.dumps(chunk | {'usage': _usage(finals.values())})}\n\n"
                yield "data: [DONE]\n\n"
            except APIError as e:
                yield f"data: {json.dumps(error_body(e.status, str(e), e.kind))}\n\n"
            finally:
                await stream.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def completion_prompts(prompt) -> list:
    """OpenAI's prompt forms: a string, a list of token ids, or a list of either (a batch)."""

    def one(p):
        if isinstance(p, str):
            return p
        if isinstance(p, list) and p and all(map(is_int, p)):
            return {"prompt_token_ids": p}
        raise APIError(400, "prompt must be a string, a list of token ids, or a list of those", param="prompt")

    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [one(p) for p in prompt]
    return [one(prompt)]


def _int_or_none(value, name: str) -> int | None:
    if value is None or value is False:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"{name} must be an integer", param=name)
    return value


async def _collect(first, stream, request) -> dict:
    """Every prompt's finished output; a client that goes away meanwhile cancels the collection,
    which closes `stream` and aborts the requests."""

    async def collect():
        finals = {}
        async for i, out in _achain(first, stream):
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


async def _achain(first, stream):
    yield first
    async for item in stream:
        yield item


def _usage(outputs) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _choice(index: int, c, chat: bool, top_k: int) -> dict:
    common = {"index": index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    logprobs = _logprobs(c, chat, top_k)
    if chat:
        return common | {"message": {"role": "assistant", "content": c.text}, "logprobs": logprobs}
    return common | {"text": c.text, "logprobs": logprobs}


def _prompt_position(entry: dict | None) -> dict | None:
    """vLLM's prompt_logprobs entry: token id -> {logprob, rank, decoded_token}."""
    if entry is None:
        return None
    return {
        str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token} for t, lp in entry.items()
    }


def _logprobs(c, chat: bool, top_k: int, start: int = 0) -> dict | None:
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


def _chat_logprobs(entries: list[dict], token_ids: list[int], top_k: int) -> dict:
    content = []
    for entry, t in zip(entries, token_ids):
        ranked = sorted(entry.items(), key=lambda item: item[1].rank)
        top = [{"token": _token_text(entry, i), "logprob": lp.logprob} for i, lp in ranked if lp.rank <= top_k]
        content.append({"token": _token_text(entry, t), "logprob": entry[t].logprob, "top_logprobs": top})
    return {"content": content}


class EngineCounters:
    """Token counters read from the engine when scraped (they count what the engine ran, aborted
    requests included)."""

    def __init__(self, llm: AsyncLLM):
        self.llm = llm

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        st = self.llm.engine.stats
        yield CounterMetricFamily("vllm:prompt_tokens", "Prefill tokens processed", value=st.prompt_tokens)
        yield CounterMetricFamily("vllm:generation_tokens", "Generation tokens produced", value=st.generation_tokens)
        yield CounterMetricFamily("vllm:num_preemptions", "Cumulative preemptions", value=st.preemptions)
        bm = self.llm.engine.block_manager
        yield CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up", value=bm.prefix_queries)
        yield CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found cached", value=bm.prefix_hits)


class ServerMetrics:
    """Prometheus metrics with vLLM's names where the meaning matches."""

    def __init__(self, llm: AsyncLLM):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        sched, bm = llm.engine.scheduler, llm.engine.block_manager

        def requests(queue) -> int:  # a request's samples or beams count once
            return len({s.request_id for s in queue})

        running = Gauge("vllm:num_requests_running", "Requests running on the engine", registry=self.registry)
        running.set_function(lambda: requests(sched.running))
        waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", registry=self.registry)
        waiting.set_function(lambda: requests(sched.waiting))
        swapped = Gauge("vllm:num_requests_swapped", "Requests swapped out to CPU", registry=self.registry)
        swapped.set_function(lambda: requests(sched.swapped))
        usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent", registry=self.registry)
        usage.set_function(lambda: bm.num_used_blocks / bm.num_blocks)
        self.registry.register(EngineCounters(llm))
        self.success = Counter("vllm:request_success", "Finished requests", ["finished_reason"], registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", registry=self.registry)
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds", "Mean time per output token", registry=self.registry
        )
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between token steps", registry=self.registry)

    def finished(self, out: RequestOutput) -> None:
        self.success.labels(finished_reason=out.outputs[0].finish_reason if out.outputs else "unknown").inc()
        m = out.metrics
        if m is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            self.e2e.observe(m.finished_time - m.arrival_time)
            if len(m.token_times) > 1:
                self.tpot.observe((m.finished_time - m.first_token_time) / (len(m.token_times) - 1))
            for earlier, later in zip(m.token_times, m.token_times[1:]):
                self.itl.observe(later - earlier)

    def render(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()
