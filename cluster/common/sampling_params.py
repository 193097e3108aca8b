"""SamplingParams: how to pick each next token and when to stop. Validated on construction, so a bad
value fails with an InvalidRequestError naming the parameter before it reaches any engine."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from cluster.common.errors import InvalidRequestError

#: Top logprobs a request may ask for per token.
MAX_LOGPROBS = 20


def _check(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise InvalidRequestError(f"{param}: {message}", param=param)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request, with the names and meanings of vLLM's ``SamplingParams``.

    ``temperature == 0`` is greedy. ``top_k <= 0`` (or -1) and ``top_p == 1`` disable those filters.
    ``max_tokens=None`` generates until a stop condition or the model's context length.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    #: Seconds from arrival after which the request is aborted with a timeout; None: no deadline.
    deadline_s: float | None = None
    _extra: dict[str, object] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Accept a lone string / list for convenience, but store tuples (frozen, hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _check(_is_number(self.temperature) and self.temperature >= 0.0, "temperature",
               f"must be >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p",
               f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 0), "top_k",
               f"must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p",
               f"must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or _is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
               f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        _check(_is_number(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
               "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        _check(_is_number(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
               "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0.0,
               "repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        _check(self.deadline_s is None or (_is_number(self.deadline_s) and self.deadline_s > 0),
               "deadline_s", f"must be > 0 seconds, got {self.deadline_s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def has_filters(self) -> bool:
        """Whether a draw keeps only part of the distribution (top-k, top-p or min-p)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0

    def replace(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
