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
slowest: :func:`bootstrap_ci` gives each percentile a confidence interval (resampling *requests*,
so that the gaps of one slow request stay together), and :func:`beyond` says how many samples lie
past a percentile, the number a reader needs to judge a tail.
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
# The smallest N with MIN_BEYOND samples beyond its p99 (numpy's linear rule): the default N.
MIN_REQUESTS_FOR_P99 = 1000
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
    ones it rests on: 10 for the p99 of 1000 samples, 3 for 300, 1 for 100, none for fewer.
    """
    if n < 1:
        return 0
    if not 0 <= p <= 100:
        raise ValueError(f"a percentile is in [0, 100], not {p}")
    return n - 1 - math.floor((n - 1) * p / 100 + 1e-9)


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
    """
    if not 0 < level < 1 or n_boot < 1:
        raise ValueError("level must be in (0, 1) and n_boot >= 1")
    flat_input = isinstance(groups, np.ndarray) and groups.ndim == 1 or (
        len(groups) > 0 and np.ndim(groups[0]) == 0)
    arrays = ([np.asarray(groups, dtype=float)[i:i + 1] for i in range(len(groups))]
              if flat_input else [np.asarray(g, dtype=float).ravel() for g in groups])
    arrays = [a for a in arrays if a.size]
    if not arrays:
        return {f"p{p:g}": (math.nan, math.nan) for p in ps}
    values = np.concatenate(arrays)
    owner = np.repeat(np.arange(len(arrays)), [a.size for a in arrays])
    order = np.argsort(values, kind="stable")
    values, owner = values[order], owner[order]
    rng = np.random.default_rng(seed)
    est = {p: np.empty(n_boot) for p in ps}
    chunk = max(1, 2_000_000 // values.size)
    for start in range(0, n_boot, chunk):
        b = min(chunk, n_boot - start)
        picks = rng.integers(0, len(arrays), (b, len(arrays)))
        counts = np.zeros((b, len(arrays)), dtype=np.int64)
        np.add.at(counts, (np.arange(b)[:, None], picks), 1)
        weights = counts[:, owner]  # how often each sorted sample appears in each resample
        cum = np.cumsum(weights, axis=1)
        total = cum[:, -1]
        for p in ps:
            # numpy's linear rule on the expanded resample: index h, between ⌊h⌋ and ⌊h⌋+1
            h = (total - 1) * p / 100
            k = np.floor(h).astype(np.int64)
            frac = h - k
            lo_i = (cum <= k[:, None]).sum(axis=1)
            hi_i = (cum <= np.minimum(k + 1, total - 1)[:, None]).sum(axis=1)
            est[p][start:start + b] = values[lo_i] + frac * (values[hi_i] - values[lo_i])
    tail = (1 - level) / 2 * 100
    return {f"p{p:g}": (float(np.percentile(est[p], tail)),
                        float(np.percentile(est[p], 100 - tail))) for p in ps}


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
