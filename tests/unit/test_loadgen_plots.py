"""loadgen/plots.py: the data behind each figure, and that every figure renders to a PNG."""

from __future__ import annotations

import heapq
import math
import random
import sys
from pathlib import Path

import pytest

from cadence.loadgen.plots import (
    cdf,
    choose_bin_s,
    inflight_series,
    plot_run,
    plot_sweep,
    sweep_positions,
    throughput_series,
    waiting_series,
)
from cadence.loadgen.records import HarnessHealth, RequestRecord, RunResult, RunSettings
from cadence.loadgen.stats import SLO, summarize

pytest.importorskip("matplotlib")


def record(index: int, due: float, sent: float, done: float, tokens: list[float], **kw: object) -> RequestRecord:
    r = RequestRecord(index=index, kind="normal", prompt_len=10, expected_output_len=len(tokens), due=due)
    r.sent, r.done, r.token_times, r.output_tokens = sent, done, tokens, len(tokens)
    r.success, r.status = True, 200
    for key, value in kw.items():
        setattr(r, key, value)
    return r


def run_of(records: list[RequestRecord], rate: float = 4.0, limit: int | None = None) -> RunResult:
    duration = max((r.done for r in records), default=0.0) - min((r.due for r in records), default=0.0)
    settings = RunSettings(request_rate=rate, burstiness=1.0, max_concurrency=limit, num_prompts=len(records))
    return RunResult(settings=settings, started_at=0.0, duration=duration, records=records, health=HarnessHealth())


def synthetic_run(n: int = 300, rate: float = 8.0, limit: int | None = 24, seed: int = 0) -> RunResult:
    """Poisson arrivals into a server that slows down threefold in the middle third of the run."""
    rng = random.Random(seed)
    span = n / rate

    def slowdown(t: float) -> float:
        return 3.0 if span / 3 <= t < 2 * span / 3 else 1.0

    due = 0.0
    records: list[RequestRecord] = []
    running: list[float] = []  # a heap of done times, one for each slot taken
    for i in range(n):
        due += rng.expovariate(rate)
        sent = due
        if limit is not None and len(running) >= limit:
            sent = max(due, heapq.heappop(running))
        t = sent + rng.uniform(0.05, 0.3) * slowdown(sent)
        tokens = [t]
        for _ in range(rng.randint(20, 200)):
            t += rng.uniform(0.01, 0.03) * slowdown(t) * (20.0 if rng.random() < 0.002 else 1.0)
            tokens.append(t)
        r = record(i, due, sent, t + 0.001, tokens)
        if i % 97 == 50:  # a few failures, cut off mid-stream
            r.success, r.status, r.error, r.token_times = False, 500, "server error", tokens[:5]
            r.done = tokens[4]
        if i % 120 == 60:
            r.kind, r.success, r.token_times, r.done = "abort", False, tokens[:3], tokens[2]
        heapq.heappush(running, r.done)
        records.append(r)
    return run_of(records, rate=rate, limit=limit)


def assert_png(path: Path, width: int, height: int) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] == pytest.approx(height, rel=0.1)
    assert pixels.shape[1] == pytest.approx(width, rel=0.1)
    assert pixels[..., :3].std() > 0.05  # something was drawn on the white page


def test_cdf_is_sorted_with_equal_steps() -> None:
    xs, ys = cdf([3.0, 1.0, 2.0, 2.0])
    assert xs.tolist() == [1.0, 2.0, 2.0, 3.0]
    assert ys.tolist() == [0.25, 0.5, 0.75, 1.0]
    assert [len(a) for a in cdf([])] == [0, 0]


def test_bin_width_is_round_and_at_least_a_tenth() -> None:
    assert choose_bin_s(0.0) == 0.1
    assert choose_bin_s(3.0) == 0.1
    assert choose_bin_s(60.0) == 1.0
    assert choose_bin_s(61.0) == 1.0  # the nearest round width, not the next one up
    assert choose_bin_s(100.0) == 2.0  # 1.67 rounds up to 2
    assert choose_bin_s(250.0) == 5.0
    assert choose_bin_s(600.0) == 10.0


