"""An OpenAI-compatible HTTP server over AsyncLLM (FastAPI; the `server` extra):
/v1/completions and /v1/chat/completions (SSE streaming in OpenAI's chunk format), /v1/models,
/tokenize and /detokenize, /health and Prometheus /metrics with vLLM's metric names. Bad input
gets an OpenAI-style JSON error (400/401/413/429/503) and never touches other requests; a client
that disconnects mid-stream has its request aborted and its blocks freed before the next step.

This module is the app and its routes; the rest lives by job: protocol (fields, limits,
errors), serving (a request's body, params and run on the engine), streaming (SSE chunks),
responses (choices, usage, logprobs), metrics (Prometheus)."""

import asyncio
import time
from contextlib import asynccontextmanager

from pagedbench.entrypoints.async_llm import AsyncLLM
from pagedbench.entrypoints.openai.metrics import ServerMetrics
from pagedbench.entrypoints.openai.protocol import (
    REQUEST_MODELS,
    APIError,
    ServerLimits,
    bool_or_none,
    chat_logprobs,
    completion_prompts,
    error_body,
    int_or_none,
    openapi_body,
)
from pagedbench.entrypoints.openai.serving import OpenAIServing
from pagedbench.model.chat_messages import MessageError
from pagedbench.model.tokenizer import chat_prompt
from pagedbench.sample.sampling_params import is_int

__all__ = ["APIError", "ServerLimits", "build_app"]


def build_app(
    llm: AsyncLLM, model_name: str, api_key: str | None = None, limits: ServerLimits | None = None, on_fatal=None
):
    """The app; `on_fatal(problem)` is called once the engine can no longer answer (serve stops then)."""
    from fastapi import Depends, FastAPI, Request
    from fastapi.responses import PlainTextResponse

    serving = OpenAIServing(llm, model_name, limits or ServerLimits(), ServerMetrics(llm, model_name))

    @asynccontextmanager
    async def lifespan(app):
        llm.start()
        watch = asyncio.ensure_future(_watch(llm, on_fatal)) if on_fatal is not None else None
        yield
        if watch is not None:
            watch.cancel()
        await llm.stop()

    app = FastAPI(title="pagedbench", lifespan=lifespan)
    _add_error_handlers(app)

    def authorize(request: Request) -> None:
        """/v1/* needs the API key when one is set. (A dependency, not an HTTP middleware: that
        would hide client disconnects from the routes.)"""
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise APIError(401, "invalid or missing API key", "authentication_error")

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(serving.metrics.render(), media_type="text/plain; version=0.0.4")

    _add_info_routes(app, serving, Depends(authorize))
    _add_tokenizer_routes(app, serving, Depends(authorize))
    _add_completion_routes(app, serving, Depends(authorize))
    return app


def _add_error_handlers(app) -> None:
    """OpenAI's JSON error body for our errors, bad bodies and unknown routes alike."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

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


def _add_info_routes(app, serving: OpenAIServing, authorized) -> None:
    from fastapi.responses import JSONResponse, PlainTextResponse

    llm, engine = serving.llm, serving.engine

    @app.get("/health")
    async def health():
        problem = fatal_problem(llm)
        if problem is not None:
            return JSONResponse(error_body(503, problem, "service_unavailable"), 503)
        return PlainTextResponse("ok")

    def card() -> dict:
        """vLLM's model card: `root` is where the weights and tokenizer are (a local directory, so an
        offline client such as GuideLLM can load the tokenizer from it; a preset's name otherwise)."""
        root = str(engine.model_path) if getattr(engine, "model_path", None) is not None else engine.config.model
        return {
            "id": serving.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "pagedbench",
            "root": root,
            "parent": None,
            "max_model_len": engine.max_model_len,
            "backend": engine.config.backend,  # bench-serve's label for this server
        }

    @app.get("/v1/models", dependencies=[authorized])
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[authorized])
    async def model(model_id: str):
        if model_id not in (serving.model_name, serving.model_name.lstrip("/")):  # a path id's leading / folds
            message = f"model {model_id!r} does not exist; this server has {serving.model_name!r}"
            raise APIError(404, message, "not_found_error", "model")
        return card()

    @app.get("/version")
    async def version():
        from importlib.metadata import version as installed

        return {"version": installed("pagedbench")}


