"""Chat messages are checked as OpenAI's chat completions API checks them, by one validator that
LLM.chat, /v1/chat/completions and /tokenize share: a bad message is a ValueError (library) or a
400 naming the field (server), never a 200 or a 500, and the engine keeps serving."""

import importlib.util

import pytest

from pagedbench import LLM, SamplingParams
from pagedbench.model.chat_messages import MessageError, validate_messages
from pagedbench.model.tokenizer import chat_prompt, preset_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
USER = {"role": "user", "content": "hi"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
ROLES = "system, developer, user, assistant, tool"


def parts(*texts):
    return [{"type": "text", "text": t} for t in texts]


@pytest.mark.parametrize(
    "messages,expected",
    [
        ([USER], [USER]),
        (
            [{"role": r, "content": "x"} for r in ("system", "developer", "user", "assistant")],
            [{"role": r, "content": "x"} for r in ("system", "developer", "user", "assistant")],
        ),
        ([{"role": "user", "content": ""}], [{"role": "user", "content": ""}]),  # empty text is still text
        ([{"role": "user", "content": parts("a", "b")}], [{"role": "user", "content": "a\nb"}]),  # parts joined
        ([{"role": "system", "content": parts("only")}], [{"role": "system", "content": "only"}]),
        ([{"role": "user", "content": "x", "name": "ann"}], [{"role": "user", "content": "x", "name": "ann"}]),
        (  # an assistant turn of tool calls only: content left out, or null; the template gets ""
            [USER, {"role": "assistant", "tool_calls": [CALL]}],
            [USER, {"role": "assistant", "content": "", "tool_calls": [CALL]}],
        ),
        (
            [{"role": "assistant", "content": None, "tool_calls": [CALL], "refusal": None, "function_call": None}],
            [{"role": "assistant", "content": "", "tool_calls": [CALL]}],
        ),
        (
            [{"role": "assistant", "content": "let me add", "tool_calls": [CALL]}],
            [{"role": "assistant", "content": "let me add", "tool_calls": [CALL]}],
        ),
        (
            [{"role": "tool", "content": parts("2"), "tool_call_id": "call_1"}],
            [{"role": "tool", "content": "2", "tool_call_id": "call_1"}],
        ),
    ],
)
def test_accepted_messages_reach_the_template_with_string_content(messages, expected):
    assert validate_messages(messages) == expected


@pytest.mark.parametrize(
    "messages,param,problem",
    [
        ([], "messages", "must be a non-empty list of message objects, got an empty list"),
        (None, "messages", "got null"),
        ({"role": "user", "content": "hi"}, "messages", "got dict"),
        ("hi", "messages", "got str"),
        ([USER, "hi"], "messages[1]", "must be an object with a role and content, got str"),
        ([USER, {"role": "wizard", "content": "x"}], "messages[1].role", f"'wizard' is not one of {ROLES}"),
        ([{"role": "function", "content": "x"}], "messages[0].role", "'function' is not one of"),
        ([{"role": 3, "content": "x"}], "messages[0].role", "3 is not one of"),
        ([{"content": "x"}], "messages[0].role", "missing; one of"),
        ([{"role": "user"}], "messages[0].content", "missing"),
        ([{"role": "user", "content": None}], "messages[0].content", "got null"),
        ([{"role": "system", "content": 5}], "messages[0].content", "a string or a list of text parts, got int"),
        ([{"role": "user", "content": []}], "messages[0].content", "must not be an empty list"),
        ([{"role": "user", "content": ["a"]}], "messages[0].content[0]", "must be a text part"),
        (
            [{"role": "user", "content": [*parts("look"), IMAGE]}],
            "messages[0].content[1].type",
            "'image_url' content parts are not supported (only 'text')",
        ),
        ([{"role": "user", "content": [{"text": "a"}]}], "messages[0].content[0].type", "missing"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text", "missing"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0].text", "got int"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a", "cache": 1}]}],
            "messages[0].content[0].cache",
            "unknown field",
        ),
        ([{"role": "assistant"}], "messages[0].content", "missing (an assistant message may omit it"),
        ([{"role": "assistant", "content": None}], "messages[0].content", "only with tool_calls"),
        ([{"role": "assistant", "tool_calls": []}], "messages[0].content", "only with tool_calls"),
        ([{"role": "assistant", "tool_calls": "add"}], "messages[0].tool_calls", "must be a list of tool calls"),
        ([{"role": "assistant", "tool_calls": [CALL | {"type": "x"}]}], "messages[0].tool_calls[0].type", "'x'"),
        ([{"role": "assistant", "tool_calls": [{"type": "function"}]}], "messages[0].tool_calls[0].id", "missing"),
        (
            [{"role": "assistant", "tool_calls": [CALL | {"function": {"name": "add"}}]}],
            "messages[0].tool_calls[0].function.arguments",
            "missing",
        ),
        ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages[0].tool_calls", "unknown field"),
        ([{"role": "tool", "content": "2"}], "messages[0].tool_call_id", "missing"),
        ([{"role": "tool", "content": "2", "tool_call_id": 7}], "messages[0].tool_call_id", "must be a string"),
        ([{"role": "user", "content": "x", "name": 1}], "messages[0].name", "must be a string, got int"),
        (
            [{"role": "user", "content": "x", "colour": "red"}],
            "messages[0].colour",
            "unknown field; a user message has content, name, role",
        ),
        ([{"role": "assistant", "content": "x", "audio": {"id": "a"}}], "messages[0].audio", "is not supported"),
        ([{"role": "assistant", "content": "x", "refusal": "no"}], "messages[0].refusal", "is not supported"),
    ],
)
def test_refused_messages_name_the_field(messages, param, problem):
    with pytest.raises(MessageError) as raised:
        validate_messages(messages)
    assert raised.value.param == param
    message = str(raised.value)
    assert message.startswith(f"{param}: ") and problem in message and "\n" not in message
    assert isinstance(raised.value, ValueError)  # what the library raises


def test_the_param_prefix_names_a_conversation_in_a_batch():
    with pytest.raises(MessageError, match=r"^messages\[2\]\[0\]\.role: "):
        validate_messages([{"role": "x", "content": "y"}], "messages[2]")


def test_the_preset_template_gets_strings():
    """A template that prints content as it is gets joined parts, and "" (not None) for a turn of
    tool calls only."""
    tok = preset_tokenizer(vocab_size=300, eos_token_ids=[2])
    text = chat_prompt(tok, [{"role": "user", "content": parts("a", "b")}, {"role": "assistant", "tool_calls": [CALL]}])
    assert text["prompt"] == "<|user|>\na\nb\n<|assistant|>\n\n<|assistant|>\n"
    with pytest.raises(ValueError, match=r"^messages\[0\]\.role: 'wizard' is not one of"):
        chat_prompt(tok, [{"role": "wizard", "content": "x"}])


@pytest.fixture(scope="module")
def llm(chat_model):
    return LLM(str(chat_model), device="cpu", dtype="float32")


def test_llm_chat_refuses_bad_messages_before_queueing_any(llm):
    with pytest.raises(ValueError, match=rf"^messages\[1\]\.role: 'wizard' is not one of {ROLES}$"):
        llm.chat([USER, {"role": "wizard", "content": "abracadabra"}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content: missing$"):
        llm.chat([{"role": "user"}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^messages\[1\]\[0\]\.content\[0\]\.type: 'image_url' .* not supported"):
        llm.chat([[USER], [{"role": "user", "content": [IMAGE]}]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^messages: must be a non-empty list"):
        llm.chat([], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    joined = llm.chat([{"role": "user", "content": parts("the quick", "brown fox")}], GREEDY, use_tqdm=False)
    plain = llm.chat([{"role": "user", "content": "the quick\nbrown fox"}], GREEDY, use_tqdm=False)
    assert joined[0].prompt == plain[0].prompt and joined[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def http(llm):
    """The server's app in-process (FastAPI's TestClient runs its lifespan, so the step loop runs),
    over the module's engine."""
    pytest.importorskip("fastapi")
    if not any(importlib.util.find_spec(m) for m in ("httpx2", "httpx")):  # what TestClient runs on
        pytest.skip("the test client needs httpx2 (or httpx)")
    from fastapi import testclient

    from pagedbench.entrypoints.async_llm import AsyncLLM
    from pagedbench.entrypoints.openai.api_server import build_app

    with testclient.TestClient(build_app(AsyncLLM(llm.engine), "tiny")) as client:
        yield client


@pytest.mark.parametrize(
    "messages,param,problem",
    [
        ([USER, {"role": "wizard", "content": "x"}], "messages[1].role", f"'wizard' is not one of {ROLES}"),
        ([{"role": "user"}], "messages[0].content", "missing"),
        ([{"role": "user", "content": [IMAGE]}], "messages[0].content[0].type", "not supported"),
        ([{"role": "tool", "content": "2"}], "messages[0].tool_call_id", "missing"),
        ([{"role": "user", "content": "x", "colour": "red"}], "messages[0].colour", "unknown field"),
        ([], "messages", "non-empty list"),
        (None, "messages", "non-empty list"),
    ],
)
def test_server_answers_bad_messages_with_a_400_naming_the_field(http, messages, param, problem):
    body = {"messages": messages, "max_tokens": 2} if messages is not None else {"max_tokens": 2}
    requests = [("/v1/chat/completions", body), ("/v1/chat/completions", body | {"stream": True})]
    for path, json in [*requests, ("/tokenize", {"messages": messages})]:
        r = http.post(path, json=json)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["code"] == 400 and error["type"] == "invalid_request_error"
        assert error["message"].startswith(f"{param}: ") and problem in error["message"]
    ok = http.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 2})  # the engine serves on
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"


def test_server_joins_text_parts_and_takes_tool_turns(http):
    as_parts = [{"role": "user", "content": parts("the quick", "brown fox")}]
    as_text = [{"role": "user", "content": "the quick\nbrown fox"}]
    tokens = [http.post("/tokenize", json={"messages": m}).json()["tokens"] for m in (as_parts, as_text)]
    assert tokens[0] == tokens[1]
    turns = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "2", "tool_call_id": "call_1", "name": "add"},
    ]
    r = http.post("/v1/chat/completions", json={"messages": turns, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
