"""What the engine hands back per request, with vLLM's names."""

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedbench.sequence import SequenceGroup


@dataclass(slots=True)
class Logprob:
    """vLLM's Logprob: a token's log-probability, its rank in the vocabulary (1 = most likely)
    and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob (the sampled or prompt token, and the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" or "length" once finished
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    cumulative_logprob: float | None = None  # sum of the model's logprobs of token_ids (logprobs, best_of, beams)
    logprobs: list[PositionLogprobs] | None = None  # one per token when SamplingParams.logprobs is set

    def finished(self) -> bool:
        return self.finish_reason is not None


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
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # None first: nothing predicts it
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache instead of computed

    def __getitem__(self, key: str):
        """nano-vllm's output dict: output["text"] and output["token_ids"] of the first sample."""
        if key in ("text", "token_ids"):
            return getattr(self.outputs[0], key)
        raise KeyError(key)


def completions(group: SequenceGroup, decode: Callable[[list[int]], str] | None) -> list[CompletionOutput]:
    """The request's returned samples: its n samples by index, or once finished with best_of > n
    the n best by cumulative logprob; a beam search's finished beams, best first."""
    if group.beam is not None:
        return [
            CompletionOutput(
                i,
                decode(h.output_token_ids) if decode else "",
                h.output_token_ids,
                h.finish_reason,
                h.stop_reason,
                h.cum_logprob,
            )
            for i, h in enumerate(group.beam.finished if group.finished else [])
        ]
    p = group.params
    seqs = sorted(group.seqs, key=lambda s: s.index)
    if group.finished and p.best_of > p.n:
        seqs.sort(key=lambda s: -s.cumulative_logprob)
    return [
        CompletionOutput(
            s.index,
            s.output_text,
            s.output_token_ids,
            s.finish_reason,
            s.stop_reason,
            s.cumulative_logprob if p.best_of > 1 or p.logprobs is not None else None,
            None if s.logprobs is None else list(s.logprobs),
        )
        for s in seqs[: p.n]
    ]


def request_output(group: SequenceGroup, decode: Callable[[list[int]], str] | None = None) -> RequestOutput:
    """The request's output so far; metrics once it has finished."""
    metrics = None
    finished = group.finished
    if finished:
        times = group.token_times
        metrics = RequestMetrics(group.arrival_time, times[0], times, times[-1], group.num_preemptions)
    first = group.seqs[0] if group.seqs and group.beam is None else None
    wanted = first is not None and first.params.prompt_logprobs is not None
    prompt_logprobs = (first.prompt_logprobs or []) if wanted else None
    group.note_cached_tokens()
    return RequestOutput(
        group.request_id,
        group.prompt,
        group.prompt_token_ids,
        completions(group, decode),
        finished,
        metrics,
        None if prompt_logprobs is None else [None, *prompt_logprobs],  # nothing predicts the first token
        group.num_cached_tokens,
    )
