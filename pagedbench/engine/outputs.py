"""What the engine hands back per request, with vLLM's names (beam search's too)."""

from dataclasses import dataclass, field


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
    """One sample of a request so far; under RequestOutputKind.DELTA its text, token_ids and logprobs
    hold only what is new since the request's last output (cumulative_logprob stays cumulative)."""

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


@dataclass(slots=True)
class BeamSearchSequence:
    """One returned beam: `tokens` is prompt + output (vLLM's layout), `text` their decoding."""

    tokens: list[int]
    cum_logprob: float
    score: float  # cum_logprob / generated_len ** length_penalty: what the beams are ranked by
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None  # the EOS id that ended it, None at a length limit (vLLM's)


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence] = field(default_factory=list)
