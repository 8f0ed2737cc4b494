"""The messages that cross the boundary between a front end and an EngineCore.

Today the offline `LLM` calls the core in-process; the server's ZMQ transport will carry
exactly these dataclasses, so nothing else may cross the boundary.
"""
from __future__ import annotations

from dataclasses import dataclass

from cadence.engine.sampling_params import SamplingParams

# Per position: the chosen token first, then the top alternatives, as parallel lists,
# and the chosen token's rank (1 = most likely).
TokenLogprobs = tuple[list[int], list[float], int]


@dataclass
class EngineCoreRequest:
    """A validated request: token ids in, sampling settings, and scheduling priority."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0


@dataclass
class EngineCoreOutput:
    """What one step produced for one sequence (`index` < n) of a request."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    # Prompt logprobs of the positions computed this step; position 0 never has one.
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    """Gauges a front end can show or export."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
