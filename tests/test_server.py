"""The OpenAI-compatible server, as a real process on loopback: the official openai client
completes, streams and chats; greedy text equals offline LLM.generate; bad requests get the
right status and an OpenAI-style JSON error; a client that disconnects mid-stream has its
request aborted and its blocks freed; 200 concurrent streams with random disconnects leave the
server up, every completed stream well-formed and no block held."""

import asyncio
import http.client
import importlib.util
import json
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import pytest
import torch

from pagedbench import LLM, SamplingParams

pytestmark = pytest.mark.slow  # a server process per module: the full tier
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
aiohttp = pytest.importorskip("aiohttp")

KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, *extra):
    """A `pagedbench serve` process and its URL. Its output goes to a file (`server_output`), never
    to a pipe nobody reads: the access log's line per request would fill it and stall the server."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedbench", "serve", str(model_dir), "--port", str(port), "--device", "cpu"]
    log = tempfile.NamedTemporaryFile(prefix="pagedbench-serve-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen([*cmd, "--dtype", "fp32", *extra], stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = log.name
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return proc, url
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(server_output(proc)) from None
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not come up")


def server_output(proc, timeout: float = 30) -> str:
    """What the server printed, once it has exited (terminated here if it still runs)."""
    if proc.poll() is None:
        proc.terminate()
    proc.wait(timeout=timeout)
    return open(proc.log_path).read()


@pytest.fixture(scope="module")
def server(chat_model):
    compact = '{"disable_any_whitespace": true}'  # random weights would write JSON whitespace to max_tokens
    proc, url = start_server(
        chat_model, "--api-key", KEY, "--num-blocks", "600", "--max-num-seqs", "64", "--max-n", "4",
        "--structured-outputs-config", compact,
    )  # fmt: skip
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY)


def metrics(url) -> dict[str, float]:
    """Every vllm: series by name (and labels other than model_name, which every one must carry)."""
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    series = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name, value = line.rsplit(" ", 1)
            assert 'model_name="' in name, f"{name}: no model_name label"
            name = re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "").replace(",}", "}")
            series[name] = float(value)
    return series


def wait_idle(url, timeout=30.0) -> dict:
    deadline = time.time() + timeout
    while True:
        m = metrics(url)
        idle = m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == m["vllm:kv_cache_usage_perc"] == 0
        if idle or time.time() > deadline:
            return m
        time.sleep(0.05)


def test_openai_client_completes_streams_and_chats(client, chat_model, server):
    offline = LLM(str(chat_model), device="cpu", dtype="float32")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = "the quick brown fox"
    expected = offline.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]

    done = client.completions.create(
        model=str(chat_model), prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.choices[0].text == expected.text and done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 12 and done.usage.prompt_tokens == len(
        offline.engine.tokenizer.encode(prompt)
    )

    chunks = list(
        client.completions.create(
            model=str(chat_model),
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"

    by_ids = client.completions.create(model=str(chat_model), prompt=[5, 6, 7], max_tokens=4, temperature=0, n=1)
    assert by_ids.usage.prompt_tokens == 3

    messages = [{"role": "user", "content": "hello world"}]
    chat = client.chat.completions.create(
        model=str(chat_model), messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    tok = offline.engine.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    expected_chat = offline.generate(
        [{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == expected_chat[0].outputs[0].text
    streamed = list(
        client.chat.completions.create(
            model=str(chat_model),
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert streamed[0].choices[0].delta.role == "assistant" and streamed[-1].choices[0].finish_reason == "length"
    assert all(len(c.choices) == 1 for c in streamed)  # a client reading choices[0] misses nothing
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content

    samples = client.completions.create(
        model=str(chat_model), prompt=prompt, max_tokens=6, n=3, seed=1, temperature=1.0
    )
    assert sorted(c.index for c in samples.choices) == [0, 1, 2]
    listed = client.models.list()
    assert [m.id for m in listed.data] == [str(chat_model)]


@pytest.mark.parametrize(
    "body,status,message",
    [
        ({"prompt": "hi", "temperature": -1}, 400, "temperature must be >= 0"),
        ({"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens=100000 is over the limit"),
        ({"prompt": "hi", "n": 8}, 400, "n=8 is over the limit of 4"),
        ({"prompt": [1, "x"]}, 400, "prompt must be"),
        ({"prompt": [999999]}, 400, "outside the vocabulary"),
        ({"prompt": "hi", "model": "other"}, 404, "does not exist"),
        ({"prompt": "hi", "echo": True, "stream": True}, 400, "echo is not supported with stream"),
        ({"prompt": "hi", "echo": "yes"}, 400, "echo must be true or false"),
        ({"prompt": "hi", "max_token": 100}, 400, "unknown field(s) max_token; known: "),  # OpenAI refuses it
        (
            {"prompt": list(range(3, 203)), "max_tokens": 400},
            400,
            "maximum context length is 512 tokens. However, you requested 600 tokens "
            "(200 in the messages, 400 in the completion)",
        ),
        ({"prompt": "hi", "logprobs": "many"}, 400, "logprobs must be an integer"),
        ({"prompt": "hi", "stream": "yes"}, 400, "stream must be a boolean"),
        ({"prompt": "hi", "user": 5}, 400, "user must be a string"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "only allowed when stream is true"),
        ({"prompt": "hi", "stream": True, "stream_options": 3}, 400, "stream_options must be an object"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, message):
    err = post(server, "/v1/completions", json.dumps(body).encode())
    assert err[0] == status and message in err[1]["error"]["message"] and err[1]["error"]["code"] == status


SCHEMA = {
    "type": "object",
    "properties": {"word": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["word", "n"],
}


def test_structured_outputs_round_trip_through_the_openai_client(client, chat_model):
    """response_format (json_schema, json_object), vLLM's structured_outputs and guided_* fields, on
    completions and chat, streamed and not: every finished output follows its constraint."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    model, messages = str(chat_model), [{"role": "user", "content": "give me json"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        chat = client.chat.completions.create(
            model=model, messages=messages, max_tokens=80, temperature=1.0, seed=seed, response_format=fmt
        )
        assert chat.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
        streamed = client.chat.completions.create(
            model=model, messages=messages, max_tokens=80, temperature=1.0, seed=seed, response_format=fmt, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content
    done = client.completions.create(
        model=model, prompt="hello", max_tokens=80, temperature=0, extra_body={"guided_json": SCHEMA}
    )
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)
    regex = r"[a-z]{3}-\d\d"
    streamed = client.completions.create(
        model=model, prompt="hello", max_tokens=20, temperature=1.0, seed=1, stream=True,
        extra_body={"structured_outputs": {"regex": regex}},
    )  # fmt: skip
    assert re.fullmatch(regex, "".join(c.choices[0].text for c in streamed))
    choices = ["red", "green"]
    picked = client.completions.create(
        model=model, prompt="colour", max_tokens=8, temperature=1.0, n=4, seed=2, extra_body={"guided_choice": choices}
    )
    assert {c.text for c in picked.choices} <= set(choices)
    obj = client.chat.completions.create(
        model=model, messages=messages, max_tokens=120, temperature=0, response_format={"type": "json_object"}
    )
    content = obj.choices[0].message.content
    assert content.lstrip()[:1] in "{["
    if obj.choices[0].finish_reason == "stop":  # any JSON value may nest past max_tokens; a finished one parses
        assert isinstance(json.loads(content), (dict, list))


