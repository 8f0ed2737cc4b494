"""How many tokens each request computes in one scheduler step."""

from __future__ import annotations

from dataclasses import dataclass

from cadence.scheduler.request import Request


@dataclass
class ScheduledRequest:
    """`num_new_tokens` tokens of `request`, from position `request.num_computed_tokens`."""

    request: Request
    num_new_tokens: int


class StepChunks:
    """How many tokens each request computes in one step: what it has left, within the
    budget and `long_prefill_token_threshold`; and prompts a router capped
    (`Request.max_chunk_tokens`) share one such cap between them, the first one's, so
    that several of them stall the step no more than one would."""

    def __init__(self, long_prefill_token_threshold: int) -> None:
        self.threshold = long_prefill_token_threshold
        self.capped_left: int | None = None  # what the capped prompts may still take

    @staticmethod
    def capped(request: Request, remaining: int) -> bool:
        return request.max_chunk_tokens > 0 and remaining > 1

    def used_up(self, request: Request, remaining: int) -> bool:
        """Whether `request` is a capped prompt and the capped prompts' share is gone."""
        return self.capped(request, remaining) and self.capped_left == 0

    def size(self, request: Request, remaining: int, budget: int) -> int:
        size = min(remaining, budget)
        if self.threshold > 0:
            size = min(size, self.threshold)
        if self.capped(request, remaining):
            size = min(size, request.max_chunk_tokens)
            if self.capped_left is not None:  # a later capped prompt gets what is left, at most its own cap
                size = min(size, self.capped_left)
        return size

    def took(self, request: Request, remaining: int, size: int) -> None:
        if self.capped(request, remaining):
            self.capped_left = (request.max_chunk_tokens if self.capped_left is None else self.capped_left) - size
