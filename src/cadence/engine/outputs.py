"""What the offline API returns, with vLLM's names and shapes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one token at one position, its rank, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's alternatives: token id -> Logprob (the chosen token is always present).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of the n sequences generated for a prompt."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A prompt and its completions; `prompt_logprobs[0]` is None, as in vLLM."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
