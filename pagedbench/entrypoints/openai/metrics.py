"""Prometheus /metrics with vLLM's metric names (prometheus_client is imported when the server starts)."""

from pagedbench.engine.outputs import RequestOutput
from pagedbench.entrypoints.async_llm import AsyncLLM


class EngineCounters:
    """Token counters read from the engine when scraped (they count what the engine ran, aborted
    requests included)."""

    def __init__(self, llm: AsyncLLM):
        self.llm = llm

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        now = self.llm.engine.gauges()  # a data-parallel engine's: its replicas' latest, summed
        yield CounterMetricFamily("vllm:prompt_tokens", "Prefill tokens processed", value=now["prompt_tokens"])
        yield CounterMetricFamily(
            "vllm:generation_tokens", "Generation tokens produced", value=now["generation_tokens"]
        )
        yield CounterMetricFamily("vllm:num_preemptions", "Cumulative preemptions", value=now["preemptions"])
        yield CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up", value=now["prefix_queries"])
        yield CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found cached", value=now["prefix_hits"])
        if "spec_drafts" in now:  # the engine (or its data-parallel replicas) speculates
            yield from speculation_counters(now)


def speculation_counters(gauges: dict):
    """vLLM v1's speculative-decoding counters (a draft: one sequence's proposal in one step),
    from the engine's gauges."""
    from prometheus_client.core import CounterMetricFamily

    yield CounterMetricFamily("vllm:spec_decode_num_drafts", "Proposals verified", value=gauges["spec_drafts"])
    yield CounterMetricFamily(
        "vllm:spec_decode_num_draft_tokens", "Proposed tokens verified", value=gauges["spec_draft_tokens"]
    )
    yield CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted", value=gauges["spec_accepted_tokens"]
    )
    per_position = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens by position in the proposal",
        labels=["position"],
    )
    position = 0
    while f"spec_accepted_at_{position}" in gauges:
        per_position.add_metric([str(position)], gauges[f"spec_accepted_at_{position}"])
        position += 1
    yield per_position


class ServerMetrics:
    """Prometheus metrics with vLLM's names where the meaning matches."""

    def __init__(self, llm: AsyncLLM):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        engine = llm.engine
        running = Gauge("vllm:num_requests_running", "Requests running on the engine", registry=self.registry)
        running.set_function(lambda: engine.gauges()["running"])
        waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", registry=self.registry)
        waiting.set_function(lambda: engine.gauges()["waiting"])
        swapped = Gauge("vllm:num_requests_swapped", "Requests swapped out to CPU", registry=self.registry)
        swapped.set_function(lambda: engine.gauges()["swapped"])
        usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent", registry=self.registry)
        usage.set_function(lambda: (now := engine.gauges())["used_blocks"] / now["num_blocks"])
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
