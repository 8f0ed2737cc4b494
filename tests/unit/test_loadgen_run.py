"""loadgen/run.py against an in-process fake server: what a run records when its deadline
cuts it, that the /metrics scrape before a run is not charged to its first requests, that
warm-ups leave the measured prompts uncached, and the server-metrics deltas."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from aiohttp import web

from cadence.client.metrics import parse_metrics
from cadence.loadgen.datasets import SampleRequest
from cadence.loadgen.records import RunSettings
from cadence.loadgen.request import Target
from cadence.loadgen.run import RunOptions, run_load
from cadence.loadgen.server_metrics import MetricsScraper
from cadence.loadgen.stats import summarize

IDLE_METRICS = (
    "# TYPE cadence:num_requests_running gauge\ncadence:num_requests_running 0\n"
    "# TYPE cadence:num_requests_waiting gauge\ncadence:num_requests_waiting 0\n"
)


@dataclass
class FakeServer:
    """Streams `max_tokens` chunks, `itl` apart; its /metrics answers after `metrics_delay`."""

    itl: float = 0.01
    metrics_delay: float = 0.0
    metrics_text: str = IDLE_METRICS
    prompts: list[str] = field(default_factory=list)
    streams_finished: int = 0  # streams that ran to their last chunk
    first_metrics_answer: float | None = None  # time.time() when /metrics first answered

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.prompts.append(body["prompt"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        tokens = int(body["max_tokens"])
        for i in range(tokens):
            await asyncio.sleep(self.itl)
            choice = {"index": 0, "text": " t", "finish_reason": "length" if i == tokens - 1 else None}
            await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        self.streams_finished += 1
        return response

    async def metrics(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.metrics_delay)
        if self.first_metrics_answer is None:
            self.first_metrics_answer = time.time()
        return web.Response(text=self.metrics_text)


@asynccontextmanager
async def serving(server: FakeServer) -> AsyncIterator[Target]:
    app = web.Application()
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_get("/metrics", server.metrics)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield Target(f"http://127.0.0.1:{runner.addresses[0][1]}", "fake")
    finally:
        await runner.cleanup()


def harness_tasks() -> list[str]:
    """The run's own tasks still alive (requests, dispatcher, lag probe, metrics sampler)."""
    names = [getattr(t.get_coro(), "__qualname__", "") for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    return [n for n in names if "run_load" in n or "_lag_probe" in n or "_sample_loop" in n]


def test_the_deadline_ends_every_request_and_keeps_what_arrived() -> None:
    # 20 requests due 0.1 s apart, each streaming for 5 s: at the 1 s deadline about ten
    # are in flight and ten were never sent.
    samples = [SampleRequest(f"p{i}", 1, 50) for i in range(20)]
    settings = RunSettings(10.0, 1000.0, None, 20)
    options = RunOptions(scrape_metrics=False, progress=False, max_duration=1.0)

    server = FakeServer(itl=0.1)

    async def run() -> None:
        async with serving(server) as target:
            result, _ = await asyncio.wait_for(run_load(target, samples, settings, options), timeout=60)
            # The run ended at its deadline: it waited for none of the 5 s streams to end.
            assert server.streams_finished == 0
            assert harness_tasks() == []
        records = result.records
        sent = [r for r in records if r.sent is not None]
        unsent = [r for r in records if r.sent is None]
        assert 5 <= len(sent) <= 15 and len(sent) + len(unsent) == 20
        assert all("not finished within --max-duration" in r.error for r in sent)
        assert all("not sent within --max-duration" in r.error for r in unsent)
        # What a cut stream had received is kept: the first one streamed for about 1 s.
        assert len(records[0].token_times) >= 5 and records[0].output_tokens == len(records[0].token_times)
        assert all(r.sent is not None and r.done >= r.sent for r in sent)
        assert len(result.health.send_delays) == len(sent) and min(result.health.send_delays) >= 0
        summary = summarize(result)
        assert summary["completed"] == 0 and summary["failed"] == 20
        assert summary["max_concurrent_requests"] == len(sent)  # the unsent were never in flight
        assert summary["mean_send_delay_ms"] >= 0
        assert result.duration >= 1.0  # the cut requests ran to the deadline

    asyncio.run(run())


def test_the_scrape_before_the_run_is_not_charged_to_its_first_requests() -> None:
    samples = [SampleRequest(f"p{i}", 1, 2) for i in range(4)]
    settings = RunSettings(100.0, 1000.0, None, 4)
    options = RunOptions(progress=False, metrics_interval=0.05, idle_timeout=5.0)

    server = FakeServer(metrics_delay=0.5)

    async def run() -> None:
        async with serving(server) as target:
            result, scraper = await run_load(target, samples, settings, options)
            assert harness_tasks() == []
        assert all(r.success for r in result.records)
        # The requests are due from the run's start, and the run starts once the scrape before
        # it has its answer: its 0.5 s are nobody's send delay.
        assert server.first_metrics_answer is not None and server.first_metrics_answer <= result.started_at
        assert scraper is not None and scraper.report()["available"]

    asyncio.run(run())


def test_a_metrics_page_that_is_not_prometheus_text_is_reported_not_raised() -> None:
    samples = [SampleRequest("p", 1, 2)]
    options = RunOptions(progress=False, metrics_interval=0.05)

    async def run() -> None:
        async with serving(FakeServer(metrics_text="<html>a proxy's page</html>")) as target:
            result, scraper = await run_load(target, samples, RunSettings(1.0, 1.0, None, 1), options)
        assert result.records[0].success
        assert scraper is not None and not scraper.report()["available"]
        assert "not Prometheus text" in scraper.report()["error"]

    asyncio.run(run())


def test_warm_ups_do_not_send_the_measured_prompts() -> None:
    samples = [SampleRequest(f"measured prompt {i}", 3, 2) for i in range(4)]
    settings = RunSettings(float("inf"), 1.0, 2, 4)
    options = RunOptions(scrape_metrics=False, progress=False, num_warmups=3)
    server = FakeServer()

    async def run() -> None:
        async with serving(server) as target:
            result, _ = await run_load(target, samples, settings, options)
        assert all(r.success for r in result.records)

    asyncio.run(run())
    warm_ups, measured = server.prompts[:3], server.prompts[3:]
    assert sorted(measured) == sorted(s.prompt for s in samples)
    # A prompt a warm-up sent would be in the prefix cache for its measured request.
    assert all(not w.startswith(s.prompt[:10]) for w in warm_ups for s in samples)


def metrics_text(success: dict[tuple[str, str, str], float], generated: float) -> str:
    lines = ["# TYPE vllm:num_requests_running gauge"]
    lines += [f'vllm:num_requests_running{{engine="{e}",model_name="m"}} 0' for e in "01"]
    lines.append("# TYPE vllm:request_success counter")
    for (engine, model, reason), value in success.items():
        labels = f'engine="{engine}",finished_reason="{reason}",model_name="{model}"'
        lines.append(f"vllm:request_success_total{{{labels}}} {value}")
    lines.append("# TYPE vllm:generation_tokens counter")
    lines.append(f'vllm:generation_tokens_total{{engine="0",model_name="a"}} {generated}')
    lines.append(f'vllm:generation_tokens_total{{engine="0",model_name="b"}} {generated}')
    return "\n".join(lines) + "\n"


def test_server_deltas_add_up_over_engines_and_models() -> None:
    scraper = MetricsScraper(None, Target("http://x", "m"), 0.0)  # type: ignore[arg-type]
    before = {("0", "m", "stop"): 1.0, ("1", "m", "stop"): 2.0, ("0", "m", "abort"): 0.0}
    after = {("0", "m", "stop"): 4.0, ("1", "m", "stop"): 7.0, ("0", "m", "abort"): 3.0}
    scraper.before, scraper.after = parse_metrics(metrics_text(before, 10)), parse_metrics(metrics_text(after, 15))
    scraper.prefix = "vllm"
    key = scraper.report()["key"]
    assert key["request_success"] == {"stop": 8.0, "abort": 3.0}
    assert key["generation_tokens"] == 10.0  # 5 more for each of two models
