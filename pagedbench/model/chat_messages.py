"""Chat messages checked as OpenAI's chat completions API checks them, for `LLM.chat`, the server's
/v1/chat/completions and /tokenize alike (all reach them through `model.tokenizer.chat_prompt`).

A conversation is a non-empty list of message objects. A message has a `role` (system, developer,
user, assistant or tool), `content` (a string or a non-empty list of text parts
`{"type": "text", "text": str}`; text parts are joined with newlines, as vLLM does, so a chat
template always receives a string) and optionally `name` (a string). An assistant message may
leave content out (or null) only when it carries `tool_calls`; a tool message needs
`tool_call_id`. Unknown fields are refused, as the server refuses unknown body fields; OpenAI's
fields this engine does not implement (image, audio and file parts, `audio`, `function_call`,
`refusal`) are refused as "not supported" rather than silently dropped. Each refusal is a
`MessageError` (a ValueError) whose one-line message starts with the field it is about, e.g.
`messages[1].role: 'wizard' is not one of system, developer, user, assistant, tool`."""

ROLES = ("system", "developer", "user", "assistant", "tool")
# The fields each role may carry besides role and content (OpenAI's request schema, plus `name`
# on every role as vLLM takes it).
FIELDS = {
    "system": ("name",),
    "developer": ("name",),
    "user": ("name",),
    "assistant": ("name", "tool_calls", "refusal", "audio", "function_call"),
    "tool": ("name", "tool_call_id"),
}
# OpenAI's fields that nothing here implements: accepted only when null.
UNSUPPORTED_FIELDS = ("refusal", "audio", "function_call")


class MessageError(ValueError):
    """A message that OpenAI's API would refuse; `param` names the field (`messages[1].role`)."""

    def __init__(self, param: str, problem: str):
        super().__init__(f"{param}: {problem}")
        self.param = param


def _only(obj: dict, known: tuple[str, ...], where: str, what: str) -> None:
    """Refuse a field `obj` may not carry, naming the ones it may."""
    for key in obj:
        if key not in known:
            raise MessageError(f"{where}.{key}", f"unknown field; {what} has {', '.join(sorted(known))}")


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def validate_messages(messages, param: str = "messages") -> list[dict]:
    """The conversation checked, as the messages a chat template receives: new dicts with `role`,
    `content` as a string (text parts joined), and `name`, `tool_calls`, `tool_call_id` where given.
    `param` names the list in errors. Raises MessageError."""
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else _type_name(messages)
        raise MessageError(param, f"must be a non-empty list of message objects, got {got}")
    return [_message(m, f"{param}[{i}]") for i, m in enumerate(messages)]


def _message(message, where: str) -> dict:
    if not isinstance(message, dict):
        raise MessageError(where, f"must be an object with a role and content, got {_type_name(message)}")
    if "role" not in message:
        raise MessageError(f"{where}.role", f"missing; one of {', '.join(ROLES)}")
    role = message["role"]
    if not isinstance(role, str) or role not in ROLES:
        raise MessageError(f"{where}.role", f"{role!r} is not one of {', '.join(ROLES)}")
    _only(message, ("role", "content", *FIELDS[role]), where, f"a {role} message")
    for key in UNSUPPORTED_FIELDS:
        if message.get(key) is not None:
            raise MessageError(f"{where}.{key}", "is not supported")
    out = {"role": role}
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        out["tool_calls"] = _tool_calls(tool_calls, f"{where}.tool_calls")
    content = message.get("content")
    if content is None and role == "assistant" and tool_calls:
        out["content"] = ""  # what vLLM gives a template for an assistant turn of tool calls only
    elif content is None:
        problem = "must be a string or a list of text parts, got null" if "content" in message else "missing"
        hint = " (an assistant message may omit it or have null only with tool_calls)" if role == "assistant" else ""
        raise MessageError(f"{where}.content", problem + hint)
    else:
        out["content"] = _content(content, f"{where}.content")
    if "name" in message:
        if not isinstance(message["name"], str):
            raise MessageError(f"{where}.name", f"must be a string, got {_type_name(message['name'])}")
        out["name"] = message["name"]
    if role == "tool":
        if "tool_call_id" not in message:
            raise MessageError(f"{where}.tool_call_id", "missing; a tool message answers the tool call of this id")
        if not isinstance(message["tool_call_id"], str):
            got = _type_name(message["tool_call_id"])
            raise MessageError(f"{where}.tool_call_id", f"must be a string, got {got}")
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MessageError(where, f"must be a string or a list of text parts, got {_type_name(content)}")
    if not content:
        raise MessageError(where, "must not be an empty list")
    texts = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        if not isinstance(part, dict):
            raise MessageError(at, f'must be a text part {{"type": "text", "text": ...}}, got {_type_name(part)}')
        kind = part.get("type")
        if kind != "text":
            problem = "missing" if kind is None else f"{kind!r} content parts are not supported (only 'text')"
            raise MessageError(f"{at}.type", problem)
        _only(part, ("type", "text"), at, "a text part")
        if not isinstance(part.get("text"), str):
            got = "missing" if "text" not in part else f"must be a string, got {_type_name(part['text'])}"
            raise MessageError(f"{at}.text", got)
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(tool_calls, where: str) -> list[dict]:
    """OpenAI's function tool calls: [{"id": str, "type": "function", "function": {"name": str,
    "arguments": str}}], passed to the template as they are."""
    if not isinstance(tool_calls, list):
        raise MessageError(where, f"must be a list of tool calls, got {_type_name(tool_calls)}")
    for i, call in enumerate(tool_calls):
        at = f"{where}[{i}]"
        if not isinstance(call, dict):
            raise MessageError(at, f"must be an object with id, type and function, got {_type_name(call)}")
        _only(call, ("id", "type", "function"), at, "a tool call")
        if not isinstance(call.get("id"), str):
            raise MessageError(f"{at}.id", "missing" if "id" not in call else "must be a string")
        if call.get("type") != "function":
            kind = call.get("type")
            raise MessageError(f"{at}.type", "missing" if kind is None else f"{kind!r} is not 'function'")
        function = call.get("function")
        if not isinstance(function, dict):
            raise MessageError(f"{at}.function", "must be an object with name and arguments")
        _only(function, ("name", "arguments"), f"{at}.function", "a function call")
        for key in ("name", "arguments"):
            if not isinstance(function.get(key), str):
                raise MessageError(f"{at}.function.{key}", "missing" if key not in function else "must be a string")
    return tool_calls
