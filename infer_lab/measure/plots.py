"""Plots of a ``bench`` result: the throughput-latency curve, latency CDFs, TTFT and ITL vs load.

Each takes the dict that :func:`infer_lab.measure.bench.run_bench` returns (or its JSON, read
back) and returns a matplotlib ``Figure`` whose title states the load mode, N, the lengths and the
seed. matplotlib is imported inside the functions, and figures are made without pyplot, so saving
them from the command line needs no display and does not disturb a notebook's backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

METRIC_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL (per chunk)", "e2el": "E2EL"}


def _figure(ncols: int, nrows: int = 1, size: tuple[float, float] = (5.0, 3.8)) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def _title(fig: Any, result: dict[str, Any], what: str) -> None:
    from infer_lab.measure.bench import describe

    meta = result["meta"]
    fig.suptitle(f"{what} — {meta['model']}\n{describe(meta)}", fontsize=9)


def _loads(result: dict[str, Any]) -> list[float]:
    return [float(p["load"]) for p in result["points"]]


def _ms(point: dict[str, Any], key: str) -> float:
    v = point["metrics"].get(key)
    return float("nan") if v is None else v * 1e3


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
    load past which more traffic buys latency, not throughput."""
    from infer_lab.measure.bench import load_label

    fig, axes = _figure(2)
    points = result["points"]
    x = [p["metrics"].get("output_throughput", float("nan")) for p in points]
    for ax, metric in zip(axes[0], ("ttft", "tpot")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, [_ms(p, f"{metric}.{q}") for p in points], style,
                    label=f"{METRIC_NAMES[metric]} {q}")
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
    from infer_lab.measure.bench import load_label

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
    """TTFT and ITL percentiles against the load; bars span min-max over repeats."""
    fig, axes = _figure(2)
    loads = _loads(result)
    closed = result["meta"]["mode"] == "closed"
    for ax, metric in zip(axes[0], ("ttft", "itl")):
        for q in ("p50", "p90", "p99"):
            key = f"{metric}.{q}"
            y = [_ms(p, key) for p in result["points"]]
            lo = [y_i - (p["spread"][key]["min"] * 1e3 if p.get("spread") and key in p["spread"]
                         else y_i) for y_i, p in zip(y, result["points"])]
            hi = [(p["spread"][key]["max"] * 1e3 if p.get("spread") and key in p["spread"]
                   else y_i) - y_i for y_i, p in zip(y, result["points"])]
            ax.errorbar(loads, y, yerr=[lo, hi], marker="o", capsize=3, label=q)
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
    bars = ", bars: min-max over repeats" if result["meta"]["repeats"] > 1 else ""
    _title(fig, result, f"TTFT and ITL against load{bars}")
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
