"""One load run: requests released on schedule, timed, and the harness's own lag measured.

A dispatcher releases each request when it is due; under `--max-concurrency` it then
waits for a slot, and that wait counts against its latency (see records.py). Every run is
bounded: the requests are a fixed list, each has a timeout, and the run a deadline after
which whatever is still open is cancelled and recorded as failed.
"""

from __future__ import annotations

import asyncio
import gc
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from cadence.loadgen.datasets import SampleRequest
from cadence.loadgen.faults import abort_point, assign_kinds, malformed_cases
from cadence.loadgen.records import HarnessHealth, RequestRecord, RunResult, RunSettings
from cadence.loadgen.request import StreamReader, Target, send_raw, stream_request
from cadence.loadgen.schedule import arrival_offsets
from cadence.loadgen.server_metrics import MetricsScraper

# How often the event loop's own lateness is sampled.
LAG_PROBE_SECONDS = 0.01


@dataclass(frozen=True)
class RunOptions:
    seed: int = 0
    num_warmups: int = 0
    abort_fraction: float = 0.0
    malformed_fraction: float = 0.0
    request_timeout: float = 600.0  # seconds for one request, connection to last byte
    max_duration: float = 3600.0  # seconds for the whole run
    metrics_interval: float = 1.0  # seconds between /metrics samples; 0 scrapes only before and after
    scrape_metrics: bool = True
    idle_timeout: float = 30.0  # seconds to wait for the server's gauges to return to idle after faults
    progress: bool = True


def _session(options: RunOptions) -> aiohttp.ClientSession:
    # A connection per request: some servers (llama.cpp's) close a kept-alive connection
    # just as the next request goes out on it, which would fail that request. The number
    # of connections is bounded by the requests in flight, which the run bounds itself.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=options.request_timeout, connect=min(30.0, options.request_timeout))
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


async def _lag_probe(health: HarnessHealth) -> None:
    loop = asyncio.get_running_loop()
    while True:
        expected = loop.time() + LAG_PROBE_SECONDS
        await asyncio.sleep(LAG_PROBE_SECONDS)
        health.loop_lag.append(max(0.0, loop.time() - expected))


async def _warm_up(
    session: aiohttp.ClientSession, target: Target, samples: Sequence[SampleRequest], count: int
) -> None:
    """`count` requests, at most 8 at a time, before anything is measured.

    Their prompts open with words of their own, so no measured request finds its prompt in
    the server's prefix cache because a warm-up sent it first.
    """
    if count <= 0:
        return
    gate = asyncio.Semaphore(8)
    start = time.perf_counter()

    async def one(i: int) -> None:
        sample = samples[i % len(samples)]
        warm = SampleRequest(f"Warm-up request {i}. {sample.prompt}", sample.prompt_len, sample.output_len)
        reader = StreamReader(RequestRecord(-1 - i, "normal", 0, 0, 0.0), start)
        async with gate:
            await stream_request(session, target, warm, reader)
        reader.finish()
        if not reader.record.success:
            raise RuntimeError(f"a warm-up request failed: {reader.record.error}")

    await asyncio.gather(*(one(i) for i in range(count)))


async def run_load(
    target: Target, samples: Sequence[SampleRequest], settings: RunSettings, options: RunOptions
) -> tuple[RunResult, MetricsScraper | None]:
    """Send every sample on the arrival schedule; the run's records and its /metrics scraper."""
    count = len(samples)
    kinds = assign_kinds(count, options.abort_fraction, options.malformed_fraction, options.seed)
    offsets = arrival_offsets(count, settings.request_rate, settings.burstiness, options.seed)
    closed_loop = math.isinf(settings.request_rate)
    cases = malformed_cases(target)
    rng = random.Random(options.seed + 1)
    records = [RequestRecord(i, kinds[i], s.prompt_len, s.output_len, offsets[i]) for i, s in enumerate(samples)]
    aborts = {i: abort_point(samples[i], rng) for i in range(count) if kinds[i] == "abort"}
    limit = settings.max_concurrency
    gate = asyncio.Semaphore(limit) if limit else None
    health = HarnessHealth()
    async with _session(options) as session:
        await _warm_up(session, target, samples, options.num_warmups)
        scraper = MetricsScraper(session, target, options.metrics_interval) if options.scrape_metrics else None
        if scraper is not None:
            # Before the clock starts: the first requests are due at 0, and this scrape's
            # time must not be charged to their latencies.
            await scraper.scrape_before()
        started_at = time.time()
        start = time.perf_counter()
        clock = lambda: time.perf_counter() - start  # noqa: E731 - shared by every request of the run
        if scraper is not None:
            scraper.begin(start)
        bar = tqdm(total=count, disable=not options.progress, unit="req", leave=False)
        readers: list[StreamReader] = []  # kept by the run, so a stream cut at the deadline is still read
        tasks: list[asyncio.Task[None]] = []  # tasks[i] sends records[i]

        async def one(record: RequestRecord, case_index: int) -> None:
            if gate is not None:
                await gate.acquire()
            try:
                if closed_loop:
                    record.due = clock()
                sample = samples[record.index]
                if record.kind == "malformed":
                    body = target.body(sample)
                    await send_raw(session, target, cases[case_index % len(cases)].make(body), record, start)
                else:
                    reader = StreamReader(record, start)
                    readers.append(reader)
                    await stream_request(session, target, sample, reader, aborts.get(record.index))
            finally:
                if gate is not None:
                    gate.release()
                bar.update(1)

        async def dispatch() -> None:
            malformed_seen = 0
            for record in records:
                delay = record.due - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(record, malformed_seen)))
                malformed_seen += record.kind == "malformed"

        probe = asyncio.create_task(_lag_probe(health))
        dispatcher = asyncio.create_task(dispatch())
        # The run keeps every read of every stream until it ends; a cyclic collection over
        # that many objects stalls the loop for tens of milliseconds, which would land in
        # the latencies. Nothing the run allocates is cyclic garbage, so collection waits.
        collecting = gc.isenabled()
        gc.disable()
        try:
            await asyncio.wait([dispatcher], timeout=options.max_duration)
            if dispatcher.done():
                dispatcher.result()  # raises what went wrong in it
                remaining = options.max_duration - clock()
                if tasks and remaining > 0:
                    await asyncio.wait(tasks, timeout=remaining)
        finally:
            if collecting:
                gc.enable()
            # The deadline (or an error) leaves requests open, perhaps some never created:
            # every task the run started ends here, whatever happened.
            for task in (probe, dispatcher, *tasks):
                task.cancel()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(probe, dispatcher, return_exceptions=True)
            bar.close()
            if scraper is not None:
                scraper.cancel()
        cut = clock()
        for record, outcome in zip(records, outcomes):
            if isinstance(outcome, Exception):  # a fault of the harness, not the server: show it
                record.error = record.error or f"harness error: {type(outcome).__name__}: {outcome}"
        for record in records:
            if record.sent is None:
                record.error = record.error or f"not sent within --max-duration {options.max_duration:g} s"
                record.done = cut
            elif not record.done:
                record.error = record.error or f"not finished within --max-duration {options.max_duration:g} s"
                record.done = cut
        for reader in readers:
            reader.finish()
        # To the last answer complete, or to the cut for a request the deadline ended.
        duration = max((r.done for r in records if r.sent is not None), default=0.0)
        health.send_delays = [d for r in records if (d := r.send_delay) is not None]
        if scraper is not None:
            await scraper.stop(options.idle_timeout)
        return RunResult(settings, started_at, duration, records, health), scraper
