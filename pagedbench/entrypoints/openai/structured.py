"""Structured outputs in a request body, in every form a vLLM client sends them: OpenAI's
`response_format` (json_object, json_schema), vLLM's `structured_outputs` object and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields. One form per request;
a bad one is a 400 naming its field."""

from pagedbench.entrypoints.openai.protocol import GUIDED_FIELDS, APIError
from pagedbench.sample.sampling_params import StructuredOutputsParams, structured_outputs_params

BACKENDS = (None, "auto", "xgrammar")  # guided_decoding_backend values: xgrammar is the one there is


def structured_outputs_of(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the request's constraint, the field it came from), or (None, None) without one."""
    if body.get("guided_decoding_backend") not in BACKENDS:
        backend = body["guided_decoding_backend"]
        message = f"guided_decoding_backend {backend!r} is not available; this server has xgrammar"
        raise APIError(400, message, param="guided_decoding_backend")
    if body.get("guided_whitespace_pattern") is not None:
        message = (
            "guided_whitespace_pattern is not supported by xgrammar; use structured_outputs.disable_any_whitespace"
        )
        raise APIError(400, message, param="guided_whitespace_pattern")
    given = [name for name in ("structured_outputs", *GUIDED_FIELDS) if body.get(name) is not None]
    fmt = _response_format(body.get("response_format"))
    given += ["response_format"] if fmt is not None else []
    if len(given) > 1:
        raise APIError(400, f"give one structured-output constraint, got {', '.join(given)}", param=given[1])
    if not given:
        return None, None
    field = given[0]
    try:
        if field == "response_format":
            params = StructuredOutputsParams(**fmt)
        elif field == "structured_outputs":
            if not isinstance(body[field], dict):
                raise TypeError("structured_outputs must be an object")
            params = structured_outputs_params(body[field])
        else:
            params = StructuredOutputsParams(**{GUIDED_FIELDS[field]: body[field]})
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), param=field) from None
    return params, field


def _response_format(fmt) -> dict | None:
    """OpenAI's response_format as StructuredOutputsParams fields (None for plain text)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise APIError(400, "response_format.json_schema needs a 'schema' object", param="response_format")
        return {"json": spec["schema"]}
    message = f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
    raise APIError(400, message, param="response_format")