def test_throughput_counts_every_records_chunks_per_bin() -> None:
    records = [record(0, 0, 0, 1.6, [0.1, 0.2, 0.5, 1.5]), record(1, 0, 0, 3.0, [0.3, 2.9])]
    records[1].success = False  # a failed request's chunks still arrived
    starts, rates = throughput_series(records, 1.0)
    assert starts.tolist() == [0.0, 1.0, 2.0]
    assert rates.tolist() == [4.0, 1.0, 1.0]
    starts, rates = throughput_series(records, 0.5, end=4.0)
    assert starts.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    assert rates.tolist() == [6.0, 2.0, 0.0, 2.0, 0.0, 2.0, 0.0, 0.0]
    assert rates.sum() * 0.5 == 6  # every chunk is counted once
    starts, rates = throughput_series([], 1.0)
    assert rates.tolist() == [0.0]


def test_inflight_and_waiting_levels() -> None:
    records = [
        record(0, due=0.0, sent=0.0, done=2.0, tokens=[1.0]),
        record(1, due=0.5, sent=1.0, done=3.0, tokens=[2.0]),  # waited half a second for a slot
        record(2, due=0.5, sent=2.0, done=2.5, tokens=[2.2]),  # waited until the first finished
    ]
    times, levels = inflight_series(records)
    assert times.tolist() == [0.0, 1.0, 2.0, 2.5, 3.0]
    assert levels.tolist() == [1, 2, 2, 1, 0]  # at 2.0 one ends as another starts
    times, levels = waiting_series(records)
    assert times.tolist() == [0.0, 0.5, 1.0, 2.0]
    assert levels.tolist() == [0, 2, 1, 0]
    records = [
        record(0, due=0.0, sent=0.0, done=2.0, tokens=[1.0]),
        record(1, due=1.0, sent=1.0, done=3.0, tokens=[2.0]),
        record(2, due=2.5, sent=2.5, done=3.5, tokens=[3.0]),
    ]
    times, levels = inflight_series(records)
    assert times.tolist() == [0.0, 1.0, 2.0, 2.5, 3.0, 3.5]
    assert levels.tolist() == [1, 2, 1, 2, 1, 0]


def test_sweep_puts_inf_past_the_largest_rate() -> None:
    xs, log = sweep_positions([1.0, 2.0, 3.0, math.inf])
    assert not log and xs.tolist() == [1.0, 2.0, 3.0, 4.0]
    xs, log = sweep_positions([1.0, 8.0, 64.0, math.inf])
    assert log and xs.tolist() == [1.0, 8.0, 64.0, 128.0]
    assert sweep_positions([math.inf])[0].tolist() == [1.0]


def test_plot_run_and_sweep_write_pngs(tmp_path: Path) -> None:
    slo = {"ttft": 500.0, "tpot": 40.0, "e2el": 8000.0}
    result = synthetic_run(n=200)
    paths = plot_run(result, tmp_path / "plots", name="r1", slo_ms=slo)
    assert [p.name for p in paths] == ["r1_latency_cdf.png", "r1_timeline.png"]
    assert_png(paths[0], 1210, 825)
    assert_png(paths[1], 1210, 770)

    points = []
    for rate in (8.0, 2.0, math.inf, 4.0):  # probe order, not sorted
        summary = summarize(synthetic_run(n=60, rate=rate if rate != math.inf else 50.0), (50, 99), SLO(slo))
        points.append((rate, summary))
    path = plot_sweep(points, "request-rate", tmp_path / "plots", slo_ms=slo)
    assert path.name == "sweep_goodput.png"
    assert_png(path, 1100, 880)


@pytest.mark.parametrize(
    "records",
    [
        [],
        [record(0, 0.0, 0.0, 0.0, [], success=False, status=None, error="refused")],
        [record(0, 0.0, 0.0, 0.0, [0.0])],  # one request, zero duration
    ],
)
def test_degenerate_runs_still_draw(tmp_path: Path, records: list[RequestRecord]) -> None:
    for path in plot_run(run_of(records), tmp_path, slo_ms={"ttft": 100.0}):
        assert path.stat().st_size > 1000


def test_degenerate_sweeps_still_draw(tmp_path: Path) -> None:
    assert plot_sweep([], "max-concurrency", tmp_path).exists()
    one = summarize(run_of([record(0, 0.0, 0.0, 0.5, [0.1, 0.2, 0.3])]))  # no p99, no goodput
    assert plot_sweep([(4.0, one)], "max-concurrency", tmp_path, name="one").exists()


def test_missing_matplotlib_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        plot_run(run_of([]), tmp_path)
