"""Latency statistics with vLLM's ``bench serve`` definitions, so our numbers compare with theirs.

- TTFT: request sent -> first streamed chunk that carries a token.
- ITL: gap between successive token chunks, pooled across requests (a chunk may hold several
  tokens; ITL is per chunk, as the client sees it).
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request; undefined for a 1-token output, which
  is left out (there is no "time per output token" after the first when there is only one).
- E2EL: request sent -> last token chunk.
- Goodput: requests per second that succeeded *and* met every SLO.

guidellm calls TPOT "ITL"; here ITL is always the per-chunk gap. Percentiles are numpy's "linear"
(the same as vLLM's ``np.percentile``), over successful requests only; failures are counted and
their messages kept, never mixed into latencies and never silently dropped.

A percentile is an estimate, and a p99 from a few hundred requests rests on the two or three
slowest: :func:`beyond` says how many samples lie past a percentile, the number a reader needs to
judge a tail, and :func:`bootstrap_ci` gives each percentile a confidence interval by resampling
*requests* (so that the gaps of one slow request stay together). That interval assumes requests
are independent, and on a server they are not: one stall (a long prefill, a garbage collection,
another process taking the core) slows every request in flight at once. :func:`stall_events`
counts how many distinct events the samples beyond a percentile come from (slow periods that
overlap in time are one event), and :func:`block_bootstrap_ci` resamples blocks of the run's
timeline instead of requests, so that the requests one stall hit stay together.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infer_lab.measure.loadgen import RequestResult

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")
# A percentile with fewer than this many samples beyond it is the largest value or two, not a tail.
MIN_BEYOND = 10
# The default N per load point: a round number above 902, the smallest N with MIN_BEYOND samples
# beyond its p99 under numpy's linear rule (beyond(902, 99) == 10, beyond(901, 99) == 9).
MIN_REQUESTS_FOR_P99 = 1000
# Blocks per resample of the time-block bootstrap unless a block length is given: enough blocks
# for a bootstrap distribution, each long enough to hold a stall and the requests it hit.
N_BLOCKS = 20
CI_LEVEL = 0.95
N_BOOT = 1000


def ttft(r: RequestResult) -> float | None:
    """Seconds from send to the first token chunk; None for a failed request."""
    return r.chunk_times[0] - r.sent if r.success and r.chunk_times else None


def e2el(r: RequestResult) -> float | None:
    """Seconds from send to the last token chunk; None for a failed request."""
    return r.chunk_times[-1] - r.sent if r.success and r.chunk_times else None


def tpot(r: RequestResult) -> float | None:
    """(E2EL - TTFT) / (output tokens - 1); None if failed or only one token came out."""
    first, last = ttft(r), e2el(r)
    if first is None or last is None or r.output_tokens < 2:
        return None
    return (last - first) / (r.output_tokens - 1)


def itls(r: RequestResult) -> list[float]:
    """Gaps between successive token chunks of one successful request (empty otherwise)."""
    return np.diff(r.chunk_times).tolist() if r.success else []


@dataclass(frozen=True)
class Dist:
    """A latency distribution, summarised as p50/p90/p99 (and the mean, never alone), seconds."""

    n: int
    p50: float
    p90: float
    p99: float
    mean: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Dist:
        """Summarise samples (NaN everywhere when there are none)."""
        v = np.asarray(list(values), dtype=float)
        if v.size == 0:
            return cls(0, math.nan, math.nan, math.nan, math.nan)
        p = np.percentile(v, PERCENTILES, method="linear")
        return cls(int(v.size), *(float(x) for x in p), float(v.mean()))

    def to_dict(self) -> dict[str, Any]:
        return {k: _json(getattr(self, k)) for k in ("n", "p50", "p90", "p99", "mean")}


def beyond(n: int, p: float) -> int:
    """How many of ``n`` sorted samples lie strictly past the ``p``-th percentile (linear rule).

    numpy puts the percentile at index ``h = (n - 1)·p/100``; the samples after ``⌊h⌋`` are the
    ones it rests on. For the p99: 10 of 1000 samples, 3 of 300, 1 for every n from 2 to 100
    (the p99 of 100 samples interpolates between the two largest), none for a single sample.
    """
    if n < 1:
        return 0
    if not 0 <= p <= 100:
        raise ValueError(f"a percentile is in [0, 100], not {p}")
    return n - 1 - math.floor((n - 1) * p / 100 + 1e-9)


def _flatten(groups: Sequence[Sequence[float]] | np.ndarray) -> list[np.ndarray]:
    """One array of samples per request, from groups or from a flat one-sample-per-request array."""
    flat_input = isinstance(groups, np.ndarray) and groups.ndim == 1 or (
        len(groups) > 0 and np.ndim(groups[0]) == 0)
    if flat_input:
        return [np.asarray(groups, dtype=float)[i:i + 1] for i in range(len(groups))]
    return [np.asarray(g, dtype=float).ravel() for g in groups]


def _resampled_percentiles(arrays: list[np.ndarray], draw: Any, n_boot: int,
                           ps: Sequence[float], level: float) -> dict[str, tuple[float, float]]:
    """The central ``level`` of the percentiles of ``n_boot`` weighted resamples of ``arrays``.

    ``draw(b)`` returns a ``(b, len(arrays))`` matrix: how often each request appears in each of
    ``b`` resamples. A resample pools the samples of the requests it drew (with repeats) and
    takes numpy's linear percentile of them, computed on the sorted samples without expanding.
    """
    values = np.concatenate(arrays)
    owner = np.repeat(np.arange(len(arrays)), [a.size for a in arrays])
    order = np.argsort(values, kind="stable")
    values, owner = values[order], owner[order]
    est = {p: np.empty(n_boot) for p in ps}
    chunk = max(1, 2_000_000 // values.size)
    for start in range(0, n_boot, chunk):
        b = min(chunk, n_boot - start)
        weights = draw(b)[:, owner]  # how often each sorted sample appears in each resample
        cum = np.cumsum(weights, axis=1)
        empty = cum[:, -1] == 0  # a block resample can miss every request: no estimate
        total = np.maximum(cum[:, -1], 1)
        for p in ps:
            # numpy's linear rule on the expanded resample: index h, between ⌊h⌋ and ⌊h⌋+1
            h = (total - 1) * p / 100
            k = np.floor(h).astype(np.int64)
            frac = h - k
            lo_i = (cum <= k[:, None]).sum(axis=1)
            hi_i = (cum <= np.minimum(k + 1, total - 1)[:, None]).sum(axis=1)
            lo_i, hi_i = np.minimum(lo_i, values.size - 1), np.minimum(hi_i, values.size - 1)
            got = values[lo_i] + frac * (values[hi_i] - values[lo_i])
            est[p][start:start + b] = np.where(empty, np.nan, got)
    tail = (1 - level) / 2 * 100
    out = {}
    for p in ps:
        kept = est[p][~np.isnan(est[p])]
        out[f"p{p:g}"] = ((float(np.percentile(kept, tail)), float(np.percentile(kept, 100 - tail)))
                          if kept.size else (math.nan, math.nan))
    return out


def _check_level(level: float, n_boot: int) -> None:
    if not 0 < level < 1 or n_boot < 1:
        raise ValueError("level must be in (0, 1) and n_boot >= 1")


def bootstrap_ci(
    groups: Sequence[Sequence[float]] | np.ndarray, ps: Sequence[float] = PERCENTILES,
    level: float = CI_LEVEL, n_boot: int = N_BOOT, seed: int = 0,
) -> dict[str, tuple[float, float]]:
    """Percentile-bootstrap confidence intervals of percentiles, resampling whole requests.

    ``groups`` is one sequence of samples per request (the ITL gaps of each request), or a flat
    array with one sample per request (TTFT). Each of ``n_boot`` resamples draws the requests
    with replacement, pools their samples, and takes numpy's linear percentile; the interval is
    the central ``level`` of those. Returns ``{"p99": (lo, hi), ...}``, NaN where there are no
    samples. Seeded: the same data and seed give the same interval.

    It treats requests as independent. When one stall slows many requests at once they are
    not, and this interval is too narrow: use :func:`block_bootstrap_ci` there.
    """
    _check_level(level, n_boot)
    arrays = [a for a in _flatten(groups) if a.size]
    if not arrays:
        return {f"p{p:g}": (math.nan, math.nan) for p in ps}
    rng = np.random.default_rng(seed)
    n = len(arrays)

    def draw(b: int) -> np.ndarray:
        picks = rng.integers(0, n, (b, n)) + n * np.arange(b)[:, None]
        return np.bincount(picks.ravel(), minlength=b * n).reshape(b, n)

    return _resampled_percentiles(arrays, draw, n_boot, ps, level)


def block_bootstrap_ci(
    groups: Sequence[Sequence[float]] | np.ndarray, times: Sequence[float] | np.ndarray,
    ps: Sequence[float] = PERCENTILES, block_s: float | None = None, level: float = CI_LEVEL,
    n_boot: int = N_BOOT, seed: int = 0,
) -> dict[str, tuple[float, float]]:
    """Like :func:`bootstrap_ci`, but resampling stretches of the run's timeline, not requests.

    ``times`` holds one time per request of ``groups`` (when it was sent, in seconds). The
    timeline is read as a circle, and each resample lays ``K`` windows of ``block_s`` seconds at
    random starts on it (``K · block_s`` = the run's length, so a resample is a run as long as
    the real one) and pools the requests sent inside them. Requests that one stall slowed were
    sent close together, so they come in or stay out together, and the interval widens by as
    much as they were one event and not many independent ones (a circular block bootstrap in
    continuous time). ``block_s`` must exceed the reach of that dependence: a stall's length
    plus a request's. Default: the run's length ÷ :data:`N_BLOCKS`.
    """
    _check_level(level, n_boot)
    arrays = _flatten(groups)
    t = np.asarray(times, dtype=float)
    if t.shape != (len(arrays),) or not np.isfinite(t).all():
        raise ValueError("times: one finite send time per request")
    keep = [i for i, a in enumerate(arrays) if a.size]
    if not keep:
        return {f"p{p:g}": (math.nan, math.nan) for p in ps}
    arrays, t = [arrays[i] for i in keep], t[keep]
    order = np.argsort(t, kind="stable")
    arrays, u = [arrays[i] for i in order], t[order] - t[order[0]]
    n = len(arrays)
    span = u[-1] * n / (n - 1) if n > 1 and u[-1] > 0 else 1.0  # the circle: one mean gap more
    if block_s is not None and not block_s > 0:
        raise ValueError("block_s must be positive")
    k = max(1, round(span / block_s)) if block_s else N_BLOCKS
    width = span / k
    rng = np.random.default_rng(seed)

    def draw(b: int) -> np.ndarray:
        starts = rng.uniform(0, span, (b, k))
        ends = starts + width
        row = (n + 1) * np.repeat(np.arange(b), k)
        diff = np.zeros(b * (n + 1), dtype=np.int64)
        # each window [start, end) and, past the circle's end, its wrapped part [0, end - span)
        for lo_t, hi_t in ((starts, np.minimum(ends, span)), (np.zeros_like(starts),
                                                               np.maximum(ends - span, 0))):
            lo = row + np.searchsorted(u, lo_t.ravel(), side="left")
            hi = row + np.searchsorted(u, hi_t.ravel(), side="left")
            diff += np.bincount(lo, minlength=diff.size) - np.bincount(hi, minlength=diff.size)
        return np.cumsum(diff.reshape(b, n + 1)[:, :-1], axis=1)

    return _resampled_percentiles(arrays, draw, n_boot, ps, level)


def stall_events(values: Sequence[float] | np.ndarray, starts: Sequence[float] | np.ndarray,
                 durations: Sequence[float] | np.ndarray | None = None,
                 p: float = 99) -> int:
    """How many distinct events the samples beyond the ``p``-th percentile come from.

    The samples beyond are the :func:`beyond` largest (by rank, so ties at the top count).
    Sample i was slow over ``[starts[i], starts[i] + durations[i]]`` (``durations`` default to
    the values themselves: a TTFT from its send, an ITL gap from its earlier chunk). Slow periods
    that overlap in time, directly or through a chain, are one event: requests that waited
    through the same stall. Ten samples beyond a p99 from one event are one observation of a
    stall, not ten of a tail.
    """
    v = np.asarray(values, dtype=float)
    s = np.asarray(starts, dtype=float)
    d = v if durations is None else np.asarray(durations, dtype=float)
    if not v.shape == s.shape == d.shape or v.ndim != 1:
        raise ValueError("values, starts and durations: one number per sample each")
    if v.size == 0:
        return 0
    tail = np.argsort(v, kind="stable")[v.size - beyond(v.size, p):]
    return len(merge_periods(s[tail], s[tail] + d[tail]))


def merge_periods(starts: Sequence[float] | np.ndarray,
                  ends: Sequence[float] | np.ndarray) -> list[tuple[float, float]]:
    """Time intervals merged where they overlap: the distinct periods they cover.

    Touching is not overlapping: in a closed loop a client's next request starts the instant
    its last one ends, and two slow requests of one client in a row are two events."""
    merged: list[list[float]] = []
    for a, b in sorted(zip(np.asarray(starts, float), np.asarray(ends, float))):
        if merged and a < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(float(a), float(b)) for a, b in merged]


def median_ci(values: Sequence[float] | np.ndarray,
              level: float = CI_LEVEL) -> tuple[float, float]:
    """A distribution-free interval for the median of independent repeats (order statistics).

    The median lies below the k-th smallest of n repeats with probability P(Binomial(n, ½) >=
    k), whatever the distribution: the interval runs from the k-th smallest to the k-th largest
    for the largest k that keeps at least ``level`` coverage. Six repeats are the fewest with a
    95% interval (their smallest to their largest, 97%); with fewer there is none (NaN).
    """
    v = np.sort(np.asarray(values, dtype=float))
    n = v.size
    if not 0 < level < 1:
        raise ValueError("level must be in (0, 1)")
    # P(the median is outside [v_k, v_{n-k+1}]) = 2 P(Binomial(n, 1/2) <= k - 1)
    below = np.cumsum([math.comb(n, i) for i in range(n + 1)]) / 2.0**n
    ks = [k for k in range(1, n // 2 + 1) if 2 * below[k - 1] <= 1 - level]
    if not ks:
        return (math.nan, math.nan)
    k = max(ks)
    return (float(v[k - 1]), float(v[n - k]))


def closed_loop_send_times(e2el: Sequence[float] | np.ndarray,
                           concurrency: float) -> np.ndarray:
    """When each request of a closed loop was sent, rebuilt from the E2ELs in send order.

    ``infer-lab bench`` gives request i to whichever of the C clients is free first, and that
    client sends it at once. So the first C requests go out at 0 and each later one when the
    earliest in-flight request ends. For results that kept latencies but not timestamps; the
    rebuilt times run slightly early (E2EL stops at the last token, not at the stream's end).
    """
    import heapq

    if concurrency < 1 or concurrency != int(concurrency):
        raise ValueError("concurrency must be a whole number, at least 1")
    free = [0.0] * int(concurrency)  # a sweep's load may come as 8.0
    sent = np.empty(len(e2el))
    for i, latency in enumerate(np.asarray(e2el, dtype=float)):
        sent[i] = heapq.heappop(free)
        heapq.heappush(free, sent[i] + latency)
    return sent


def percentiles(values: Iterable[float], ps: Sequence[float] = PERCENTILES) -> dict[str, float]:
    """``{"p50": ..., ...}`` with numpy's linear interpolation; NaN for no samples."""
    v = np.asarray(list(values), dtype=float)
    if v.size == 0:
        return {f"p{p:g}": math.nan for p in ps}
    return {f"p{p:g}": float(x) for p, x in zip(ps, np.percentile(v, ps, method="linear"))}


_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft=500ms,tpot=50ms"`` -> ``{"ttft": 0.5, "tpot": 0.05}`` (seconds).

    Units s, ms or us; a bare number is milliseconds, as in vLLM's ``--goodput``. ``:`` works in
    place of ``=``. Metrics: ttft, tpot, e2el, and itl (every gap of the request within bound).
    """
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        m = re.fullmatch(r"(\w+)\s*[=:]\s*([0-9.]+(?:e-?\d+)?)\s*(s|ms|us)?", part.lower())
        if not m or m.group(1) not in METRICS:
            raise ValueError(f"bad SLO {part!r}: expected e.g. ttft=500ms (metrics: "
                             f"{', '.join(METRICS)}; units s, ms, us)")
        value = float(m.group(2)) * _UNITS[m.group(3) or "ms"]
        if value <= 0:
            raise ValueError(f"bad SLO {part!r}: the bound must be positive")
        slo[m.group(1)] = value
    return slo


def meets_slo(r: RequestResult, slo: Mapping[str, float]) -> bool:
    """True if the request succeeded and met every bound; an undefined TPOT breaks no bound."""
    if not r.success:
        return False
    values = {"ttft": ttft(r), "tpot": tpot(r), "e2el": e2el(r),
              "itl": max(itls(r), default=None)}
    return all(values[k] is None or values[k] <= bound for k, bound in slo.items())


def _json(x: Any) -> Any:
    """NaN is not JSON: write it as null."""
    return None if isinstance(x, float) and math.isnan(x) else x


@dataclass
class Summary:
    """One run in numbers. Latencies in seconds, throughputs per second of run duration."""

    num_requests: int
    completed: int
    failed: int
    duration: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2el: Dist
    slo: dict[str, float] = field(default_factory=dict)
    goodput: float | None = None  # requests/s meeting every SLO; None when no SLO was given
    goodput_tokens: float | None = None  # output tokens/s of those requests (for cost)
    slo_met: int | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    output_len_mismatch: int = 0  # succeeded, but not with the requested number of tokens
    errors: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in self.__dict__.items():
            out[k] = v.to_dict() if isinstance(v, Dist) else _json(v)
        return out


def summarize(results: Sequence[RequestResult], duration: float,
              slo: Mapping[str, float] | None = None) -> Summary:
    """Every metric of one run. ``duration``: run start to the last request's end."""
    ok = [r for r in results if r.success]
    errors = Counter(r.error or "failed" for r in results if not r.success)
    per = lambda x: x / duration if duration > 0 else math.nan
    in_tok = sum(r.prompt_len for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    slo = dict(slo or {})
    good = [r for r in ok if meets_slo(r, slo)] if slo else None
    met = len(good) if good is not None else None
    return Summary(
        num_requests=len(results), completed=len(ok), failed=len(results) - len(ok),
        duration=duration, request_throughput=per(len(ok)), output_throughput=per(out_tok),
        total_token_throughput=per(in_tok + out_tok),
        ttft=Dist.of(x for r in ok if (x := ttft(r)) is not None),
        tpot=Dist.of(x for r in ok if (x := tpot(r)) is not None),
        itl=Dist.of(g for r in ok for g in itls(r)),
        e2el=Dist.of(x for r in ok if (x := e2el(r)) is not None),
        slo=slo, goodput=per(met) if met is not None else None, slo_met=met,
        goodput_tokens=per(sum(r.output_tokens for r in good)) if good is not None else None,
        input_tokens=in_tok, output_tokens=out_tok,
        output_len_mismatch=sum(r.output_tokens != r.output_len for r in ok),
        errors=dict(errors.most_common()),
    )


SCALARS = ("request_throughput", "output_throughput", "total_token_throughput", "goodput",
           "goodput_tokens", "failed")


def scalars(s: Summary | Mapping[str, Any]) -> dict[str, float]:
    """The numbers a repeat can move, flattened: ``ttft.p99``, ``output_throughput``, ..."""
    d = s.to_dict() if isinstance(s, Summary) else s
    out = {k: d[k] for k in SCALARS if d.get(k) is not None}
    for m in METRICS:
        for p in ("p50", "p90", "p99"):
            if d[m][p] is not None:
                out[f"{m}.{p}"] = d[m][p]
    return {k: float(v) for k, v in out.items()}


def spread(summaries: Sequence[Summary | Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """How much repeats of the same run disagree: median, min, max, std and (max-min)/median.

    These machines are noisy; a number quoted without its spread over repeats says too much.
    """
    flat = [scalars(s) for s in summaries]
    keys = [k for k in flat[0] if all(k in f for f in flat)] if flat else []
    out = {}
    for k in keys:
        v = np.array([f[k] for f in flat])
        med = float(np.median(v))
        rel = float((v.max() - v.min()) / med) if med else math.nan
        out[k] = {"median": med, "min": float(v.min()), "max": float(v.max()),
                  "std": float(v.std(ddof=1)) if v.size > 1 else 0.0, "rel_range": _json(rel)}
    return out
