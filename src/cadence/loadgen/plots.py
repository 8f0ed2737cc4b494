"""PNG figures of load-generator runs (`cadence loadgen --plot DIR`).

One run gives latency CDFs and a timeline (output rate and concurrency over time); a sweep
or capacity search gives throughput, goodput and latency against the swept value. The data
preparation is in small pure functions; matplotlib is imported only when a figure is drawn,
on its non-interactive Agg canvas (no pyplot, no global backend switch).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from cadence.loadgen.records import RequestRecord, RunResult
from cadence.loadgen.stats import metric_values, percentile

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Floats = npt.NDArray[np.float64]

METRIC_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}
AXIS_LABELS = {"request-rate": "offered request rate (req/s)", "max-concurrency": "max concurrency (requests)"}
MARKED_PERCENTILES = (50.0, 90.0, 99.0)


def cdf(values: Iterable[float]) -> tuple[Floats, Floats]:
    """The empirical CDF: sorted values, and the fraction of values at or below each."""
    xs = np.sort(np.asarray(list(values), dtype=np.float64))
    return xs, np.arange(1, len(xs) + 1, dtype=np.float64) / max(len(xs), 1)


def choose_bin_s(duration: float, bins: int = 60) -> float:
    """The round bin width (1, 2 or 5 times a power of ten, at least 0.1 s) nearest to giving `bins` bins."""
    raw = duration / bins
    if not raw > 0.1:
        return 0.1
    power = 10.0 ** math.floor(math.log10(raw))
    return max(0.1, min((step * power for step in (1.0, 2.0, 5.0, 10.0)), key=lambda w: abs(math.log(w / raw))))


def throughput_series(records: Sequence[RequestRecord], bin_s: float, end: float = 0.0) -> tuple[Floats, Floats]:
    """Text chunks received per second in bins of `bin_s` from 0: (bin starts, rates).

    The bins cover at least `end` seconds and every chunk's arrival.
    """
    times = np.asarray([t for r in records for t in r.token_times], dtype=np.float64)
    last = max(end, float(times.max()) if len(times) else 0.0)
    count = max(1, math.ceil(last / bin_s - 1e-9))
    index = np.floor(times / bin_s).astype(np.int64)
    count = max(count, int(index.max()) + 1 if len(index) else 0)
    counts = np.bincount(np.clip(index, 0, None), minlength=count).astype(np.float64)
    return np.arange(count, dtype=np.float64) * bin_s, counts / bin_s


def _level_series(intervals: Iterable[tuple[float, float]]) -> tuple[Floats, Floats]:
    """How many of the [start, end) intervals are open just after each distinct event time."""
    deltas: dict[float, int] = {}
    for start, end in intervals:
        end = max(end, start)
        deltas[start] = deltas.get(start, 0) + 1
        deltas[end] = deltas.get(end, 0) - 1
    times = sorted(deltas)
    levels = np.cumsum([deltas[t] for t in times]) if times else np.zeros(0)
    return np.asarray(times, dtype=np.float64), np.asarray(levels, dtype=np.float64)


def inflight_series(records: Sequence[RequestRecord]) -> tuple[Floats, Floats]:
    """Requests in flight (sent, not yet done) from each event time on."""
    return _level_series((r.sent, r.done) for r in records if r.sent is not None)


def waiting_series(records: Sequence[RequestRecord]) -> tuple[Floats, Floats]:
    """Requests due but not yet sent (waiting in the harness) from each event time on; one
    never sent waited until the run cut it off."""
    return _level_series((r.due, r.done if r.sent is None else r.sent) for r in records)


def server_timeline(result: RunResult) -> list[dict[str, float]]:
    """The server's gauges sampled during the run (loadgen/server_metrics.py), if it was scraped."""
    server = result.server or {}
    return list(server.get("timeline") or []) if server.get("available") else []


def sweep_positions(xs: Sequence[float]) -> tuple[Floats, bool]:
    """Where to draw each swept value, and whether the x axis is logarithmic.

    The axis is logarithmic for values spanning 8x or more that are not evenly spaced (a
    doubling sweep); an infinite value (request rate inf) goes one step beyond the largest finite one.
    """
    finite = [x for x in xs if math.isfinite(x)]
    gaps = np.diff(np.unique(finite))
    even = len(gaps) > 1 and gaps.max() < 2 * gaps.min()
    log = bool(finite) and min(finite) > 0 and max(finite) / min(finite) >= 8 and not even
    if not finite:
        inf_at = 1.0
    elif log:
        inf_at = max(finite) * 2.0
    else:
        span = max(finite) - min(finite)
        inf_at = max(finite) + (span / max(len(finite) - 1, 1) if span > 0 else max(abs(max(finite)), 1.0))
    return np.asarray([x if math.isfinite(x) else inf_at for x in xs], dtype=np.float64), log


def _new_figure(width: float, height: float, rows: int, cols: int, **kw: Any) -> tuple[Figure, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError("plotting needs matplotlib: pip install matplotlib") from exc
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, cols, squeeze=False, **kw)


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _no_data(ax: Axes, what: str = "no data") -> None:
    ax.text(0.5, 0.5, what, transform=ax.transAxes, ha="center", va="center", color="grey", fontsize=12)


