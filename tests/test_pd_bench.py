"""The PD benchmark's reduction of token streams to their longest gaps (benchmarks/pd.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import benchmarks.pd as pd_bench
from benchmarks.pd import MAX_GAP_NOTE, gap_extremes
from infer_lab.measure.loadgen import RequestResult, RunResult
from infer_lab.measure.stats import parse_slo


def _steady(start: float, n: int, step: float = 0.004) -> list[float]:
    return [start + k * step for k in range(n)]


def test_a_few_stalls_that_a_p99_hides_show_in_the_maximum_and_the_counts():
    # 40 streams of 100 tokens, 4 ms apart; one 180 ms prefill at t = 2.0 s stretches the gap
    # of the 3 streams decoding then, and a 300 ms one at t = 3.2 s the gap of 2 others
    streams = [_steady(0.1 * i, 100) for i in range(40)]
    for i in (17, 18, 19):
        streams[i] = [t + 0.18 * (t > 2.0) for t in streams[i]]
    for i in (30, 31):
        streams[i] = [t + 0.3 * (t > 3.2) for t in streams[i]]
    gaps = np.concatenate([np.diff(s) for s in streams]) * 1e3
    assert np.percentile(gaps, 99) < 5  # the tail percentile sees nothing
    out = gap_extremes(streams)
    assert out["gaps"] == 40 * 99
    assert out["max_gap_ms"] == pytest.approx(304, abs=0.5)
    assert out["max_gap_request"] in (30, 31)
    assert 3.19 < out["max_gap_start_s"] <= 3.2
    assert out["gaps_over_100ms"] == 5 and out["requests_over_100ms"] == 5
    assert out["stalls_over_100ms"] == 2  # five stretched gaps, two events
    assert out["gaps_over_250ms"] == 2 and out["stalls_over_250ms"] == 1


def test_gaps_that_do_not_overlap_are_separate_stalls_and_thresholds_are_strict():
    # binary fractions, exact in floating point: gaps of 250, 125, 250 and 125 ms
    streams = [[0.0, 0.25, 0.375], [0.3125, 0.5625], [1.0, 1.125]]
    out = gap_extremes(streams, thresholds_ms=(125.0, 200.0))
    assert out["gaps_over_200ms"] == 2 and out["stalls_over_200ms"] == 2  # apart in time
    assert out["requests_over_200ms"] == 2
    assert out["gaps_over_125ms"] == 2  # strictly above: the two of exactly 125 ms are not
    assert out["max_gap_request"] == 0 and out["max_gap_start_s"] == 0.0  # the first of ties


def test_failed_and_one_token_streams_have_no_gaps_and_nothing_is_invented():
    out = gap_extremes([[], [3.0]])
    assert out["gaps"] == 0 and out["max_gap_ms"] is None and out["max_gap_request"] is None
    assert out["gaps_over_100ms"] == 0 and out["stalls_over_250ms"] == 0
    json.dumps(out)  # the row is written as JSON as it is


def test_times_that_go_backwards_are_refused_by_stream():
    with pytest.raises(ValueError, match="stream 1"):
        gap_extremes([[0.0, 0.1], [0.5, 0.4]])


def test_the_note_says_why_the_maximum_has_no_interval():
    assert "no interval" in MAX_GAP_NOTE and "maximum" in MAX_GAP_NOTE


def test_measure_puts_the_gap_figures_in_each_row(monkeypatch):
    """The benchmark's own row building, with the servers and the load replaced by a run."""
    short = [RequestResult(32, 32, sent=0.5 * i, chunk_times=_steady(0.5 * i + 0.02, 32, 0.04),
                           success=True) for i in range(12)]
    long = RequestResult(1500, 4, sent=3.0, chunk_times=[3.2, 3.204, 3.208, 3.212],
                         success=True)
    for r in short[4:6]:  # decoding while the long prompt's 180 ms prefill ran
        r.chunk_times = [t + 0.18 * (t > 3.0) for t in r.chunk_times]
    failed = RequestResult(32, 32, sent=6.0, success=False, error="boom")
    run = RunResult([*short[:7], long, *short[7:], failed], duration=7.0, mode="open",
                    load=2.0, client_cpu=0.1)

    class Reply:
        def json(self):
            return {"data": [{"id": "m"}]}

    monkeypatch.setattr(pd_bench, "start", lambda config: ([], "http://x", None, "http://x"))
    monkeypatch.setattr(pd_bench.httpx, "get", lambda *a, **k: Reply())
    monkeypatch.setattr(pd_bench, "run_open_loop", lambda endpoint, specs: specs)
    monkeypatch.setattr(pd_bench, "run_sync", lambda specs: run)
    row = pd_bench.measure("colocated", [], parse_slo("ttft=2s,itl=500ms"))
    assert row["failed"] == 1 and row["gaps"] == 12 * 31 + 3
    assert row["max_gap_ms"] == pytest.approx(220, abs=0.5)
    assert row["max_gap_request"] in (4, 5) and row["max_gap_prompt_len"] == 32
    assert row["gaps_over_100ms"] == 2 and row["stalls_over_100ms"] == 1
    assert row["gaps_over_250ms"] == 0
    assert row["itl_p99_ms"] < 100  # 2 long gaps in 372: the p99 does not see them
    json.dumps(row)
