"""What the OpenAI-compatible server takes and refuses: request fields, limits, and errors in
OpenAI's JSON shape."""

from dataclasses import dataclass, fields
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from pagedbench.sample.sampling_params import SamplingParams, is_int

# Request fields passed to SamplingParams as they are (OpenAI's and vLLM's extensions); a logits
# processor is Python code, never a JSON value; structured outputs come in several forms (structured.py).
SAMPLING_FIELDS = {f.name for f in fields(SamplingParams) if not f.name.startswith("_")} - {
    "logprobs",
    "logits_processors",
    "structured_outputs",
    "guided_decoding",
    "output_kind",  # the server's (DELTA for streams, FINAL_ONLY otherwise)
}
# vLLM's older structured-output fields -> StructuredOutputsParams' (structured.py reads them all).
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_FIELDS = (
    "response_format",
    "structured_outputs",
    *GUIDED_FIELDS,
    "guided_decoding_backend",
    "guided_whitespace_pattern",
)
UNSUPPORTED = {"suffix": None, "tools": None, "functions": None, "use_beam_search": False}
# The fields of each endpoint's body besides the sampling ones. Values are checked where they are
# used (SamplingParams, the prompt forms); the models name the fields, refuse unknown ones as
# OpenAI does (a misspelt "max_token" is a 400, not 16 tokens) and give /openapi.json its schema.
COMMON = ("model", "stream", "stream_options", "user", "priority", *UNSUPPORTED, *STRUCTURED_FIELDS)
ENDPOINT_FIELDS = {
    "CompletionRequest": (*COMMON, *SAMPLING_FIELDS, "prompt", "logprobs", "echo"),
    "ChatCompletionRequest": (
        *COMMON,
        *SAMPLING_FIELDS,
        "messages",
        "logprobs",
        "top_logprobs",
        "max_completion_tokens",
    ),  # fmt: skip
    "TokenizeRequest": ("model", "prompt", "messages", "add_special_tokens"),
    "DetokenizeRequest": ("model", "tokens"),
}


def _request_model(name: str, names: tuple[str, ...]) -> type[BaseModel]:
    return create_model(name, __config__=ConfigDict(extra="forbid"), **{n: (Any, None) for n in sorted(set(names))})


REQUEST_MODELS = {name: _request_model(name, names) for name, names in ENDPOINT_FIELDS.items()}


def check_fields(body: dict, model: type[BaseModel]) -> None:
    """A 400 naming the fields `model` does not know (OpenAI refuses unknown fields)."""
    try:
        model.model_validate(body)
    except ValidationError as e:
        unknown = [".".join(map(str, err["loc"])) for err in e.errors() if err["type"] == "extra_forbidden"]
        if unknown:
            known = ", ".join(sorted(model.model_fields))
            raise APIError(400, f"unknown field(s) {', '.join(unknown)}; known: {known}", param=unknown[0]) from None
        raise APIError(400, str(e).splitlines()[0]) from None


def check_stream_and_user(body: dict) -> None:
    """400s where OpenAI and vLLM refuse: stream not a boolean, user not a string, stream_options
    not an object or given without stream."""
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise APIError(400, f"stream must be a boolean, got {body['stream']!r}", param="stream")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise APIError(400, f"user must be a string, got {body['user']!r}", param="user")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise APIError(400, "stream_options must be an object", param="stream_options")
        unknown = sorted(set(options) - {"include_usage"})
        if unknown:
            message = f"stream_options has unknown key(s) {', '.join(unknown)}; known: include_usage"
            raise APIError(400, message, param="stream_options")
        bool_or_none(options, "include_usage", "stream_options.include_usage")
        if not body.get("stream"):
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")


def openapi_body(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra`: its JSON body's schema (the routes read bodies themselves, to
    bound their size and see disconnects)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


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


def bool_or_none(body: dict, name: str, param: str | None = None) -> bool | None:
    """A boolean field's value (None when absent); anything else is a 400 naming it."""
    value, param = body.get(name), param or name
    if value is not None and not isinstance(value, bool):
        raise APIError(400, f"{param} must be true or false, got {value!r}", param=param)
    return value


def chat_logprobs(body: dict) -> int | None:
    """A chat request's top alternatives per token, or None without logprobs. As OpenAI and vLLM
    take them: `logprobs` a boolean, `top_logprobs` only beside `logprobs: true`."""
    wanted = bool_or_none(body, "logprobs")
    top = int_or_none(body.get("top_logprobs"), "top_logprobs")
    if top is not None and not wanted:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None


def int_or_none(value, name: str) -> int | None:
    if value is None or value is False:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"{name} must be an integer", param=name)
    return value
