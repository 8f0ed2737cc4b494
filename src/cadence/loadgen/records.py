"""What one load-generator run records: each request's timeline, and the run around them.

Times are seconds from the run's start on the harness's monotonic clock. A request's
latencies count from when it was *due* (its scheduled arrival), not from when the harness
got round to sending it: time spent waiting for a `--max-concurrency` slot, or behind a
busy harness, is time the user would have waited too. Under `--request-rate inf` a
request is due when a concurrency slot frees, so a closed loop is timed from its sends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# normal: an ordinary request; abort: the harness disconnects it mid-stream on purpose;
# malformed: the harness sends a body the server must refuse.
RequestKind = Literal["normal", "abort", "malformed"]


@dataclass
class RequestRecord:
    index: int
    kind: RequestKind
    prompt_len: int  # the dataset's count, in the served model's tokens
    expected_output_len: int  # max_tokens asked for
    due: float  # when the schedule said it should go out
    sent: float | None = None  # when its HTTP request started; None if it never went out
    done: float = 0.0  # when its answer (or its failure) was complete, or the run cut it off
    status: int | None = None  # the HTTP status; None when no answer came
    success: bool = False
    error: str = ""
    error_body: dict[str, Any] | None = None  # the server's JSON error body, where it sent one
    token_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    output_tokens: int = 0  # the server's usage count where it sent one, else the text chunks
    usage_prompt_tokens: int | None = None  # the server's usage count of prompt tokens
    finish_reason: str | None = None
    generated_text: str = ""

    @property
    def send_delay(self) -> float | None:
        """Seconds between being due and being sent: queueing inside the harness (None: never sent)."""
        return None if self.sent is None else self.sent - self.due

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.due if self.token_times else None

    @property
    def e2el(self) -> float:
        return self.done - self.due

    @property
    def itls(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first, as vLLM defines it."""
        ttft = self.ttft
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2el - ttft) / (self.output_tokens - 1)

    @property
    def input_tokens(self) -> int:
        """The server's count of this request's prompt where it reported one, else the dataset's."""
        return self.usage_prompt_tokens if self.usage_prompt_tokens is not None else self.prompt_len

    def detail(self) -> dict[str, Any]:
        """One line of the per-request detail file."""
        return {
            "index": self.index,
            "kind": self.kind,
            "status": self.status,
            "success": self.success,
            "error": self.error,
            "error_body": self.error_body,
            "prompt_len": self.prompt_len,
            "usage_prompt_tokens": self.usage_prompt_tokens,
            "expected_output_len": self.expected_output_len,
            "output_tokens": self.output_tokens,
            "finish_reason": self.finish_reason,
            "due_s": self.due,
            "send_delay_s": self.send_delay,
            "ttft_s": self.ttft,
            "tpot_s": self.tpot,
            "e2el_s": None if self.sent is None else self.e2el,
            "token_times_s": self.token_times,
        }


@dataclass
class HarnessHealth:
    """How far the harness itself fell behind during a run, to read its figures by."""

    loop_lag: list[float] = field(default_factory=list)  # how late each periodic wake-up of the event loop was
    send_delays: list[float] = field(default_factory=list)  # due-to-sent for every request sent


@dataclass
class RunSettings:
    """The arrival process and limits one run used."""

    request_rate: float  # requests per second; inf sends each as soon as a slot frees
    burstiness: float
    max_concurrency: int | None
    num_prompts: int

    def label(self) -> str:
        rate = "inf" if self.request_rate == float("inf") else f"{self.request_rate:g}"
        limit = "" if self.max_concurrency is None else f", max concurrency {self.max_concurrency}"
        return f"rate {rate}/s{limit}"


@dataclass
class RunResult:
    settings: RunSettings
    started_at: float  # wall-clock (time.time()) of the run's start
    duration: float  # from the first request due to the last answer complete (or cut off at the deadline)
    records: list[RequestRecord]
    health: HarnessHealth
    server: dict[str, Any] | None = None  # the /metrics report (loadgen/server_metrics.py), if scraped

    @property
    def normal(self) -> list[RequestRecord]:
        return [r for r in self.records if r.kind == "normal"]

    @property
    def succeeded(self) -> list[RequestRecord]:
        return [r for r in self.normal if r.success]