def _legend(ax: Axes) -> None:
    """The legend to the right of the panel, clear of the data."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def _fmt_ms(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f} ms"
    return f"{value:.1f} ms" if value >= 10 else f"{value:.2f} ms"


def _cdf_panel(ax: Axes, metric: str, seconds: list[float], slo: float | None) -> None:
    ms = [v * 1000.0 for v in seconds]
    ax.set_title(f"{METRIC_LABELS[metric]} (n={len(ms):,})")
    ax.set_xlabel(f"{METRIC_LABELS[metric]} (ms)")
    ax.set_ylabel("fraction at or below")
    ax.set_ylim(0, 1.02)
    if not ms:
        _no_data(ax)
        return
    xs, ys = cdf(ms)
    positive = xs[xs > 0]
    if len(positive) and positive[-1] / positive[0] > 100:
        ax.set_xscale("log")
    # From 0 at the smallest value, so that one value (or many equal ones) still draws a rise.
    ax.step(np.insert(xs, 0, xs[0]), np.insert(ys, 0, 0.0), where="post", color="tab:blue", linewidth=1.5)
    for q, colour in zip(MARKED_PERCENTILES, ("tab:green", "tab:orange", "tab:red")):
        value = percentile(ms, q)
        ax.plot([value], [q / 100], "o", color=colour, markersize=6, label=f"p{q:g} {_fmt_ms(value)}")
    if slo is not None:
        within = float(np.mean(xs <= slo))
        ax.axvline(slo, color="black", linestyle="--", linewidth=1.2, label=f"SLO {_fmt_ms(slo)} ({within:.0%} within)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)


def plot_run(result: RunResult, out_dir: Path, name: str = "run", slo_ms: dict[str, float] | None = None) -> list[Path]:
    """Write `{name}_latency_cdf.png` and `{name}_timeline.png` into `out_dir`; returns their paths."""
    slo_ms = slo_ms or {}
    label = result.settings.label()
    normal, good = result.normal, result.succeeded

    fig, axes = _new_figure(11, 7.5, 2, 2)
    values = metric_values(good)
    for ax, metric in zip(axes.flat, METRIC_LABELS):
        _cdf_panel(ax, metric, values[metric], slo_ms.get(metric))
    fig.suptitle(f"Latency CDFs: {label}, {len(good):,} of {_plural(len(normal), 'request')} succeeded")
    paths = [_save(fig, out_dir / f"{name}_latency_cdf.png")]

    fig, axes = _new_figure(11, 7, 2, 1, sharex=True)
    rate_ax, conc_ax = axes[0, 0], axes[1, 0]
    records = result.records
    events = [t for r in records for t in (r.due, r.sent, r.done, *r.token_times) if t is not None]
    end = max([result.duration, *events, 0.0])
    bin_s = choose_bin_s(end)
    end = max(end, bin_s)
    rate_ax.set_title("output rate")
    rate_ax.set_ylabel(f"text chunks / s ({bin_s:g} s bins)")
    conc_ax.set_title("concurrency")
    conc_ax.set_ylabel("requests")
    conc_ax.set_xlabel("time since run start (s)")
    conc_ax.set_xlim(0, end)
    if not any(r.token_times for r in records):
        _no_data(rate_ax)
    else:
        starts, rates = throughput_series(records, bin_s, end)
        edges = np.append(starts, starts[-1] + bin_s)
        rate_ax.stairs(rates, edges, color="tab:blue", fill=True, alpha=0.35)
        rate_ax.stairs(rates, edges, color="tab:blue", linewidth=1.2)
        if result.duration > 0:
            mean = sum(len(r.token_times) for r in records) / result.duration
            rate_ax.axhline(mean, color="black", linestyle=":", linewidth=1, label=f"run mean {mean:,.1f}/s")
            _legend(rate_ax)
        rate_ax.set_ylim(bottom=0)
    if not records:
        _no_data(conc_ax)
    else:
        peak = 0.0
        for series, colour, what in (
            (inflight_series(records), "tab:blue", "in flight (sent, not done)"),
            (waiting_series(records), "tab:orange", "waiting in the harness (due, not sent)"),
        ):
            times, levels = series
            ts = np.concatenate([[0.0], times, [end]])
            ls = np.concatenate([[0.0], levels, [levels[-1] if len(levels) else 0.0]])
            conc_ax.step(ts, ls, where="post", color=colour, linewidth=1.3, label=what)
            peak = max(peak, float(ls.max()))
        # The server's own gauges, as scraped during the run: beside the client's view.
        for gauge, colour, what in (
            ("num_requests_running", "tab:green", "server: running"),
            ("num_requests_waiting", "tab:red", "server: waiting"),
        ):
            points = [(p["t"], p[gauge]) for p in server_timeline(result) if gauge in p]
            if points:
                conc_ax.plot(*zip(*points), linestyle="--", marker=".", color=colour, linewidth=1, label=what)
                peak = max(peak, max(v for _, v in points))
        if peak == 0:
            _no_data(conc_ax, "no request was in flight or waiting for a measurable time")
        if result.settings.max_concurrency is not None:
            conc_ax.axhline(
                result.settings.max_concurrency, color="grey", linestyle="--", linewidth=1, label="max concurrency"
            )
        marks = (
            ([r.done for r in records if r.kind == "normal" and not r.success], "tab:red", "failed"),
            ([r.done for r in records if r.kind == "abort"], "tab:purple", "aborted on purpose"),
            ([r.done for r in records if r.kind == "malformed"], "tab:brown", "malformed on purpose"),
        )
        for ax in (rate_ax, conc_ax):
            for done, colour, what in marks:
                if done:
                    ax.plot(done, [0.0] * len(done), "|", color=colour, markersize=12, markeredgewidth=1.5,
                            transform=ax.get_xaxis_transform(), clip_on=False,
                            label=f"{what} ({len(done)})" if ax is conc_ax else None)  # fmt: skip
        conc_ax.set_ylim(0, max(peak, float(result.settings.max_concurrency or 0), 1.0) * 1.08)
        _legend(conc_ax)
    for ax in (rate_ax, conc_ax):
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"Timeline: {label}, {_plural(len(records), 'request')} over {result.duration:,.1f} s")
    paths.append(_save(fig, out_dir / f"{name}_timeline.png"))
    return paths


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)


def plot_sweep(
    points: list[tuple[float, dict[str, Any]]],
    axis: str,
    out_dir: Path,
    name: str = "sweep",
    slo_ms: dict[str, float] | None = None,
) -> Path:
    """Write `{name}_goodput.png`: throughput, goodput and latency against the swept value."""
    fig, axes = _new_figure(10, 8, 2, 1, sharex=True)
    from matplotlib.ticker import NullLocator

    points = sorted(points, key=lambda p: p[0])
    summaries = [s for _, s in points]
    if slo_ms is None:
        slo_ms = next((dict(s["goodput_slo_ms"]) for s in summaries if s.get("goodput_slo_ms")), {})
    xs, log = sweep_positions([x for x, _ in points])
    top, bottom = axes[0, 0], axes[1, 0]
    top.set_title("throughput and goodput")
    top.set_ylabel("requests / s")
    bottom.set_title("latency")
    bottom.set_ylabel("ms")
    bottom.set_xlabel(AXIS_LABELS.get(axis, axis))
    if not points:
        _no_data(top)
        _no_data(bottom)
    else:
        if log:
            bottom.set_xscale("log")
        if axis == "request-rate":
            finite = [(p, x) for p, (x, _) in zip(xs, points) if math.isfinite(x)]
            if finite:
                top.plot(*zip(*finite), ":", color="grey", label="offered rate")
        series = [("request_throughput", "throughput", "tab:blue", "o-")]
        if any("request_goodput" in s for s in summaries):
            series.append(("request_goodput", "goodput (met every SLO)", "tab:green", "s-"))
        for key, what, colour, style in series:
            top.plot(xs, [_number(s.get(key)) for s in summaries], style, color=colour, label=what)
        top.set_ylim(bottom=0)
        _legend(top)
        drawn: list[float] = []
        for metric, colour in (("ttft", "tab:blue"), ("tpot", "tab:orange")):
            for key, q, style in ((f"median_{metric}_ms", "p50", "o-"), (f"p99_{metric}_ms", "p99", "s--")):
                if any(key in s for s in summaries):
                    ys = [_number(s.get(key)) for s in summaries]
                    drawn += [y for y in ys if y > 0]
                    bottom.plot(xs, ys, style, color=colour, label=f"{q} {METRIC_LABELS[metric]}")
            if metric in slo_ms:
                drawn.append(slo_ms[metric])
                bottom.axhline(slo_ms[metric], color=colour, linestyle=":", linewidth=1.5,
                               label=f"{METRIC_LABELS[metric]} SLO {_fmt_ms(slo_ms[metric])}")  # fmt: skip
        if drawn and max(drawn) / min(drawn) > 30:
            bottom.set_yscale("log")
        _legend(bottom)
        step = max(1, math.ceil(len(xs) / 14))
        ticks = sorted({*range(0, len(xs), step), len(xs) - 1})
        bottom.set_xticks([xs[i] for i in ticks], [f"{x:g}" for x in (points[i][0] for i in ticks)])
        bottom.xaxis.set_minor_locator(NullLocator())
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    slo_text = ", ".join(f"{METRIC_LABELS[k]} ≤ {_fmt_ms(v)}" for k, v in slo_ms.items()) or "none"
    prompts = {s.get("num_prompts") for s in summaries} - {None}
    each = f", {prompts.pop():,} prompts each" if len(prompts) == 1 else ""
    fig.suptitle(f"Sweep over {AXIS_LABELS.get(axis, axis)}: {_plural(len(points), 'run')}{each}\nSLO: {slo_text}")
    return _save(fig, out_dir / f"{name}_goodput.png")