@pytest.mark.parametrize(
    "extra,param,message",
    [
        ({"guided_json": {"type": "nonsense"}}, "guided_json", 'structured_outputs.json: Unsupported type "nonsense"'),
        ({"guided_regex": "[^\\s\\S]"}, "guided_regex", "no output the tokenizer can produce satisfies it"),
        ({"guided_regex": "a("}, "guided_regex", "Regex parsing error"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", "one kind of constraint"),
        ({"guided_json": {}, "guided_regex": "a"}, "guided_regex", "give one structured-output constraint"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs a 'schema' object"),
        ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type must be"),
        ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "not available"),
        ({"use_beam_search": True, "guided_choice": ["a", "b"]}, "use_beam_search", "do not run with beam search"),
    ],
)
def test_bad_structured_outputs_are_400s_naming_the_field(server, extra, param, message):
    status, body = post(server, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 4} | extra).encode())
    assert status == 400 and message in body["error"]["message"] and body["error"]["param"] == param, body
    assert post(server, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')[0] == 200  # others run on


def post(url, path, data: bytes, key=KEY):
    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post_announcing(url, path, size: int) -> int:
    """Announce a `size`-byte body and send only its start: the server must answer 413 from the
    headers (a client still writing 2 MB may meet a closed socket, which is fine for the server)."""
    parsed = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=30)
    try:
        conn.putrequest("POST", path)
        for name, value in {"content-type": "application/json", "authorization": f"Bearer {KEY}"}.items():
            conn.putheader(name, value)
        conn.putheader("content-length", str(size))
        conn.endheaders(b'{"prompt": "aaaa')
        return conn.getresponse().status
    finally:
        conn.close()


