"""What a request asks of sampling and stopping, with vLLM's names: SamplingParams (with
StructuredOutputsParams for constrained decoding), and BeamSearchParams for beam search."""

import dataclasses
import enum
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass


class RequestOutputKind(enum.Enum):
    """vLLM's RequestOutputKind: what a request's RequestOutputs hold, step by step."""

    CUMULATIVE = 0  # every step it progresses: everything so far (LLMEngine.step's default)
    DELTA = 1  # every step it progresses: only the new tokens, text and logprobs (streaming)
    FINAL_ONLY = 2  # nothing until it finishes, then everything (LLM.generate, the benchmarks)


MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit value
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature is greedy (dividing by it overflows)


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's structured-output constraint (one kind per request): the output follows a JSON schema
    (`json`: a dict, a JSON string or a pydantic model class), a regular expression, one of the
    `choice` strings, an EBNF (GBNF) or Lark `grammar`, or any JSON object (`json_object`).
    Compiled by xgrammar (the `structured` extra), whose strict mode gives a schema's objects only
    the properties it lists unless it says `additionalProperties`; checked when the request is added."""

    json: str | dict | type | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON without optional whitespace (compact output)
    # vLLM's other options, as they apply to its xgrammar backend (the only one here):
    backend: str | None = None  # None, "auto" or "xgrammar"
    disable_fallback: bool = False  # there is no other backend to fall back to
    disable_additional_properties: bool = False  # xgrammar's strict mode already refuses unlisted properties
    whitespace_pattern: str | None = None  # not supported by xgrammar: a ValueError (use disable_any_whitespace)

    def __post_init__(self):
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not all(isinstance(c, str) for c in self.choice):
                raise TypeError(f"structured_outputs.choice must be a list of strings, got {self.choice!r}")
            if not self.choice:
                raise ValueError("structured_outputs.choice must not be empty")
            self.choice = list(self.choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.json is not None and not isinstance(self.json, (str, dict, type)):
            kind = type(self.json).__name__
            raise TypeError(f"structured_outputs.json must be a JSON schema (dict or str), got {kind}")
        if self.json_object not in (None, True, False):
            raise TypeError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        check_bools(self, ("disable_any_whitespace", "disable_fallback", "disable_additional_properties"))
        if self.backend not in (None, "auto", "xgrammar"):
            raise ValueError(f"structured_outputs.backend {self.backend!r} is not available; this engine has xgrammar")
        if self.whitespace_pattern is not None:
            raise ValueError(
                "structured_outputs.whitespace_pattern is not supported by xgrammar; use disable_any_whitespace"
            )
        kinds = self.kinds
        if len(kinds) > 1:
            raise ValueError(
                f"structured_outputs takes one kind of constraint, got {' and '.join(kinds)} (vLLM: only one of "
                "json, regex, choice, grammar, json_object)"
            )
        if not kinds:
            raise ValueError("structured_outputs needs one of json, regex, choice, grammar, json_object")

    @property
    def kinds(self) -> list[str]:
        """The constraints set (valid params have exactly one)."""
        kinds = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        return kinds + (["json_object"] if self.json_object else [])

    @property
    def kind(self) -> str:
        return self.kinds[0]


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping rules, with vLLM's names. temperature 0 (or under 1e-5) is greedy.
    A wrong type is a TypeError, a value out of range a ValueError; both name the field.

    n samples are returned per prompt; best_of (default n) are generated, all forked from one
    prefill and sharing its pages, and the n with the highest cumulative logprob returned.
    Sample i draws from seed + i when a seed is given, so sample 0 is the n=1 request's.

    Logits go through: the structured_outputs grammar mask, allowed_token_ids, logit_bias (added),
    logits_processors, then bad_words and min_tokens (EOS and stop ids banned until then; after the
    processors, which cannot undo them), then the repetition, frequency and presence penalties, then
    temperature, top-k, top-p, min-p and sampling (greedy takes the argmax of the processed logits).
    logprobs and prompt_logprobs are the model's raw log-probabilities, taken
    before all of that (vLLM v1's default "raw_logprobs").

    A logits processor follows vLLM's per-request contract: a callable (output_token_ids, logits[V])
    -> logits[V], or (prompt_token_ids, output_token_ids, logits[V]) -> logits[V], called for the
    request's row. A `BatchLogitsProcessor` instance instead sees every row that carries it at once:
    (list of output_token_ids, logits[b, V]) -> logits[b, V], once per step."""

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: every token
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: until max_model_len, as in vLLM
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # top logprobs per output token (the sampled one always included)
    prompt_logprobs: int | None = None  # top logprobs per prompt token (None for the first)
    presence_penalty: float = 0.0  # minus this for every token already in the output
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # logits of prompt and output tokens: / if > 0, * if < 0
    min_tokens: int = 0  # no EOS, stop token or stop string before this many output tokens
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logits_processors: list[Callable] | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit; in [-100, 100], as OpenAI's
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (text "", no stop strings)
    structured_outputs: StructuredOutputsParams | None = None  # a JSON schema, regex, choice or grammar
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older name: moved to structured_outputs
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what each step's RequestOutput holds
    _bad_words_token_ids: list[list[int]] | None = None  # bad_words tokenized by the engine

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise TypeError(f"stop must be a str or a list of str, got {type(self.stop).__name__}")
        self.stop = list(self.stop or [])
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise TypeError(f"stop_token_ids must be a list of int, got {type(self.stop_token_ids).__name__}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name in ("allowed_token_ids", "bad_words", "logits_processors"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise TypeError(f"{name} must be a list, got {type(value).__name__}")
            if value is not None:
                setattr(self, name, list(value))
        if self.best_of is None and is_int(self.n):
            self.best_of = self.n
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("give structured_outputs or guided_decoding (its older name), not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = structured_outputs_params(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        self._validate_numbers()
        self._validate_counts()
        self._validate_stops()
        self._validate_token_lists()
        self._validate_output_kind()
        check_bools(self, ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"))
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(
                "structured_outputs must be a StructuredOutputsParams (or a dict of its fields), "
                f"got {type(self.structured_outputs).__name__}"
            )
        if self.seed is not None:
            if not is_int(self.seed):
                raise TypeError(f"seed must be an int or None, got {self.seed!r}")
            if not 0 <= self.seed <= MAX_SEED - self.best_of + 1:
                raise ValueError(f"seed must be in [0, 2**63 - {self.best_of}], got {self.seed}")

    def _validate_numbers(self) -> None:
        """The float settings: finite numbers in their ranges."""
        check_finite(
            self, ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
        )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    def _validate_counts(self) -> None:
        """The integer settings: n, best_of, top_k, token counts and logprob counts."""
        for name in ("n", "best_of", "top_k", "max_tokens", "min_tokens"):
            if not is_int(getattr(self, name)) and not (name == "max_tokens" and self.max_tokens is None):
                raise TypeError(f"{name} must be an int, got {getattr(self, name)!r}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.best_of < self.n:
            raise ValueError(f"best_of must be >= n, got best_of={self.best_of} n={self.n}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not is_int(value):
                raise TypeError(f"{name} must be an int or None, got {value!r}")
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")

    def _validate_stops(self) -> None:
        if not all(isinstance(s, str) for s in self.stop):
            raise TypeError("stop must be a str or a list of str")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")
        if not all(is_int(t) for t in self.stop_token_ids):
            raise TypeError(f"stop_token_ids must be ints, got {self.stop_token_ids!r}")

    def _validate_token_lists(self) -> None:
        """allowed_token_ids, bad_words, logits_processors and logit_bias."""
        if self.allowed_token_ids is not None:
            if not all(is_int(t) for t in self.allowed_token_ids):
                raise TypeError(f"allowed_token_ids must be ints, got {self.allowed_token_ids!r}")
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
        if self.bad_words is not None and not all(isinstance(w, str) and w for w in self.bad_words):
            raise TypeError(f"bad_words must be non-empty strings, got {self.bad_words!r}")
        for fn in self.logits_processors or ():
            if not callable(fn):
                raise TypeError(
                    "logits_processors must be callables (output_token_ids, logits) -> logits, "
                    "(prompt_token_ids, output_token_ids, logits) -> logits, or BatchLogitsProcessor instances"
                )
            processor_arity(fn)  # a callable of another shape fails here, not mid-step
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            for token, bias in self.logit_bias.items():
                if not is_int(token) or not is_number(bias) or not math.isfinite(bias):
                    raise TypeError(f"logit_bias must map int token ids to finite numbers, got {token!r}: {bias!r}")
                if not -100 <= bias <= 100:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")

    def _validate_output_kind(self) -> None:
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.output_kind is RequestOutputKind.DELTA and self.best_of != self.n:
            raise ValueError("best_of must equal n to use output_kind=DELTA (the best samples are known at the end)")

    def clone(self) -> "SamplingParams":
        """A copy whose lists and dicts are its own (logits processors are shared)."""
        return dataclasses.replace(self, logit_bias=None if self.logit_bias is None else dict(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def width(self) -> int:
        """Sequences the request runs at once after its prefill."""
        return self.best_of


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams. temperature > 0 divides the logits before the log-softmax."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not is_int(value):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        check_finite(self, ("temperature", "length_penalty"))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        check_bools(self, ("ignore_eos", "include_stop_str_in_output"))

    @property
    def width(self) -> int:
        return self.beam_width


def with_output_kind(params: list, kind: RequestOutputKind) -> list:
    """`params` with `kind` of outputs: a copy of each distinct SamplingParams that asks for another
    (the caller's stay as they are); beam searches' as they are (they have no kind)."""
    copies: dict[int, SamplingParams] = {}
    for p in params:
        if isinstance(p, SamplingParams) and p.output_kind is not kind and id(p) not in copies:
            copies[id(p)] = dataclasses.replace(p, output_kind=kind)
    return [copies.get(id(p), p) for p in params]


def structured_outputs_params(fields: dict) -> StructuredOutputsParams:
    """StructuredOutputsParams from a dict of its fields (a JSON body, a scenario); TypeError naming an unknown one."""
    known = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(f"structured_outputs has no field {unknown[0]!r}; its fields: {', '.join(sorted(known))}")
    return StructuredOutputsParams(**fields)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_finite(params, names: tuple[str, ...]) -> None:
    """TypeError naming the first field that is not a number, ValueError for one that is not finite."""
    for name in names:
        value = getattr(params, name)
        if not is_number(value):
            raise TypeError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")


def check_bools(params, names: tuple[str, ...]) -> None:
    for name in names:
        if not isinstance(getattr(params, name), bool):
            raise TypeError(f"{name} must be a bool, got {getattr(params, name)!r}")


class BatchLogitsProcessor:
    """The batch-wise form of a logits processor, explicit (in the spirit of vLLM v1's
    LogitsProcessor): subclass it and implement __call__(output_token_ids: list[list[int]],
    logits: Tensor[b, V]) -> Tensor[b, V]; it runs once per step over every row that carries it."""

    def __call__(self, output_token_ids: list[list[int]], logits):
        raise NotImplementedError


def processor_arity(fn: Callable) -> int:
    """How a logits processor is called: 0 batch-wise (a BatchLogitsProcessor), else its number of
    positional arguments (2 or 3, vLLM's per-request forms)."""
    if isinstance(fn, BatchLogitsProcessor):
        return 0
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: assume vLLM's common form
        return 2
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in params) or len(positional) in (2, 3):
        return 3 if len(positional) >= 3 else 2
    raise TypeError(
        f"logits processor {getattr(fn, '__name__', fn)!r} takes {len(positional)} arguments; vLLM's forms take "
        "(output_token_ids, logits) or (prompt_token_ids, output_token_ids, logits)"
    )
