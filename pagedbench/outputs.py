"""What the engine hands back per request, with vLLM's names."""

from dataclasses import dataclass, field

from pagedbench.sequence import Sequence


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" or "length" once finished
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (time.perf_counter) of a request's life, for latency metrics."""

    arrival_time: float
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None


def request_output(seq: Sequence) -> RequestOutput:
    """The request's output so far; metrics once it has finished."""
    completion = CompletionOutput(0, seq.output_text, seq.output_token_ids, seq.finish_reason, seq.stop_reason)
    metrics = None
    if seq.finished:
        metrics = RequestMetrics(
            seq.arrival_time, seq.token_times[0], seq.token_times, seq.token_times[-1], seq.num_preemptions
        )
    return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion], seq.finished, metrics)