def test_auth_size_and_json_errors(server):
    assert post(server, "/v1/completions", b'{"prompt": "hi"}', key=None)[0] == 401
    assert post(server, "/v1/completions", b'{"prompt": "hi"}', key="wrong")[0] == 401
    assert post(server, "/v1/completions", b"{not json")[0] == 400
    assert post_announcing(server, "/v1/completions", 2 << 20) == 413
    assert post(server, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')[0] == 200  # still serving
    status, body = post(server, "/v1/nowhere", b"{}")
    assert status == 404 and body["error"]["code"] == 404  # OpenAI's error JSON for any route
    status, body = post(server, "/v1/completions", b'{"prompt": "hi", "priority": 3}')
    assert status == 400 and "scheduling_policy" in body["error"]["message"]  # this server is fcfs


def test_async_abort_ends_the_stream_and_frees_blocks(tiny_models):
    from pagedbench.entrypoints.async_llm import AsyncLLM

    llm = LLM(tiny_models["llama"][0], device="cpu", dtype="float32", scheduling_policy="priority")
    engine = AsyncLLM(llm.engine)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        seen = []
        async for out in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "a", priority=1):
            seen.append(len(out.outputs[0].token_ids))
            if len(seen) == 3:
                engine.abort("a")
        for _ in range(100):  # the abort lands before the next step
            if llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks:
                break
            await asyncio.sleep(0.01)
        await engine.stop()
        return seen

    seen = asyncio.run(main())
    assert seen[-1] < 200 and len(seen) <= 4

    engine = AsyncLLM(llm.engine)  # asyncio objects belong to one event loop

    async def reuse():  # aborting a finished request is a no-op, even when its id comes back
        short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        first = [o async for o in engine.generate([5, 6], short, "y")]
        engine.abort("y")
        second = [o async for o in engine.generate([5, 6], short, "y")]
        await engine.stop()
        return first[-1], second[-1]

    first, second = asyncio.run(asyncio.wait_for(reuse(), 30))
    assert first.finished and second.finished and second.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_back_pressure_is_429(chat_model):
    proc, url = start_server(chat_model, "--max-pending", "1")
    try:

        async def go():
            async with aiohttp.ClientSession() as session:
                body = {"prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True}
                results = await asyncio.gather(
                    *(session.post(url + "/v1/completions", json=body) for _ in range(6)), return_exceptions=False
                )
                return [r.status for r in results], [await r.json() for r in results]

        statuses, bodies = asyncio.run(go())
        assert 200 in statuses and 429 in statuses
        assert all(b["error"]["type"] == "rate_limit_exceeded" for s, b in zip(statuses, bodies) if s == 429)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def stream_once(session, url, rng, disconnect: bool) -> str:
    body = {
        "prompt": [rng.randrange(3, 300) for _ in range(rng.randrange(1, 40))],
        "max_tokens": rng.randrange(2, 24),
        "temperature": 1.0,
        "stream": True,
        "ignore_eos": True,
    }
    cut = rng.randrange(1, 6) if disconnect else None
    async with session.post(url + "/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"}) as r:
        assert r.status == 200
        events = 0
        async for line in r.content:
            line = line.decode().strip()
            if not line:
                continue
            assert line.startswith("data: ")
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                return "done"
            chunk = json.loads(payload)
            assert chunk["object"] == "text_completion" and len(chunk["choices"]) == 1
            events += 1
            if cut is not None and events >= cut:
                return "cut"  # leaving the block closes the connection mid-stream
    raise AssertionError("a stream ended without [DONE]")


def test_disconnects_free_blocks_and_200_concurrent_streams(server):
    rng = random.Random(0)

    async def go():
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            return await asyncio.gather(*(stream_once(session, server, rng, rng.random() < 0.35) for _ in range(200)))

    outcomes = asyncio.run(go())
    assert outcomes.count("done") >= 100 and outcomes.count("cut") >= 40
    m = wait_idle(server)
    assert m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0, "a disconnected request kept its blocks"
    assert urllib.request.urlopen(server + "/health").status == 200


