"""Plots of a ``bench`` result: the throughput-latency curve, latency CDFs, TTFT and ITL vs load.

Each takes the dict that :func:`infer_lab.measure.bench.run_bench` returns (or its JSON, read
back) and returns a matplotlib ``Figure`` whose title states the load mode, N, the lengths and the
seed. Percentiles carry error bars: the bootstrap confidence interval over requests that the bench
stored with each point (and, with ``--repeats``, the min-max over repeats beside it).
matplotlib is imported inside the functions, and figures are made without pyplot, so saving
them from the command line needs no display and does not disturb a notebook's backend.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from infer_lab.measure.report import describe, load_label

METRIC_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL (per chunk)", "e2el": "E2EL"}


def _figure(ncols: int, nrows: int = 1, size: tuple[float, float] = (5.0, 3.8)) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def _title(fig: Any, result: dict[str, Any], what: str) -> None:
    meta = result["meta"]
    fig.suptitle(f"{what} — {meta['model']}\n{describe(meta)}", fontsize=9)


def _loads(result: dict[str, Any]) -> list[float]:
    return [float(p["load"]) for p in result["points"]]


def _ms(point: dict[str, Any], key: str) -> float:
    v = point["metrics"].get(key)
    return float("nan") if v is None else v * 1e3


def ci_yerr(points: list[dict[str, Any]], key: str) -> list[list[float]]:
    """``[below, above]`` distances (ms) from each point's value to its CI bounds, for errorbar.

    The time-block interval where the point has one (it keeps the requests one stall slowed
    together), else the interval over requests. Zero where a point has no interval (an old
    result, or no samples); never negative, so a median over repeats that lies outside the
    pooled interval still draws.
    """
    below, above = [], []
    for p in points:
        y = _ms(p, key)
        ci = (p.get("ci_block") or p.get("ci") or {}).get(key)
        if not ci or ci[0] is None or math.isnan(y):
            below.append(0.0)
            above.append(0.0)
            continue
        below.append(max(0.0, y - ci[0] * 1e3))
        above.append(max(0.0, ci[1] * 1e3 - y))
    return [below, above]


def spread_yerr(points: list[dict[str, Any]], key: str) -> list[list[float]] | None:
    """``[below, above]`` distances (ms) to the min and max over repeats; None with one repeat."""
    if not all(p.get("spread") and key in p["spread"] for p in points):
        return None
    return [[max(0.0, _ms(p, key) - p["spread"][key]["min"] * 1e3) for p in points],
            [max(0.0, p["spread"][key]["max"] * 1e3 - _ms(p, key)) for p in points]]


def _log_if_wide(ax: Any) -> None:
    """Log x only when the data span more than a decade, with plain numbers on the ticks."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    lo, hi = ax.dataLim.intervalx
    if lo > 0 and hi / lo > 10:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())


def plot_throughput_latency(result: dict[str, Any]) -> Any:
    """Latency against output throughput, one point per load: where the curve turns up is the
    load past which more traffic buys latency, not throughput. Bars: the bootstrap interval."""
    fig, axes = _figure(2)
    points = result["points"]
    x = [p["metrics"].get("output_throughput", float("nan")) for p in points]
    for ax, metric in zip(axes[0], ("ttft", "tpot")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            key = f"{metric}.{q}"
            ax.errorbar(x, [_ms(p, key) for p in points], yerr=ci_yerr(points, key), fmt=style,
                        capsize=3, label=f"{METRIC_NAMES[metric]} {q}")
        for xi, p in zip(x, points):
            ax.annotate(load_label(p), (xi, _ms(p, f"{metric}.p50")), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
        ax.set(xlabel="output throughput (tokens/s)", ylabel=f"{METRIC_NAMES[metric]} (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _title(fig, result, "Throughput vs latency")
    return fig


def plot_cdfs(result: dict[str, Any]) -> Any:
    """CDF of each latency, one line per load point, pooled over repeats: the tail in full."""
    fig, axes = _figure(2, 2)
    for ax, metric in zip(axes.flat, ("ttft", "tpot", "itl", "e2el")):
        for p in result["points"]:
            values = p["cdf"].get(metric)
            if values:
                ax.plot([v * 1e3 for v in values], p["cdf"]["levels"], label=load_label(p))
        ax.set(xlabel=f"{METRIC_NAMES[metric]} (ms)", ylabel="fraction ≤ x")
        if ax.has_data():
            _log_if_wide(ax)
            ax.legend(fontsize=7)
        ax.axhline(0.99, color="grey", lw=0.6, ls=":")
        ax.grid(alpha=0.3)
    _title(fig, result, "Latency CDFs (dotted: p99)")
    return fig


def plot_vs_load(result: dict[str, Any]) -> Any:
    """TTFT and ITL percentiles against the load, with the bootstrap interval as error bars
    (and, with repeats, a second grey bar for the min-max over repeats)."""
    fig, axes = _figure(2)
    loads = _loads(result)
    points = result["points"]
    closed = result["meta"]["mode"] == "closed"
    for ax, metric in zip(axes[0], ("ttft", "itl")):
        for q in ("p50", "p90", "p99"):
            key = f"{metric}.{q}"
            y = [_ms(p, key) for p in points]
            bar = ax.errorbar(loads, y, yerr=ci_yerr(points, key), marker="o", capsize=3,
                              label=q)
            rep = spread_yerr(points, key)
            if rep is not None:
                ax.errorbar(loads, y, yerr=rep, fmt="none", ecolor=bar[0].get_color(),
                            alpha=0.4, elinewidth=4)
        ax.set(xlabel="concurrency" if closed else "request rate (req/s)",
               ylabel=f"{METRIC_NAMES[metric]} (ms)")
        if len(loads) > 1 and all(0 < x < float("inf") for x in loads):
            from matplotlib.ticker import NullFormatter, ScalarFormatter

            ax.set_xscale("log", base=2)
            ax.set_xticks(loads)
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    level = points[0].get("ci_level") if points else None
    kind = "time-block bootstrap" if points and "ci_block" in points[0] else "bootstrap"
    bars = f"bars: {level:.0%} {kind} CI" if level else "no intervals stored"
    if result["meta"]["repeats"] > 1:
        bars += "; wide pale bars: min-max over repeats"
    _title(fig, result, f"TTFT and ITL against load ({bars})")
    return fig


def plot_all(result: dict[str, Any], prefix: str | Path) -> list[Path]:
    """Save ``PREFIX_throughput_latency.png``, ``PREFIX_cdf.png`` and ``PREFIX_vs_load.png``."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, make in (("throughput_latency", plot_throughput_latency), ("cdf", plot_cdfs),
                       ("vs_load", plot_vs_load)):
        path = prefix.with_name(f"{prefix.name}_{name}.png")
        make(result).savefig(path, dpi=120)
        paths.append(path)
    return paths
