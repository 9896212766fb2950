"""What the OpenAI-compatible server takes and refuses: request fields, limits, and errors in
OpenAI's JSON shape."""

from dataclasses import dataclass, fields

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


def int_or_none(value, name: str) -> int | None:
    if value is None or value is False:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"{name} must be an integer", param=name)
    return value
