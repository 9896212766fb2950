"""`pagedbench bench-serve`: replay a scenario's requests against any OpenAI-compatible server
(ours or another engine's) at Poisson request rates, streaming, and measure what a client sees:
TTFT, TPOT, ITL and E2EL (mean, median, p90, p99), request and token throughput, and goodput
(requests per second that met every stated SLO). Definitions as vLLM's benchmark_serving:
TTFT is the first streamed chunk, ITL the gaps between chunks, TPOT (E2EL - TTFT) / (tokens - 1).
Prompts are sent as token ids, so every server gets exactly the scenario's lengths; requests go
through the openai client's streaming completions."""

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from pagedbench.bench.scenario import Request

PERCENTILES = {
    "mean": np.mean,
    "median": np.median,
    "p90": lambda x: np.percentile(x, 90),
    "p99": lambda x: np.percentile(x, 99),
}


@dataclass(slots=True)
class ClientResult:
    ok: bool
    input_len: int
    output_len: int = 0
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot_s(self) -> float:
        return (self.e2el_s - self.ttft_s) / (self.output_len - 1) if self.output_len > 1 else float("nan")


def structured_outputs_body(params) -> dict:
    """StructuredOutputsParams as the JSON object of vLLM's structured_outputs request field."""
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    if isinstance(fields["json"], type):  # a pydantic model class
        fields["json"] = fields["json"].model_json_schema()
    return {name: value for name, value in fields.items() if value is not None and value is not False}


async def send(client, model: str, request: Request) -> ClientResult:
    """One streamed completion through the openai client (an openai.AsyncOpenAI); a failure (an
    HTTP error, an error event mid-stream, a dropped connection) is the result's error, not raised."""
    import openai

    p = request.params
    extra = {"ignore_eos": p.ignore_eos}  # vLLM's extension; exact output lengths
    if p.structured_outputs is not None:  # vLLM's structured_outputs request field
        extra["structured_outputs"] = structured_outputs_body(p.structured_outputs)
    result = ClientResult(False, len(request.prompt_token_ids))
    start = last = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model,
            prompt=request.prompt_token_ids,
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            n=p.n,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        chunks = 0
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                if chunks == 0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                chunks += 1
                last = now
            if chunk.usage:
                result.output_len = chunk.usage.completion_tokens
        result.e2el_s = time.perf_counter() - start
        result.output_len = result.output_len or chunks
        result.ok = True
    except openai.APIStatusError as e:
        result.error = f"HTTP {e.status_code}: {e.response.text[:200]}"
    except Exception as e:  # noqa: BLE001 (an error event or a connection error is a failed request, not a crash)
        result.error = f"{type(e).__name__}: {e}"
    return result


async def replay(
    url: str,
    model: str,
    requests: list[Request],
    rate: float | None,
    max_concurrency: int | None,
    api_key: str | None,
    seed: int,
) -> tuple[list[ClientResult], float]:
    """Send `requests` with Poisson arrivals at `rate` per second (inf: all at once; None: at each
    request's own arrival_time, a trace's), at most `max_concurrency` in flight; returns the results
    in request order and the wall time."""
    import openai

    rng = np.random.default_rng(seed)
    if rate is None:  # a trace: the gaps between its timestamps
        times = [r.arrival_time for r in requests]
        gaps = np.diff(times + [times[-1]]) if times else np.zeros(0)
    else:
        gaps = rng.exponential(1.0 / rate, size=len(requests)) if np.isfinite(rate) else np.zeros(len(requests))
    limit = asyncio.Semaphore(max_concurrency or len(requests))

    async def one(request):
        async with limit:
            return await send(client, model, request)

    # No retries (a failure is measured, not hidden), no timeout, no cap on connections (the semaphore is the
    # cap); the Limits class is that of whichever httpx the openai client is built on.
    limits = type(openai.DEFAULT_CONNECTION_LIMITS)(max_connections=None, max_keepalive_connections=None)
    http_client = openai.DefaultAsyncHttpxClient(limits=limits, timeout=None)
    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key=api_key or "EMPTY", max_retries=0, timeout=None, http_client=http_client
    ) as client:
        start = time.perf_counter()
        tasks, due = [], 0.0
        for request, gap in zip(requests, gaps):
            tasks.append(asyncio.ensure_future(one(request)))
            due += gap  # sleep to each arrival's due time, so the schedule does not drift
            await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize(results: list[ClientResult], duration: float, slos_ms: dict[str, float]) -> dict:
    """One row: throughput, latency statistics in ms, goodput under `slos_ms` (ttft/tpot/e2el)."""
    ok = [r for r in results if r.ok]
    row = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(r.output_len for r in ok) / duration,
        "total_token_throughput": sum(r.input_len + r.output_len for r in ok) / duration,
    }
    samples = {
        "ttft": [1e3 * r.ttft_s for r in ok],
        "tpot": [1e3 * r.tpot_s for r in ok if r.output_len > 1],
        "itl": [1e3 * gap for r in ok for gap in r.itl_s],
        "e2el": [1e3 * r.e2el_s for r in ok],
    }
    for name, values in samples.items():
        for stat, fn in PERCENTILES.items():
            row[f"{stat}_{name}_ms"] = float(fn(values)) if values else float("nan")
    good = [
        r
        for r in ok
        if all(
            {"ttft": 1e3 * r.ttft_s, "tpot": 1e3 * r.tpot_s if r.output_len > 1 else 0.0, "e2el": 1e3 * r.e2el_s}[k]
            <= v
            for k, v in slos_ms.items()
        )
    ]
    row["goodput"] = len(good) / duration if slos_ms else float("nan")
    return row


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip()
        try:
            rate = float("inf") if part == "inf" else float(part)
        except ValueError:
            raise ValueError(f"--request-rate takes numbers or inf, comma-separated; got {text!r}") from None
        if not rate > 0:
            raise ValueError(f"--request-rate must be > 0, got {part}")
        rates.append(rate)
    return rates


def parse_slos(text: str | None) -> dict[str, float]:
    """'ttft:500,tpot:50' -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, _, value = part.partition(":")
        if name.strip() not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS and/or e2el:MS; got {part!r}")
        try:
            slos[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {name}: {value!r} is not a number of milliseconds") from None
    return slos