def test_a_disconnect_aborts_the_request_at_once(server):
    """A stream cut after two chunks of a 400-token request: the request never finishes (it was
    aborted, not run to the end) and its blocks are free."""
    before = metrics(server)

    async def go():
        async with aiohttp.ClientSession() as session:
            body = {"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
            async with session.post(
                server + "/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
            ) as r:
                seen = 0
                async for line in r.content:
                    seen += line.startswith(b"data: ")
                    if seen == 2:
                        return

    asyncio.run(go())
    m = wait_idle(server)
    assert m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0
    finished = 'vllm:request_success_total{finished_reason="length"}'
    assert m.get(finished, 0) == before.get(finished, 0), "the cut request ran to its end"
    generated = m["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 2 <= generated < 100, f"{generated} tokens generated for a request cut after two chunks"


def test_metrics_count_requests_not_samples(server):
    before = wait_idle(server)
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 5, "n": 2, "temperature": 1.0, "ignore_eos": True}
    assert post(server, "/v1/completions", json.dumps(body).encode())[0] == 200
    m = wait_idle(server)

    def grew(name):
        return m.get(name, 0) - before.get(name, 0)

    assert grew('vllm:request_success_total{finished_reason="length"}') == 1  # one request with two samples
    assert grew("vllm:time_per_output_token_seconds_count") == 1 and grew("vllm:inter_token_latency_seconds_count") == 4
    assert grew("vllm:prefix_cache_queries_total") == 4 and "vllm:prefix_cache_hits_total" in m


def test_bench_serve_warm_ups_are_sent_and_kept_out_of_the_metrics(server, tmp_path, capsys):
    """--num-warmups N: N requests reach the server first; the report counts only the measured ones."""
    from pagedbench.entrypoints.cli.main import main

    success = 'vllm:request_success_total{finished_reason="length"}'
    before = wait_idle(server).get(success, 0)
    args = ["bench-serve", "--base-url", server, "--api-key", KEY, "--scenario", "online", "--num-prompts", "4"]
    args += ["--scale", "0.5", "--request-rate", "inf", "--num-warmups", "3", "--out", str(tmp_path)]
    assert main(args) == 0
    assert "pagedbench: 3 warm-up requests in " in capsys.readouterr().out
    import pandas as pd

    assert (pd.read_csv(tmp_path / "bench-serve-online.csv")["completed"] == 4).all()
    assert wait_idle(server)[success] - before == 3 + 4
    assert main([*args[:-4], "--num-warmups", "-1", "--out", str(tmp_path)]) == 2
    assert "--num-warmups must be >= 0, got -1" in capsys.readouterr().err


def test_serve_warms_up_only_what_compiles(chat_model):
    """An eager model on an sdpa CPU server compiles nothing: no warm-up (a full prefill chunk of
    time for nothing); a compiling backend or model warms up before the server announces itself."""
    from pagedbench.config import EngineConfig
    from pagedbench.entrypoints.cli.serve import warm_up_reason

    proc, url = start_server(chat_model, "--num-blocks", "64")
    out = server_output(proc)
    skipped, serving = out.index("pagedbench: no warm-up: nothing compiles"), out.index("pagedbench: serving ")
    assert skipped < serving and "warmed up" not in out
    cpu = torch.device("cpu")
    assert warm_up_reason(EngineConfig(model="m", backend="sdpa"), cpu) is None
    assert warm_up_reason(EngineConfig(model="m", backend="flex"), cpu) == "flex's kernels"
    assert warm_up_reason(EngineConfig(model="m", backend="sdpa", compile=True), cpu) == "the compiled model"
    assert warm_up_reason(EngineConfig(model="m", backend="sdpa"), torch.device("cuda")) is not None


def test_bench_serve_against_our_server(server, tmp_path, capsys):
    from pagedbench.entrypoints.cli.main import main

    # scale 0.5: every prompt + output within the server's 512-token context (a longer one is a 400)
    args = ["bench-serve", "--base-url", server, "--api-key", KEY, "--scenario", "online", "--num-prompts", "12"]
    args += ["--scale", "0.5"]
    assert main([*args, "--request-rate", "20,inf", "--goodput", "ttft:60000", "--out", str(tmp_path)]) == 0
    import pandas as pd

    df = pd.read_csv(tmp_path / "bench-serve-online.csv")
    assert list(df["request_rate"].astype(str)) == ["20.0", "inf"] and (df["completed"] == 12).all()
    assert (df["failed"] == 0).all() and (df["median_ttft_ms"] > 0).all() and (df["p90_itl_ms"] > 0).all()
    assert (df["goodput"] == df["request_throughput"]).all()  # a 60 s TTFT SLO: every request meets it
    assert (tmp_path / "bench-serve-online-latency-vs-throughput.png").stat().st_size > 0
    assert set(df["backend"]) == {"sdpa"} and set(df["kind"]) == {"bench-serve"}  # named by the server's card
    # A second server (here: the same one, labelled) merges into one report, a line per backend.
    other = tmp_path / "other"
    assert main([*args, "--request-rate", "inf", "--label", "other", "--out", str(other)]) == 0
    csvs = [str(tmp_path / "bench-serve-online.csv"), str(other / "bench-serve-online.csv")]
    assert main(["report", *csvs, "--out", str(tmp_path / "merged"), "--name", "sweep"]) == 0
    merged = (tmp_path / "merged" / "sweep.md").read_text()
    assert "Online serving" in merged and "| other " in merged and "| sdpa " in merged
    assert (tmp_path / "merged" / "sweep-latency-vs-throughput.png").stat().st_size > 0
    assert main([*args, "--request-rate", "0", "--out", str(tmp_path)]) == 2
    assert "--request-rate must be > 0" in capsys.readouterr().err


def test_bench_serve_client_measures_each_request_and_counts_failures(server, chat_model):
    """bench-serve's openai client, per request: the first chunk's time, a gap per later token, the
    usage's token count and the whole time; a refused request (a wrong key, a prompt past the
    512-token context, a server that is not there) is a failure with its reason, not an exception."""
    from pagedbench.bench.scenario import Request
    from pagedbench.bench.serve_client import replay, summarize

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    requests = [Request(list(range(3, 3 + k)), params, 0.0) for k in (4, 9, 17)]
    model = str(chat_model)
    results, duration = asyncio.run(replay(server, model, requests, float("inf"), None, KEY, 0))
    for r in results:
        assert r.ok and r.error == "" and r.output_len == 6 and len(r.itl_s) == 5
        assert r.ttft_s > 0 and all(gap > 0 for gap in r.itl_s) and r.e2el_s >= r.ttft_s + sum(r.itl_s) - 1e-6
        assert r.tpot_s > 0
    too_long = Request(list(range(3, 3 + 600)), params, 0.0)
    failed, _ = asyncio.run(replay(server, model, [requests[0], too_long], 20.0, 1, "wrong-key", 0))
    assert [r.ok for r in failed] == [False, False] and all(r.error.startswith("HTTP 401: ") for r in failed)
    failed, _ = asyncio.run(replay(server, model, [requests[0], too_long], 20.0, None, KEY, 0))
    assert [r.ok for r in failed] == [True, False] and failed[1].error.startswith("HTTP 400: ")
    gone, _ = asyncio.run(replay("http://127.0.0.1:9", model, requests[:1], 20.0, None, None, 0))
    assert not gone[0].ok and gone[0].error.startswith("APIConnectionError")
    row = summarize([*results, *failed, *gone], duration, {})
    assert row["completed"] == 4 and row["failed"] == 2 and row["median_ttft_ms"] > 0 and row["p99_itl_ms"] > 0


def test_max_tokens_defaults_chat_to_the_context_and_completions_to_16(client, chat_model):
    """vLLM's defaults: a chat reply may fill the context (max_model_len 512 here); a completion stops at 16."""
    messages = [{"role": "user", "content": "hello world"}]
    chat = client.chat.completions.create(
        model=str(chat_model), messages=messages, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == 512
    assert chat.choices[0].finish_reason == "length"
    done = client.completions.create(model=str(chat_model), prompt="hi", temperature=0, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 16


def test_streamed_logprobs_and_logit_bias(client, chat_model):
    """Each streamed chunk carries its new tokens' logprobs; together they are the whole reply's."""
    messages = [{"role": "user", "content": "hello"}]
    kwargs = dict(model=str(chat_model), messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks for choice in c.choices if choice.logprobs for t in choice.logprobs.content]
    expected = whole.choices[0].logprobs.content  # the second run reads its prompt from the prefix cache: ~1 ulp
    assert [t.token for t in streamed] == [t.token for t in expected]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in expected], abs=1e-5)
    assert len(streamed) == 6 and all(len(t.top_logprobs) == 2 for t in streamed)
    biased = client.completions.create(
        model=str(chat_model), prompt=[5, 6, 7], max_tokens=4, temperature=0, logit_bias={"42": 100}
    )
    from transformers import AutoTokenizer

    assert biased.choices[0].text == AutoTokenizer.from_pretrained(str(chat_model)).decode([42] * 4)


def test_prompt_logprobs_in_a_completion(server):
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    status, out = post(server, "/v1/completions", json.dumps(body).encode())
    positions = out["choices"][0]["prompt_logprobs"]
    assert status == 200 and positions[0] is None and len(positions) == 4
    assert all(str(t) in p and p[str(t)]["logprob"] <= 0 for t, p in zip([6, 7, 8], positions[1:]))


def test_echo_with_logprobs_gives_the_prompt_logprobs_lm_eval_reads(client, chat_model, server):
    """lm-eval-harness's loglikelihood request (token ids of context + continuation, echo, logprobs 1,
    max_tokens 1): each prompt token after the first carries the log-probability Hugging Face gives
    it, and the same as the engine's prompt_logprobs; the text is the prompt's, then the completion's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_model))
    ids = tok.encode("the quick brown fox jumps over the lazy dog")
    out = client.completions.create(
        model=str(chat_model), prompt=ids, max_tokens=1, logprobs=1, echo=True, temperature=0
    ).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert out.text.startswith(tok.decode(ids)) and lp.tokens[: len(ids)] == [tok.decode([t]) for t in ids]
    hf = AutoModelForCausalLM.from_pretrained(str(chat_model), dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    want = [logits[i, t].item() for i, t in enumerate(ids[1:])]
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=1e-4)
    for entry, row in zip(lp.top_logprobs[1 : len(ids)], logits[:-1]):  # top-1 and the prompt token
        assert max(entry.values()) == pytest.approx(row.max().item(), abs=1e-4)
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    positions = post(server, "/v1/completions", json.dumps(body).encode())[1]["choices"][0]["prompt_logprobs"]
    engine = [p[str(t)]["logprob"] for t, p in zip(ids[1:], positions[1:])]
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(engine, abs=1e-6)
    plain = client.completions.create(model=str(chat_model), prompt="the lazy dog", max_tokens=3, echo=True)
    assert plain.choices[0].text.startswith("the lazy dog") and plain.choices[0].logprobs is None


def test_tokenize_and_detokenize(server, chat_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_model))
    status, body = post(server, "/tokenize", json.dumps({"prompt": "the quick brown fox"}).encode())
    assert (
        status == 200 and body["tokens"] == tok.encode("the quick brown fox") and body["count"] == len(body["tokens"])
    )
    status, chat = post(server, "/tokenize", json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode())
    assert status == 200 and tok.decode(chat["tokens"]).endswith("assistant:")
    status, text = post(server, "/detokenize", json.dumps({"tokens": body["tokens"]}).encode())
    assert status == 200 and text["prompt"] == tok.decode(body["tokens"])
    assert post(server, "/detokenize", b'{"tokens": "x"}')[0] == 400
    assert post(server, "/tokenize", b'{"prompt": 5}')[0] == 400


def test_streamed_text_never_leaks_a_stop_string(client, chat_model):
    base = client.completions.create(model=str(chat_model), prompt="the lazy dog", max_tokens=16, temperature=0)
    text = base.choices[0].text
    stop = text[6:9]
    assert len(stop) == 3 and stop in text
    whole = client.completions.create(
        model=str(chat_model), prompt="the lazy dog", max_tokens=16, temperature=0, stop=[stop]
    )
    chunks = client.completions.create(
        model=str(chat_model), prompt="the lazy dog", max_tokens=16, temperature=0, stop=[stop], stream=True
    )
    streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == whole.choices[0].text == text[: text.index(stop)]


def test_chat_top_logprobs_and_unstreamable_best_of(client, chat_model, server):
    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(
        model=str(chat_model), messages=messages, max_tokens=4, logprobs=True, top_logprobs=3, temperature=1.0
    )
    assert all(len(t.top_logprobs) == 3 for t in chat.choices[0].logprobs.content)
    for entry in chat.choices[0].logprobs.content:  # OpenAI's bytes: the token's UTF-8
        assert entry.bytes == list(entry.token.encode()) and all(
            t.bytes == list(t.token.encode()) for t in entry.top_logprobs
        )
    status, body = post(
        server, "/v1/completions", json.dumps({"prompt": "hi", "n": 1, "best_of": 2, "stream": True}).encode()
    )
    assert status == 400 and "best_of != n" in body["error"]["message"]


def test_version_and_model_cards_as_vllm_serves_them(server, chat_model):
    """/version; /v1/models/{id} (404 in OpenAI's shape for another id); `root`, the directory an
    offline client loads the tokenizer from."""
    from importlib.metadata import version

    assert json.loads(urllib.request.urlopen(server + "/version").read()) == {"version": version("pagedbench")}
    headers = {"authorization": f"Bearer {KEY}"}
    listed = json.loads(urllib.request.urlopen(urllib.request.Request(server + "/v1/models", headers=headers)).read())
    card = listed["data"][0]
    assert card["root"] == str(chat_model) and (chat_model / "tokenizer.json").exists()
    one = urllib.request.Request(server + "/v1/models/" + card["id"].lstrip("/"), headers=headers)
    assert json.loads(urllib.request.urlopen(one).read())["id"] == card["id"]
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(urllib.request.Request(server + "/v1/models/gpt-9", headers=headers))
    assert missing.value.code == 404 and json.loads(missing.value.read())["error"]["param"] == "model"


def test_greedy_n_is_accepted_as_vllm_does(client, chat_model):
    out = client.completions.create(model=str(chat_model), prompt="hi", max_tokens=4, n=3, temperature=0)
    assert len(out.choices) == 3 and len({c.text for c in out.choices}) == 1


def test_a_non_streaming_client_that_leaves_aborts_its_requests(server):
    before = metrics(server)

    async def go():
        timeout = aiohttp.ClientTimeout(total=0.1)  # leave early: a warm server may finish all 1,600 tokens in 0.5 s
        async with aiohttp.ClientSession(timeout=timeout) as session:
            body = {"prompt": [5, 6, 7], "max_tokens": 400, "n": 4, "temperature": 1.0, "ignore_eos": True}
            try:
                await session.post(server + "/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"})
            except TimeoutError:
                return

    asyncio.run(go())
    m = wait_idle(server)
    generated = m["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert m["vllm:kv_cache_usage_perc"] == 0 and generated < 4 * 400, f"{generated} tokens: the requests ran on"


def test_duplicate_request_ids_are_refused(tiny_models):
    from pagedbench import LLMEngine
    from pagedbench.config import EngineConfig
    from pagedbench.entrypoints.async_llm import AsyncLLM

    llm = AsyncLLM(LLMEngine(EngineConfig(model=tiny_models["llama"][0], device="cpu", dtype="float32")))

    async def go():
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        first = llm.generate({"prompt_token_ids": [5, 6]}, params, "same")
        out = await anext(first)
        with pytest.raises(ValueError, match="request id 'same' is already in use"):
            await anext(llm.generate({"prompt_token_ids": [7]}, params, "same"))
        outs = [out] + [o async for o in first]
        await llm.stop()
        return outs

    outs = asyncio.run(go())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 30


def test_token_ids_stand_in_for_undecoded_logprob_tokens_and_offsets_run_on(client, chat_model, server):
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    status, out = post(server, "/v1/completions", json.dumps(body | {"detokenize": False}).encode())
    logprobs = out["choices"][0]["logprobs"]
    assert status == 200 and all(t.startswith("token_id:") for t in logprobs["tokens"])
    assert all(len(top) >= 2 for top in logprobs["top_logprobs"])  # no collisions on a null key
    kwargs = {k: v for k, v in body.items() if k != "ignore_eos"} | {"extra_body": {"ignore_eos": True}}
    whole = client.completions.create(model=str(chat_model), **kwargs)
    streamed = client.completions.create(model=str(chat_model), **kwargs, stream=True)
    offsets = [o for c in streamed if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset and offsets == sorted(offsets) and offsets[-1] > 0
    assert post(server, "/detokenize", b'{"tokens": [-1]}')[0] == 400


def test_speculative_serving_reports_vllm_spec_metrics():
    """`serve --speculative-config` (the trained pair): completions as without it, and /metrics
    carries vLLM's spec_decode counters."""
    from pagedbench.model.trained_pair import trained_models

    if len(trained_models()) < 2:
        pytest.skip("the trained pair is not in this checkout")
    spec = json.dumps({"method": "draft_model", "model": "py-byte-draft", "num_speculative_tokens": 3})
    proc, url = start_server("py-byte-target", "--speculative-config", spec)
    try:
        prompt = list(b"import os\nimport sys\n\n\ndef main(")
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        status, reply = post(url, "/v1/completions", json.dumps(body).encode())
        assert status == 200
        expected = LLM("py-byte-target", device="cpu", dtype="float32").generate(
            [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
        )
        assert reply["choices"][0]["text"] == expected[0].outputs[0].text
        m = metrics(url)
        assert m["vllm:spec_decode_num_draft_tokens_total"] >= m["vllm:spec_decode_num_accepted_tokens_total"] > 0
        assert m['vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_openapi_schema_names_every_body_field(server):
    """/openapi.json describes the bodies (clients and fuzzers read it); unknown fields are refused."""
    spec = json.loads(urllib.request.urlopen(server + "/openapi.json").read())
    body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"prompt", "max_tokens", "top_k", "ignore_eos"} <= set(body["properties"])
    assert body["additionalProperties"] is False
    chat = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"messages", "max_completion_tokens", "top_logprobs"} <= set(chat["properties"])


def test_schemathesis_finds_no_server_error(server):
    """Fuzz every route from /openapi.json (bounded: 20 examples each, on loopback): bad bodies get
    4xx, never a 5xx."""
    if importlib.util.find_spec("schemathesis") is None:
        pytest.skip("schemathesis not installed (it is in the dev extra)")
    cli = [sys.executable, "-m", "schemathesis.cli"]  # found whether or not its script is on PATH
    cmd = [*cli, "run", server + "/openapi.json", "--checks", "not_a_server_error", "--max-examples", "20"]
    cmd += ["--request-timeout", "30", "-H", f"Authorization: Bearer {KEY}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout.split("SUMMARY")[-1]


@pytest.mark.slow
def test_serve_takes_a_copied_vllm_command_line(tiny_models, tmp_path):
    """vLLM's common flags: working (--model as a flag, -tp, --chat-template, --uvicorn-log-level) or
    accepted with a one-line note; an access-log line per request unless --disable-log-requests."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    proc, url = start_server(
        "--model=" + tiny_models["llama"][0], "--trust-remote-code", "--disable-log-stats", "--enable-chunked-prefill",
        "-tp", "1", "--chat-template", str(template), "--uvicorn-log-level", "warning", "--generation-config", "auto",
        "--enable-auto-tool-choice",
    )  # fmt: skip
    try:
        tokens = post(url, "/tokenize", json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), None)
        assert tokens[0] == 200
        status, _ = post(url, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}).encode(), None)
        assert status == 200
    finally:
        printed = server_output(proc)
    assert "--trust-remote-code accepted, no effect here" in printed
    assert '"POST /v1/completions HTTP/1.1" 200' in printed
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(tiny_models["llama"][0])
    assert tokens[1]["tokens"] == tokenizer.encode("<user>hi<assistant>", add_special_tokens=False)


def test_health_reports_a_dead_replica_or_a_stopped_engine():
    from types import SimpleNamespace

    from pagedbench.entrypoints.openai.api_server import fatal_problem

    alive = SimpleNamespace(error=None, engine=SimpleNamespace(dead_replica=lambda: None))
    dead = SimpleNamespace(error=None, engine=SimpleNamespace(dead_replica=lambda: "data-parallel replica x exited"))
    stopped = SimpleNamespace(error=RuntimeError("boom"), engine=SimpleNamespace())
    assert fatal_problem(alive) is None and fatal_problem(SimpleNamespace(error=None, engine=object())) is None
    assert fatal_problem(dead) == "data-parallel replica x exited" and fatal_problem(stopped) == "engine stopped: boom"


def get(url, path, key=KEY):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers)) as r:
        return json.loads(r.read())


def test_tokenizer_info_and_the_requests_lm_eval_sends(server, chat_model):
    """lm-eval's local-completions uses the server's tokenizer by itself when GET /tokenizer_info
    answers with eos_token and POST /tokenize {"prompt": "test", "add_special_tokens": false} with
    tokens; it then finds eos/bos ids by tokenizing their text, decodes through /detokenize and
    renders chat_template itself. Those exact requests, against Hugging Face's tokenizer."""
    import jinja2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_model))
    info = get(server, "/tokenizer_info")
    assert info["tokenizer_class"] == type(tok).__name__ and info["model_max_length"] == 512
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == (tok.eos_token, tok.bos_token, tok.pad_token)
    assert info["chat_template"] == tok.chat_template and "vocab_file" not in info

    def tokenize(text):
        status, body = post(server, "/tokenize", json.dumps({"prompt": text, "add_special_tokens": False}).encode())
        assert status == 200 and isinstance(body["tokens"], list)
        return body["tokens"]

    assert tokenize("test") == tok.encode("test", add_special_tokens=False)
    assert tokenize(info["eos_token"])[0] == tok.eos_token_id and tokenize(info["bos_token"])[0] == tok.bos_token_id
    ids = tokenize("the quick brown fox")
    assert post(server, "/detokenize", json.dumps({"tokens": ids}).encode())[1]["prompt"] == tok.decode(ids)
    messages = [{"role": "user", "content": "hi"}]
    rendered = jinja2.Environment().from_string(info["chat_template"]).render(messages=messages)
    assert rendered == tok.apply_chat_template(messages, tokenize=False)
    assert get(server, "/v1/models")["data"][0]["root"] == str(chat_model)  # the tokenizer's directory


@pytest.mark.parametrize(
    "path,body,param,message",
    [
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
        ("/v1/chat/completions", {"logprobs": 5}, "logprobs", "logprobs must be true or false, got 5"),
        ("/v1/completions", {"stream": True, "stream_options": {"include_usage": "yes"}},
         "stream_options.include_usage", "stream_options.include_usage must be true or false, got 'yes'"),
        ("/v1/completions", {"stream": True, "stream_options": {"usage": True}}, "stream_options",
         "stream_options has unknown key(s) usage; known: include_usage"),
        ("/tokenize", {"add_special_tokens": "x"}, "add_special_tokens", "add_special_tokens must be true or false"),
    ],
)  # fmt: skip
def test_mistyped_fields_are_one_line_400s(server, path, body, param, message):
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    status, error = post(server, path, json.dumps(base | body).encode())
    assert status == 400 and error["error"]["param"] == param and message in error["error"]["message"], error
    assert "\n" not in error["error"]["message"]


def stream_lines(url, body: dict) -> list[str]:
    """A streamed completion's SSE data lines, read to the end of the response."""
    parsed = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    return [line for line in response.read().decode().split("\n\n") if line]


@pytest.mark.slow
@pytest.mark.parametrize("second_ctrl_c", [False, True])
def test_ctrl_c_drains_then_answers_503_and_exits_130(tiny_models, second_ctrl_c):
    """Ctrl-C with a stream in flight: one line saying so, new requests refused, the stream finishes
    within the grace period or ends with a 503 error event; a second Ctrl-C ends it at once; exit
    130 with one last line and no traceback."""
    import signal
    import threading

    grace = 60 if second_ctrl_c else 2
    proc, url = start_server(tiny_models["llama"][0], "--shutdown-grace-period", str(grace))
    lines: list[str] = []
    body = {"prompt": "hello", "max_tokens": 480, "ignore_eos": True, "stream": True, "temperature": 0}
    client = threading.Thread(target=lambda: lines.extend(stream_lines(url, body)))
    client.start()
    deadline = time.time() + 30
    while metrics(url)["vllm:num_requests_running"] < 1 and time.time() < deadline:
        time.sleep(0.02)
    start = time.time()
    proc.send_signal(signal.SIGINT)
    if second_ctrl_c:  # as soon as the first is handled: a fixed wait raced the stream's end on a fast host
        until = time.time() + 5
        while "pagedbench: stopping" not in open(proc.log_path).read() and time.time() < until:
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
    proc.wait(timeout=grace + 30)
    seconds = time.time() - start
    client.join(timeout=30)
    printed = server_output(proc)
    assert proc.returncode == 130 and "Traceback" not in printed, printed
    assert "pagedbench: stopping: 1 request in flight, up to" in printed and "(Ctrl-C again to stop now)" in printed
    last = printed.strip().splitlines()[-1]
    assert last.startswith("pagedbench: stopped") and "Error" not in printed.split("stopping:")[1], printed
    end = lines[-1]
    if second_ctrl_c:
        assert seconds < 15 and json.loads(end.removeprefix("data: "))["error"]["code"] == 503
        assert "a second Ctrl-C" in last
    else:
        assert seconds < grace + 10
        assert end == "data: [DONE]" or json.loads(end.removeprefix("data: "))["error"]["code"] == 503, end
    with pytest.raises(OSError):  # no longer listening
        urllib.request.urlopen(url + "/health", timeout=2)
    assert f"tokenizer: {tiny_models['llama'][0]}" in printed  # the banner names the tokenizer's directory
