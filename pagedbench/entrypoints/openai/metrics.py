"""Prometheus /metrics with vLLM's metric names, every series labelled model_name as vLLM's dashboards
select on it (prometheus_client is imported when the server starts)."""

from pagedbench.engine.outputs import RequestOutput
from pagedbench.entrypoints.async_llm import AsyncLLM


class EngineCounters:
    """Token counters read from the engine when scraped (they count what the engine ran, aborted
    requests included)."""

    def __init__(self, llm: AsyncLLM, model_name: str = ""):
        self.llm, self.model_name = llm, model_name

    def collect(self):
        now = self.llm.engine.gauges()  # a data-parallel engine's: its replicas' latest, summed
        counters = (
            ("vllm:prompt_tokens", "Prefill tokens processed", "prompt_tokens"),
            ("vllm:generation_tokens", "Generation tokens produced", "generation_tokens"),
            ("vllm:num_preemptions", "Cumulative preemptions", "preemptions"),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up", "prefix_queries"),
            ("vllm:prefix_cache_hits", "Prompt tokens found cached", "prefix_hits"),
        )
        for name, doc, gauge in counters:
            yield counter(name, doc, now[gauge], self.model_name)
        if "spec_drafts" in now:  # the engine (or its data-parallel replicas) speculates
            yield from speculation_counters(now, self.model_name)


def counter(name: str, doc: str, value: float, model_name: str):
    from prometheus_client.core import CounterMetricFamily

    family = CounterMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model_name], value)
    return family


def speculation_counters(gauges: dict, model_name: str = ""):
    """vLLM v1's speculative-decoding counters (a draft: one sequence's proposal in one step),
    from the engine's gauges."""
    from prometheus_client.core import CounterMetricFamily

    yield counter("vllm:spec_decode_num_drafts", "Proposals verified", gauges["spec_drafts"], model_name)
    yield counter(
        "vllm:spec_decode_num_draft_tokens", "Proposed tokens verified", gauges["spec_draft_tokens"], model_name
    )
    yield counter(
        "vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted", gauges["spec_accepted_tokens"], model_name
    )
    per_position = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens by position in the proposal",
        labels=["model_name", "position"],
    )
    position = 0
    while f"spec_accepted_at_{position}" in gauges:
        per_position.add_metric([model_name, str(position)], gauges[f"spec_accepted_at_{position}"])
        position += 1
    yield per_position


class ServerMetrics:
    """Prometheus metrics with vLLM's names where the meaning matches."""

    def __init__(self, llm: AsyncLLM, model_name: str = ""):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry, self.model_name = CollectorRegistry(), model_name
        engine, model = llm.engine, ["model_name"]

        def gauge(name: str, doc: str, read) -> None:
            Gauge(name, doc, model, registry=self.registry).labels(model_name).set_function(read)

        gauge("vllm:num_requests_running", "Requests running on the engine", lambda: engine.gauges()["running"])
        gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", lambda: engine.gauges()["waiting"])
        gauge("vllm:num_requests_swapped", "Requests swapped out to CPU", lambda: engine.gauges()["swapped"])
        gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage: 1 means 100 percent",
            lambda: (now := engine.gauges())["used_blocks"] / now["num_blocks"],
        )
        self.registry.register(EngineCounters(llm, model_name))
        reasons = [*model, "finished_reason"]
        self.success = Counter("vllm:request_success", "Finished requests", reasons, registry=self.registry)

        def histogram(name: str, doc: str):
            return Histogram(name, doc, model, registry=self.registry).labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency")
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Mean time per output token")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between token steps")

    def finished(self, out: RequestOutput) -> None:
        reason = out.outputs[0].finish_reason if out.outputs else "unknown"
        self.success.labels(model_name=self.model_name, finished_reason=reason).inc()
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
