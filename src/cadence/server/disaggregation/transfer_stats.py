"""What a router sees of prompt KV moving between engines: counts, bytes, latencies, and
the prefill-to-decode engine ratio the current traffic calls for."""

from __future__ import annotations

from dataclasses import dataclass, field

from cadence.engine.histogram import Histogram
from cadence.engine.protocol import EngineStats

# Upper bounds (seconds) of the transfer-latency histogram's buckets; +Inf is implied.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class TransferStats:
    """Running totals of the coordinator's decisions and of the loads it asked for."""

    num_local_prefills: int = 0  # prompts computed on their decode engine
    num_remote_prefills: int = 0  # prompts sent to a prefill engine (a re-send counts again)
    num_rerouted: int = 0  # re-sent after their prefill engine died or refused
    num_complete: int = 0  # loads that brought every token
    num_incomplete: int = 0  # loads cut short: the decode engine computed the rest
    remote_prompt_tokens: int = 0  # uncached prompt tokens sent to prefill engines
    bytes_transferred: int = 0
    # Seconds from asking a decode engine to load to hearing the outcome.
    latency: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))

    def observe_load(self, seconds: float, complete: bool, num_bytes: int) -> None:
        self.latency.observe(seconds)
        if complete:
            self.num_complete += 1
        else:
            self.num_incomplete += 1
        self.bytes_transferred += num_bytes

    @property
    def mean_remote_prompt_tokens(self) -> float:
        return self.remote_prompt_tokens / self.num_remote_prefills if self.num_remote_prefills else 0.0


def engine_rate(stats: list[EngineStats], tokens: str) -> float:
    """Tokens per busy second of one engine, over engines of one role; 0 before any work."""
    busy = sum(s.busy_seconds for s in stats)
    return sum(getattr(s, tokens) for s in stats) / busy if busy > 0 else 0.0


def recommended_prefill_decode_ratio(
    prefill: list[EngineStats], decode: list[EngineStats], prompt_tokens: float, output_tokens: float
) -> float:
    """Prefill engines per decode engine that keeps both pools equally busy: a request's
    prompt takes `prompt_tokens / prefill rate` of a prefill engine, its output
    `output_tokens / decode rate` of a decode engine (rates as measured, at the batch
    sizes the current load gives). 0 until both roles have worked and requests finished."""
    prefill_rate = engine_rate(prefill, "num_computed_tokens")
    decode_rate = engine_rate(decode, "num_sampled_tokens")
    if not (prefill_rate and decode_rate and prompt_tokens and output_tokens):
        return 0.0
    return (prompt_tokens / prefill_rate) / (output_tokens / decode_rate)
