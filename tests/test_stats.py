"""Latency statistics against examples worked out by hand (vLLM ``bench serve`` definitions)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from infer_lab.measure import stats
from infer_lab.measure.loadgen import RequestResult


def req(sent: float, chunks: list[float], usage: int | None = None, ok: bool = True,
        error: str = "", output_len: int | None = None, prompt_len: int = 10) -> RequestResult:
    return RequestResult(prompt_len=prompt_len, output_len=output_len or len(chunks),
                         sent=sent, end=chunks[-1] if chunks else sent + 0.5,
                         chunk_times=chunks, usage_tokens=usage, success=ok, error=error)


# r1: sent at 0, tokens at 0.1, 0.2, 0.4 -> TTFT 0.1, E2EL 0.4, TPOT 0.3/2, gaps 0.1, 0.2
R1 = req(0.0, [0.1, 0.2, 0.4])
# r2: sent at 1.0, one token at 1.3 -> TTFT = E2EL = 0.3, no TPOT, no gaps
R2 = req(1.0, [1.3])
# r3: failed after streaming a token: counted, never in a latency
R3 = req(0.5, [0.6], ok=False, error="error event: boom")


def test_per_request_metrics_by_hand():
    assert stats.ttft(R1) == pytest.approx(0.1) and stats.e2el(R1) == pytest.approx(0.4)
    assert stats.tpot(R1) == pytest.approx(0.15)
    assert stats.itls(R1) == pytest.approx([0.1, 0.2])
    assert stats.ttft(R2) == pytest.approx(0.3) and stats.e2el(R2) == pytest.approx(0.3)
    assert stats.tpot(R2) is None  # one output token: no time per token after the first
    assert stats.itls(R2) == []
    assert stats.ttft(R3) is None and stats.tpot(R3) is None and stats.itls(R3) == []


def test_usage_token_count_is_preferred_to_chunk_count():
    # 3 chunks but the server says 5 tokens (a chunk carried several): TPOT divides by 5 - 1.
    r = req(0.0, [0.1, 0.2, 0.5], usage=5)
    assert r.output_tokens == 5
    assert stats.tpot(r) == pytest.approx(0.4 / 4)
    assert stats.itls(r) == pytest.approx([0.1, 0.3])  # ITL stays per chunk


def test_percentiles_are_numpy_linear():
    p = stats.percentiles([1.0, 2.0, 3.0, 4.0])
    assert p == pytest.approx({"p50": 2.5, "p90": 3.7, "p99": 3.97})
    assert stats.percentiles([5.0]) == {"p50": 5.0, "p90": 5.0, "p99": 5.0}
    assert all(math.isnan(v) for v in stats.percentiles([]).values())
    d = stats.Dist.of(range(101))  # 0..100: the p-th percentile is p
    assert (d.n, d.p50, d.p90, d.p99, d.mean) == (101, 50, 90, 99, 50)


def test_summary_by_hand():
    s = stats.summarize([R1, R2, R3], duration=2.0)
    assert (s.num_requests, s.completed, s.failed) == (3, 2, 1)
    assert s.errors == {"error event: boom": 1}
    assert s.request_throughput == pytest.approx(1.0)  # 2 done in 2 s
    assert s.output_throughput == pytest.approx(2.0)  # (3 + 1) tokens in 2 s
    assert s.total_token_throughput == pytest.approx((20 + 4) / 2.0)
    assert s.ttft.n == 2 and s.ttft.p50 == pytest.approx(0.2)  # of 0.1 and 0.3
    assert s.tpot.n == 1 and s.tpot.p50 == pytest.approx(0.15)  # R2 has 1 token: left out
    assert s.itl.n == 2 and s.itl.p50 == pytest.approx(0.15)  # pooled gaps 0.1, 0.2
    assert s.e2el.p99 == pytest.approx(0.3 + 0.99 * 0.1)
    assert s.goodput is None and s.slo_met is None  # no SLO given


@pytest.mark.parametrize(("slo", "met"), [
    ("ttft=200ms", 1),  # R1 (100 ms) yes, R2 (300 ms) no
    ("tpot=100ms", 1),  # R1 (150 ms) no, R2 has no TPOT: breaks no bound
    ("tpot=200ms,ttft=500ms", 2),
    ("itl=150ms", 1),  # R1's worst gap is 200 ms; R2 has none
    ("e2el=0.35s", 1),
    ("ttft=50ms", 0),
])
def test_goodput_counts_requests_meeting_every_slo(slo, met):
    s = stats.summarize([R1, R2, R3], duration=2.0, slo=stats.parse_slo(slo))
    assert s.slo_met == met and s.goodput == pytest.approx(met / 2.0)


def test_parse_slo_units_and_errors():
    assert stats.parse_slo("ttft=500ms,tpot=50ms") == pytest.approx({"ttft": 0.5, "tpot": 0.05})
    assert stats.parse_slo("e2el=2s, itl:30") == pytest.approx({"e2el": 2.0, "itl": 0.03})
    assert stats.parse_slo("TTFT=250us") == pytest.approx({"ttft": 250e-6})
    assert stats.parse_slo(None) == {} and stats.parse_slo("") == {}
    for bad in ("ttft", "ttft=fast", "latency=1ms", "ttft=-1ms", "ttft=0ms", "ttft=5min"):
        with pytest.raises(ValueError):
            stats.parse_slo(bad)


def test_spread_across_repeats():
    runs = [stats.summarize([R1, R2], duration=d) for d in (2.0, 2.5, 1.6)]  # 1.0, 0.8, 1.25
    sp = stats.spread(runs)["request_throughput"]
    assert sp["median"] == pytest.approx(1.0)
    assert (sp["min"], sp["max"]) == pytest.approx((0.8, 1.25))
    assert sp["rel_range"] == pytest.approx(0.45)
    assert sp["std"] == pytest.approx(np.std([1.0, 0.8, 1.25], ddof=1))
    assert stats.spread(runs)["ttft.p50"]["rel_range"] == 0  # same requests, same latencies
    assert stats.spread([s.to_dict() for s in runs]) == stats.spread(runs)  # from JSON too


def test_empty_and_all_failed_runs_are_valid_json():
    for results in ([], [R3]):
        d = stats.summarize(results, duration=0.0, slo={"ttft": 0.1}).to_dict()
        text = json.dumps(d, allow_nan=False)  # NaN would not be JSON: it is written as null
        assert json.loads(text)["ttft"]["p99"] is None
    assert stats.summarize([R3], 1.0).failed == 1


def test_request_record_round_trips_through_json():
    r = req(0.25, [0.5, 0.75], usage=4)
    back = RequestResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r
