import math
from dataclasses import dataclass

MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit value


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping rules, with vLLM's names. temperature 0 is greedy.
    A wrong type is a TypeError, a value out of range a ValueError; both name the field.

    n samples are returned per prompt; best_of (default n) are generated, all forked from one
    prefill and sharing its pages, and the n with the highest cumulative logprob returned.
    Sample i draws from seed + i when a seed is given, so sample 0 is the n=1 request's."""

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise TypeError(f"stop must be a str or a list of str, got {type(self.stop).__name__}")
        self.stop = list(self.stop or [])
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise TypeError(f"stop_token_ids must be a list of int, got {type(self.stop_token_ids).__name__}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.best_of is None and _is_int(self.n):
            self.best_of = self.n
        self.validate()

    def validate(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not _is_number(value):
                raise TypeError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value}")
        for name in ("n", "best_of", "top_k", "max_tokens"):
            if not _is_int(getattr(self, name)):
                raise TypeError(f"{name} must be an int, got {getattr(self, name)!r}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.best_of < self.n:
            raise ValueError(f"best_of must be >= n, got best_of={self.best_of} n={self.n}")
        if self.best_of > 1 and self.temperature == 0:
            raise ValueError(
                f"n/best_of > 1 needs temperature > 0 (greedy samples are all the same), got best_of={self.best_of}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not all(isinstance(s, str) for s in self.stop):
            raise TypeError("stop must be a str or a list of str")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not all(_is_int(t) for t in self.stop_token_ids):
            raise TypeError(f"stop_token_ids must be ints, got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.seed is not None:
            if not _is_int(self.seed):
                raise TypeError(f"seed must be an int or None, got {self.seed!r}")
            if not 0 <= self.seed <= MAX_SEED - self.best_of + 1:
                raise ValueError(f"seed must be in [0, 2**63 - {self.best_of}], got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def width(self) -> int:
        """Sequences the request runs at once after its prefill."""
        return self.best_of


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
