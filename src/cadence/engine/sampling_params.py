"""Per-request sampling settings, with vLLM's names and meanings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cadence.sampling_limits import FLOAT32_MAX, INT64_MAX, MAX_LOGPROBS
from cadence.structured_outputs.params import StructuredOutputsParams

# Below this temperature sampling is greedy: dividing logits by it would overflow (vLLM
# uses the same cut-off).
GREEDY_TEMPERATURE = 1e-5
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` means greedy. `seed` makes one request's samples reproducible
    whatever else shares its batch. `logprobs` / `prompt_logprobs` ask for that many top
    alternatives per position (0 means only the chosen token's own logprob).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # OpenAI's logit_bias: token id -> value added to its logit, from -100 to 100.
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            check(
                math.isfinite(value) and abs(value) <= FLOAT32_MAX,
                f"{name} must be a finite number no larger than {FLOAT32_MAX:.4g} in magnitude, got {value}",
            )
        check(self.n >= 1, f"n must be at least 1, got {self.n}")
        check(
            self.max_tokens is None or self.max_tokens >= 1,
            f"max_tokens must be at least 1, got {self.max_tokens}",
        )
        check(self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        check(self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        check(0 <= self.top_k <= INT64_MAX, f"top_k must be -1, 0 or positive, got {self.top_k}")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        check(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        check(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        check(
            self.repetition_penalty > 0.0,
            f"repetition_penalty must be positive, got {self.repetition_penalty}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(
                value is None or 0 <= value <= MAX_LOGPROBS,
                f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}",
            )
        for token_id, bias in (self.logit_bias or {}).items():
            check(
                isinstance(token_id, int) and 0 <= token_id <= INT64_MAX,
                f"logit_bias keys must be token ids, got {token_id!r}",
            )
            check(
                math.isfinite(bias) and -100.0 <= bias <= 100.0, f"logit_bias values must be in [-100, 100], got {bias}"
            )
        check(all(isinstance(s, str) and s for s in self.stop_strings), "stop strings must be non-empty")
        check(
            all(0 <= t <= INT64_MAX for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids}",
        )

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings as a list, whichever form `stop` was given in."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else self.stop

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
