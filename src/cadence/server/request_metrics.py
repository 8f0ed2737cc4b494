"""Request- and step-level metrics, accumulated in the API process from what the engines
send with their outputs, and exported at scrape time.

Front-end clock: time to first token, inter-token latency and end-to-end latency count
from the request's arrival here. Engine clock: queue, prefill, decode and inference time
are differences of the engine's own timestamps (the first token's output carries when
the engine queued and first scheduled the sequence; each step carries when it ended), so
engines on other hosts need no synchronized clock. Every figure is per sequence (n > 1
makes n), as vLLM counts its parallel-sampling children.

Histograms are plain bucket counts observed on the event loop and turned into
Prometheus families only when scraped: the serving path takes no lock and builds no
objects for metrics.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import Metric

from cadence.engine.experts.stats import ExpertStepStats
from cadence.engine.histogram import Histogram
from cadence.engine.protocol import EngineCoreOutput, StepStats
from cadence.server import metric_series as S
from cadence.server.series_collector import SeriesCollector


@dataclass
class _Sequence:
    """What the front end tracks of one sequence in flight."""

    first_token_at: float = 0.0  # front-end clock; 0 before the first token
    last_token_at: float = 0.0
    num_tokens: int = 0
    queued_at: float = 0.0  # engine clock, from the first token's output
    scheduled_at: float = 0.0
    first_engine_at: float = 0.0  # engine clock: the steps that gave the first and latest tokens
    last_engine_at: float = 0.0


@dataclass
class _Request:
    arrived_at: float
    num_prompt_tokens: int
    prompt_counted: bool = False
    ended: list[dict[str, Any]] = field(default_factory=list)  # each sequence's summary, as it ends


@dataclass
class RequestMetrics:
    """The accumulated figures; RequestMetricsCollector exports them."""

    max_model_len: int
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # Every reason from the start, so that rates and alerts have a series before the first.
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("stop", "length", "abort"), 0))
    rejections: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("full", "unavailable"), 0))
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    experts: ExpertStepStats | None = None  # summed once an engine reports offloading
    histograms: dict[tuple[str, str], Histogram] = field(default_factory=dict)  # (series name, label) ->
    _requests: dict[str, _Request] = field(default_factory=dict)
    _sequences: dict[tuple[str, int], _Sequence] = field(default_factory=dict)

    def _observe(self, series: S.Series, value: float, label: str = "") -> None:
        histogram = self.histograms.get((series.name, label))
        if histogram is None:
            bounds = series.buckets or S.buckets_1_2_5(self.max_model_len)
            histogram = self.histograms[(series.name, label)] = Histogram(bounds)
        histogram.observe(value)

    # ----- what the server reports -----------------------------------------------------
    def admitted(self, request_id: str, num_prompt_tokens: int, n: int, max_tokens: int) -> None:
        self._requests[request_id] = _Request(time.monotonic(), num_prompt_tokens)
        for index in range(n):
            self._sequences[(request_id, index)] = _Sequence()
        self._observe(S.REQUEST_PARAMS_N, n)
        self._observe(S.REQUEST_PARAMS_MAX_TOKENS, max_tokens)

    def rejected(self, reason: str) -> None:
        self.rejections[reason] = self.rejections.get(reason, 0) + 1

    def step(self, stats: StepStats) -> None:
        self._observe(S.ITERATION_TOKENS, stats.num_tokens)
        self._observe(S.STEP_SECONDS, stats.seconds, stats.kind)
        self._observe(S.STEP_BATCH_SIZE, stats.num_sequences, stats.kind)
        self.prefix_cache_queries += stats.prefix_cache_queries
        self.prefix_cache_hits += stats.prefix_cache_hits
        if stats.experts is not None:
            self.experts = stats.experts.plus(self.experts or ExpertStepStats())

    def tokens(self, output: EngineCoreOutput, step_ended_at: float, now: float) -> None:
        """A sequence's new tokens, as the step that ended at `step_ended_at` (engine clock)
        made them and the front end got them at `now`."""
        sequence = self._sequences.get((output.request_id, output.index))
        if sequence is None or not output.new_token_ids:
            return
        self.generation_tokens += len(output.new_token_ids)
        if sequence.num_tokens == 0:
            request = self._requests[output.request_id]  # open sequences' requests are never gone
            sequence.first_token_at = now
            self._observe(S.TTFT, now - request.arrived_at)
            sequence.queued_at, sequence.scheduled_at = output.queued_at, output.scheduled_at
            sequence.first_engine_at = step_ended_at
            if not request.prompt_counted:
                request.prompt_counted = True
                self.prompt_tokens += request.num_prompt_tokens
        else:
            self._observe(S.ITL, now - sequence.last_token_at)
        sequence.num_tokens += len(output.new_token_ids)
        sequence.last_token_at, sequence.last_engine_at = now, step_ended_at

    def sequence_finished(self, request_id: str, index: int, reason: str) -> None:
        """A sequence ended (stop, length, or abort for whatever cut it short)."""
        sequence = self._sequences.pop((request_id, index), None)
        if sequence is None:
            return
        request = self._requests[request_id]
        self.finished[reason] = self.finished.get(reason, 0) + 1
        e2e = time.monotonic() - request.arrived_at
        self._observe(S.E2E_LATENCY, e2e)
        ttft = sequence.first_token_at - request.arrived_at if sequence.num_tokens else None
        queue = sequence.scheduled_at - sequence.queued_at if sequence.num_tokens else None
        request.ended.append(
            {
                "index": index,
                "finish_reason": reason,
                "tokens": sequence.num_tokens,
                "ttft_s": ttft,
                "queue_s": queue,
                "e2e_s": e2e,
            }
        )
        self._observe(S.REQUEST_PROMPT_TOKENS, request.num_prompt_tokens)
        self._observe(S.REQUEST_GENERATION_TOKENS, sequence.num_tokens)
        if sequence.num_tokens and sequence.scheduled_at:
            self._observe(S.QUEUE_TIME, sequence.scheduled_at - sequence.queued_at)
            self._observe(S.PREFILL_TIME, sequence.first_engine_at - sequence.scheduled_at)
            self._observe(S.DECODE_TIME, sequence.last_engine_at - sequence.first_engine_at)
            self._observe(S.INFERENCE_TIME, sequence.last_engine_at - sequence.scheduled_at)

    def request_finished(self, request_id: str, num_sequences: int, reason: str) -> dict[str, Any] | None:
        """The request is over: its sequences still open end with `reason`. Returns what
        the per-request log line says of it (None for a request never admitted)."""
        for index in range(num_sequences):
            self.sequence_finished(request_id, index, reason)
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        return {
            "request_id": request_id,
            "prompt_tokens": request.num_prompt_tokens,
            "sequences": sorted(request.ended, key=lambda ended: ended["index"]),
        }

    @property
    def num_finished(self) -> int:
        return sum(self.finished.values())


class RequestMetricsCollector(SeriesCollector):
    """Exports a RequestMetrics."""

    def __init__(self, metrics: RequestMetrics, model_name: str, prefix: str) -> None:
        super().__init__(model_name, prefix)
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        yield self.one(S.PROMPT_TOKENS, m.prompt_tokens)
        yield self.one(S.GENERATION_TOKENS, m.generation_tokens)
        yield self.family(S.REQUEST_SUCCESS, [((reason,), count) for reason, count in m.finished.items()])
        yield self.one(S.PREFIX_CACHE_QUERIES, m.prefix_cache_queries)
        yield self.one(S.PREFIX_CACHE_HITS, m.prefix_cache_hits)
        yield self.family(S.ADMISSION_REJECTIONS, [((reason,), count) for reason, count in m.rejections.items()])
        if m.experts is not None:
            yield from self.expert_series(m.experts)
        observed = list(m.histograms.items())
        for series in HISTOGRAMS:
            labelled = [((label,) if series.labels else (), h) for (name, label), h in observed if name == series.name]
            yield self.histograms(series, labelled)

    def expert_series(self, e: ExpertStepStats) -> Iterator[Metric]:
        yield self.one(S.EXPERT_CACHE_HITS, e.hits)
        yield self.one(S.EXPERT_CACHE_MISSES, e.misses)
        yield self.one(S.EXPERT_LOAD_BYTES, e.load_bytes)
        yield self.one(S.EXPERT_STALL_SECONDS, e.stall_seconds)
        yield self.one(S.EXPERT_PREFETCH_LOADS, e.prefetch_loads)
        yield self.one(S.EXPERT_PREFETCH_PREDICTED, e.prefetch_predicted)
        yield self.one(S.EXPERT_PREFETCH_CORRECT, e.prefetch_correct)
        yield self.one(S.EXPERT_PREFETCH_ROUTED, e.prefetch_routed)
        yield self.family(S.EXPERT_LAYER_STEPS, [(("cached",), e.cached_layers), (("streamed",), e.streamed_layers)])
        yield self.one(S.EXPERT_CPU_COMPUTED, e.cpu_computed)


HISTOGRAMS = (
    S.TTFT,
    S.ITL,
    S.E2E_LATENCY,
    S.QUEUE_TIME,
    S.PREFILL_TIME,
    S.DECODE_TIME,
    S.INFERENCE_TIME,
    S.REQUEST_PROMPT_TOKENS,
    S.REQUEST_GENERATION_TOKENS,
    S.ITERATION_TOKENS,
    S.REQUEST_PARAMS_N,
    S.REQUEST_PARAMS_MAX_TOKENS,
    S.STEP_SECONDS,
    S.STEP_BATCH_SIZE,
)
