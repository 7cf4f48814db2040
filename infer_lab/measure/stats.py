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
# ~10 samples above the p99 make it a measurement rather than the largest value or two.
MIN_REQUESTS_FOR_P99 = 1000


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
    met = sum(meets_slo(r, slo) for r in ok) if slo else None
    return Summary(
        num_requests=len(results), completed=len(ok), failed=len(results) - len(ok),
        duration=duration, request_throughput=per(len(ok)), output_throughput=per(out_tok),
        total_token_throughput=per(in_tok + out_tok),
        ttft=Dist.of(x for r in ok if (x := ttft(r)) is not None),
        tpot=Dist.of(x for r in ok if (x := tpot(r)) is not None),
        itl=Dist.of(g for r in ok for g in itls(r)),
        e2el=Dist.of(x for r in ok if (x := e2el(r)) is not None),
        slo=slo, goodput=per(met) if met is not None else None, slo_met=met,
        input_tokens=in_tok, output_tokens=out_tok,
        output_len_mismatch=sum(r.output_tokens != r.output_len for r in ok),
        errors=dict(errors.most_common()),
    )


SCALARS = ("request_throughput", "output_throughput", "total_token_throughput", "goodput",
           "failed")


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