def _add_tokenizer_routes(app, serving: OpenAIServing, authorized) -> None:
    from fastapi import Request

    engine = serving.engine

    @app.post("/tokenize", dependencies=[authorized], openapi_extra=openapi_body(REQUEST_MODELS["TokenizeRequest"]))
    async def tokenize(request: Request):
        """vLLM's: {"prompt": str} or {"messages": [...]} -> its token ids."""
        body = await serving.tokenizer_body(request, "TokenizeRequest")
        prompt = body.get("prompt")
        if "messages" in body:
            ids = _chat_prompt(engine.tokenizer, body["messages"])["prompt_token_ids"]
        elif isinstance(prompt, str):
            special = bool_or_none(body, "add_special_tokens")
            ids = engine.tokenizer.encode(prompt, add_special_tokens=special is not False)
        else:
            raise APIError(400, "prompt must be a string (or give messages)", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.get("/tokenizer_info", dependencies=[authorized])
    async def tokenizer_info():
        """vLLM's: the tokenizer's configuration, so a client (lm-eval's local-completions) can use
        the server's tokenizer through /tokenize and /detokenize instead of loading one."""
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        return tokenizer_config(engine.tokenizer, engine.max_model_len)

    @app.post("/detokenize", dependencies=[authorized], openapi_extra=openapi_body(REQUEST_MODELS["DetokenizeRequest"]))
    async def detokenize(request: Request):
        """vLLM's: {"tokens": [...]} -> {"prompt": their text}."""
        tokens = (await serving.tokenizer_body(request, "DetokenizeRequest")).get("tokens")
        vocab = engine.model_config.vocab_size
        if not isinstance(tokens, list) or not all(is_int(t) and 0 <= t < vocab for t in tokens):
            raise APIError(400, f"tokens must be a list of token ids in [0, {vocab})", param="tokens")
        return {"prompt": engine.tokenizer.decode(tokens)}


def _add_completion_routes(app, serving: OpenAIServing, authorized) -> None:
    from fastapi import Request

    @app.post(
        "/v1/completions", dependencies=[authorized], openapi_extra=openapi_body(REQUEST_MODELS["CompletionRequest"])
    )
    async def completions(request: Request):
        body = await serving.body_of(request, "CompletionRequest")
        prompts = completion_prompts(body.get("prompt"))
        logprobs = int_or_none(body.get("logprobs"), "logprobs")
        echo = bool_or_none(body, "echo") or False
        if echo and body.get("stream"):
            raise APIError(400, "echo is not supported with stream", param="echo")
        extra = {}
        if echo and logprobs is not None:  # the prompt's logprobs lead the choice's (lm-eval's loglikelihood)
            extra["prompt_logprobs"] = max(logprobs, body.get("prompt_logprobs") or 0)
        params = serving.sampling_params(body | extra, logprobs)
        return await serving.respond(request, body, prompts, params, chat=False, echo=echo)

    chat_body = openapi_body(REQUEST_MODELS["ChatCompletionRequest"])

    @app.post("/v1/chat/completions", dependencies=[authorized], openapi_extra=chat_body)
    async def chat(request: Request):
        body = await serving.body_of(request, "ChatCompletionRequest")
        prompt = _chat_prompt(serving.engine.tokenizer, body.get("messages"), "; use /v1/completions")
        if "max_completion_tokens" in body:
            body["max_tokens"] = body["max_completion_tokens"]
        # A chat reply may run to the end of the context (vLLM's default); a completion stops at 16.
        params = serving.sampling_params(body, chat_logprobs(body), default_max_tokens=None)
        return await serving.respond(request, body, [prompt], params, chat=True)


def tokenizer_config(tokenizer, max_model_len: int) -> dict:
    """vLLM's /tokenizer_info: the tokenizer's init arguments (as tokenizer_config.json has them,
    without file paths), its class, its special tokens as strings (or null), its chat template and
    the longest sequence this server takes as model_max_length."""
    config = {k: _json_value(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()}
    for path in ("vocab_file", "merges_file", "tokenizer_file"):
        config.pop(path, None)
    special = {name: _json_value(getattr(tokenizer, name, None)) for name in ("eos_token", "bos_token", "pad_token")}
    return (
        config
        | special
        | {
            "tokenizer_class": type(tokenizer).__name__,
            "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": max_model_len,
        }
    )


def _json_value(value):
    """A tokenizer setting as JSON: an AddedToken as its text, containers item by item, anything
    else JSON cannot hold as its string."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def fatal_problem(llm: AsyncLLM) -> str | None:
    """Why the server can no longer answer, or None: the engine's step loop stopped, or a
    data-parallel replica has ended (the front would route requests to it)."""
    if llm.error is not None:
        return f"engine stopped: {llm.error}"
    dead = getattr(llm.engine, "dead_replica", None)
    return dead() if dead is not None else None


async def _watch(llm: AsyncLLM, on_fatal, every_s: float = 1.0) -> None:
    """Calls on_fatal(problem) once the server can no longer answer (vLLM shuts its server down
    when the engine dies, rather than answer 503 for ever)."""
    while (problem := fatal_problem(llm)) is None:
        await asyncio.sleep(every_s)
    on_fatal(problem)


def _chat_prompt(tokenizer, messages, no_template_hint: str = "") -> dict:
    """chat_prompt's refusals as 400s: a message OpenAI would refuse names its field as the param
    (`messages[1].role`); a missing template or one the messages don't fit names `messages`."""
    try:
        return chat_prompt(tokenizer, messages)
    except MessageError as e:
        raise APIError(400, str(e), param=e.param) from None
    except ValueError as e:
        hint = no_template_hint if "no chat template" in str(e) else ""
        raise APIError(400, f"{e}{hint}", param="messages") from None
