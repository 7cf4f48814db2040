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


# --- how much a percentile can be trusted: samples beyond it, bootstrap intervals -------------


@pytest.mark.parametrize(("n", "p", "want"), [
    (0, 99, 0), (1, 99, 0), (16, 99, 1), (100, 99, 1), (300, 99, 3), (901, 99, 9),
    (902, 99, 10), (1000, 99, 10), (10, 50, 5), (11, 50, 5), (1000, 90, 100),
])
def test_beyond_counts_the_samples_past_a_percentile(n, p, want):
    # numpy's linear rule puts the percentile at index (n - 1) * p / 100; count what lies after
    assert stats.beyond(n, p) == want
    if n:
        v = np.arange(n, dtype=float)
        assert int((v > np.percentile(v, p)).sum()) == want


def test_beyond_rejects_a_percentile_out_of_range():
    with pytest.raises(ValueError):
        stats.beyond(10, 101)


def test_bootstrap_resample_percentile_is_numpys_linear_rule():
    # one resample, level chosen so the interval collapses onto it: it must equal numpy's
    # percentile of the pooled gaps of the requests drawn (the same draw, same seed)
    rng = np.random.default_rng(7)
    groups = [rng.exponential(1.0, int(rng.integers(1, 6))) for _ in range(40)]
    got = stats.bootstrap_ci(groups, ps=(50, 90, 99), n_boot=1, seed=11)
    picks = np.random.default_rng(11).integers(0, 40, (1, 40))[0]
    pooled = np.concatenate([groups[i] for i in picks])
    for p in (50, 90, 99):
        lo, hi = got[f"p{p}"]
        assert lo == pytest.approx(np.percentile(pooled, p)) and hi == pytest.approx(lo)


def test_bootstrap_interval_covers_the_true_percentile_at_the_nominal_rate():
    """A statistical test, seeded: 200 data sets of N = 1000 exponential(1) samples.

    The true percentiles are known (-ln(1 - p/100)); a 95% interval should cover each in about
    95% of the data sets. With 200 sets the count's standard deviation is ~1.5 points, so the
    tolerance [0.90, 0.99] is three of them either side. (At N = 300 the p99 interval covers
    only ~85%: three samples beyond the p99 are too few for any interval, which is why the
    bench warns below ten.)
    """
    rng = np.random.default_rng(2026)
    hits = dict.fromkeys((50, 90, 99), 0)
    trials = 200
    for i in range(trials):
        x = rng.exponential(1.0, 1000)
        ci = stats.bootstrap_ci(x, n_boot=400, seed=i)
        for p in hits:
            lo, hi = ci[f"p{p}"]
            hits[p] += lo <= -math.log(1 - p / 100) <= hi
    for p, h in hits.items():
        assert 0.90 <= h / trials <= 0.99, (p, h / trials)


def test_bootstrap_over_requests_keeps_a_slow_requests_gaps_together():
    # Each request's 50 gaps share its own pace: the gaps are not 10 000 independent samples,
    # and an interval that treated them so would be far too narrow.
    rng = np.random.default_rng(3)
    pace = rng.exponential(1.0, 200)
    groups = [s * (1 + 0.01 * rng.standard_normal(50)) for s in pace]
    grouped = stats.bootstrap_ci(groups, ps=(99,), n_boot=300)["p99"]
    naive = stats.bootstrap_ci(np.concatenate(groups), ps=(99,), n_boot=300)["p99"]
    assert grouped[1] - grouped[0] > 2 * (naive[1] - naive[0])


def test_bootstrap_is_seeded_and_handles_no_samples():
    x = np.random.default_rng(0).exponential(1.0, 300)
    assert stats.bootstrap_ci(x, seed=4) == stats.bootstrap_ci(x, seed=4)
    assert stats.bootstrap_ci(x, seed=4) != stats.bootstrap_ci(x, seed=5)
    empty = stats.bootstrap_ci([], ps=(99,))
    assert all(math.isnan(v) for v in empty["p99"])
    for bad in ({"level": 1.0}, {"level": 0.0}, {"n_boot": 0}):
        with pytest.raises(ValueError):
            stats.bootstrap_ci(x, **bad)


def test_goodput_tokens_count_only_the_requests_that_met_the_slo():
    # R1: TTFT 0.1, 3 tokens; R2: TTFT 0.3, 1 token. TTFT <= 0.2 keeps R1 only: 3 tokens in 2 s
    s = stats.summarize([R1, R2], duration=2.0, slo={"ttft": 0.2})
    assert s.goodput == pytest.approx(0.5) and s.goodput_tokens == pytest.approx(1.5)
    assert stats.summarize([R1, R2], duration=2.0).goodput_tokens is None


@pytest.mark.parametrize(("n", "warned"), [(100, True), (300, True), (901, True), (902, False),
                                           (1000, False)])
def test_the_bench_warns_exactly_when_fewer_than_ten_lie_beyond_a_p99(n, warned):
    from infer_lab.measure import bench

    rng = np.random.default_rng(n)
    results = []
    for i in range(n):  # 3 tokens each: a TTFT, a TPOT, two ITL gaps per request
        t = i + rng.exponential(0.1, 3).cumsum()
        results.append(req(float(i), t.tolist()))
    point = {"mode": "closed", "load": 4.0, **bench.intervals(results, n_boot=50)}
    assert point["beyond_p99"]["ttft"] == stats.beyond(n, 99)
    assert point["samples"] == {"ttft": n, "tpot": n, "itl": 2 * n, "e2el": n}
    lines = bench.tail_warnings([point])
    assert bool(lines) is warned
    if warned:
        assert f"TTFT {stats.beyond(n, 99)}" in lines[0] and "C=4" in lines[0]
        # ITL pools two gaps per request: from 902 gaps on it has ten beyond, and is not named
        assert ("ITL" in lines[0]) is (stats.beyond(2 * n, 99) < 10)


# --- when requests are not independent: stall events and the time-block bootstrap ----------


def closed_loop_with_stalls(rng: np.random.Generator, n: int, clients: int = 4,
                            stall_rate: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Send times and latencies (in send order) of a closed loop whose server now and then stalls.

    ``clients`` send back to back, each request needing an exponential(0.1 s) of service; stalls
    come as a Poisson process (``stall_rate`` a second) and last 0.5-1.5 s, and one delays
    *every* request in flight by its whole length, as a long prefill or another process taking
    the core does. The slow requests come in clusters of ``clients``.

    A client is always in flight, so every stall that starts before one of its requests ends
    delays that end: end = (service done so far) + (length of the stalls begun by then), a fixed
    point found by iterating, for all of a client's requests at once.
    """
    per = 2 * n // clients + 10  # enough that no client runs out before the n-th send
    horizon = per * 0.1 * 3 + 100
    starts = np.sort(rng.uniform(0, horizon, rng.poisson(stall_rate * horizon)))
    stalled = np.concatenate([[0.0], np.cumsum(rng.uniform(0.5, 1.5, starts.size))])
    sent, latency = [], []
    for work in np.cumsum(rng.exponential(0.1, (clients, per)), axis=1):
        end = work.copy()
        while True:
            new = work + stalled[np.searchsorted(starts, end, side="left")]
            if np.array_equal(new, end):
                break
            end = new
        begin = np.concatenate([[0.0], end[:-1]])
        sent.append(begin)
        latency.append(end - begin)
    sent_all, latency_all = np.concatenate(sent), np.concatenate(latency)
    order = np.argsort(sent_all, kind="stable")[:n]
    assert sent_all[order[-1]] < min(c[-1] for c in sent), "a client ran out of requests"
    return sent_all[order], latency_all[order]


def test_the_request_bootstrap_undercovers_correlated_tails_and_the_block_one_does_not():
    """Seeded: 40 runs of 4000 requests from a server whose stalls hit every request in flight.

    The true p99 comes from 40 runs of 20 000 requests (to within ~2%, far inside either
    interval). The p99 of each run rests on 40 samples from about a dozen stalls; resampling
    requests reads them as 40 independent observations, so its 95% interval covers the truth in
    only ~60% of runs. Resampling stretches of the timeline keeps each stall's requests
    together and covers it in ~92%.
    """
    rng = np.random.default_rng(1)
    true = np.percentile(np.concatenate(
        [closed_loop_with_stalls(rng, 20_000)[1] for _ in range(40)]), 99)
    trials, hits, events = 40, {"requests": 0, "block": 0}, []
    for i in range(trials):
        sent, latency = closed_loop_with_stalls(np.random.default_rng(100 + i), 4000)
        for name, ci in (("requests", stats.bootstrap_ci(latency, ps=(99,), n_boot=100, seed=i)),
                         ("block", stats.block_bootstrap_ci(latency, sent, ps=(99,),
                                                            n_boot=100, seed=i))):
            lo, hi = ci["p99"]
            hits[name] += lo <= true <= hi
        events.append(stats.stall_events(latency, sent))
    assert hits["requests"] / trials <= 0.75, hits
    assert hits["block"] / trials >= 0.85, hits
    assert 8 <= np.median(events) <= 20  # 40 samples beyond each p99, from about a dozen stalls


def test_the_block_bootstrap_covers_independent_samples_too():
    # on i.i.d. data (times in order, no dependence) it must not be worse than the request one
    rng = np.random.default_rng(2026)
    hits, trials = 0, 100
    for i in range(trials):
        x = rng.exponential(1.0, 1000)
        lo, hi = stats.block_bootstrap_ci(x, np.arange(1000.0), ps=(99,), n_boot=300,
                                          seed=i)["p99"]
        hits += lo <= -math.log(0.01) <= hi
    assert 0.88 <= hits / trials <= 0.99


def test_block_bootstrap_keeps_a_requests_gaps_together_and_is_seeded():
    rng = np.random.default_rng(3)
    groups = [s * (1 + 0.01 * rng.standard_normal(20)) for s in rng.exponential(1.0, 200)]
    times = np.arange(200.0)
    a = stats.block_bootstrap_ci(groups, times, ps=(50, 99), n_boot=200, seed=4)
    assert a == stats.block_bootstrap_ci(groups, times, ps=(50, 99), n_boot=200, seed=4)
    lo, hi = a["p99"]
    pooled = np.concatenate(groups)
    assert lo <= np.percentile(pooled, 99) <= hi and lo < hi
    # one block that spans the whole run: every resample is the run itself
    whole = stats.block_bootstrap_ci(pooled[:50], np.arange(50.0), ps=(99,), block_s=1e9)
    assert whole["p99"][0] == pytest.approx(np.percentile(pooled[:50], 99))
    assert whole["p99"][1] == pytest.approx(whole["p99"][0])
    assert all(math.isnan(v) for v in stats.block_bootstrap_ci([], [], ps=(99,))["p99"])
    for bad in ({"times": [0.0, 1.0]}, {"times": [0.0] * 199 + [math.nan]},
                {"block_s": 0.0}, {"level": 1.0}):
        kwargs = {"times": times, **bad}
        with pytest.raises(ValueError):
            stats.block_bootstrap_ci(groups, **kwargs)


def test_stall_events_merge_slow_periods_that_overlap():
    # 100 samples, p99 between the two largest: only the largest lies beyond it
    v = np.full(100, 0.1)
    v[[10, 11, 12, 50]] = [5.0, 4.9, 4.8, 4.7]  # 10-12 sent 0.5 s apart: their waits overlap
    starts = np.arange(100) * 0.5
    assert stats.stall_events(v, starts, p=99) == 1  # beyond the p99: sample 10 alone
    assert stats.beyond(100, 96) == 4
    assert stats.stall_events(v, starts, p=96) == 2  # 10, 11, 12 (one stall) and 50
    # durations other than the values: TPOT's slow period runs from first token to last
    assert stats.stall_events(v, starts, durations=np.full(100, 0.1), p=96) == 4
    # ties at the top count by rank, as beyond() counts them
    assert stats.stall_events(np.r_[np.zeros(90), np.ones(10)], np.arange(100.0), p=95) == 5
    assert stats.stall_events([], [], p=99) == 0
    with pytest.raises(ValueError):
        stats.stall_events(v, starts[:-1])
    assert stats.merge_periods([0, 1, 5, 1.8], [2, 1.5, 6, 3]) == [(0.0, 3.0), (5.0, 6.0)]
    assert stats.merge_periods([0, 1], [1, 2]) == [(0.0, 1.0), (1.0, 2.0)]  # touching: two


def test_closed_loop_send_times_rebuild_a_closed_loop():
    sent, latency = closed_loop_with_stalls(np.random.default_rng(5), 500, clients=3)
    assert np.allclose(stats.closed_loop_send_times(latency, 3), sent)
    # by hand: two clients; requests of 1, 3, 1, 1 s go out at 0, 0, 1 and 2
    assert stats.closed_loop_send_times([1, 3, 1, 1], 2).tolist() == [0, 0, 1, 2]
    assert stats.closed_loop_send_times([1, 3, 1, 1], 2.0).tolist() == [0, 0, 1, 2]  # JSON
    for bad in (0, 2.5):
        with pytest.raises(ValueError):
            stats.closed_loop_send_times([1.0], bad)


def test_the_bench_counts_stall_events_and_warns_when_a_tail_is_one_event():
    from infer_lab.measure import bench

    # 1000 requests sent 25 ms apart, ~50 ms each, except that one stall at t = 10 s delays
    # the 30 requests sent during it by about 2 s: one event, and the 10 beyond the p99 in it
    results, t = [], 0.0
    for i in range(1000):
        ttft_s = 2.0 - 0.001 * (i - 400) if 400 <= i < 430 else 0.05 + 0.0001 * (i % 7)
        results.append(req(t, [t + ttft_s, t + ttft_s + 0.05]))
        t += 0.025
    point = {"mode": "closed", "load": 4.0, **bench.intervals(results, n_boot=100)}
    assert point["beyond_p99"]["ttft"] == 10 and point["stall_events_p99"]["ttft"] == 1
    lo, hi = point["ci"]["ttft.p99"]
    blo, bhi = point["ci_block"]["ttft.p99"]
    # over requests the p99 looks known to 15 ms: ~30 slow ones are in nearly every resample;
    # over the timeline the one stall is in some resamples and not in others
    assert hi - lo < 0.015 and blo < 0.1 and bhi > 1.9
    lines = bench.tail_warnings([point])
    assert any("TTFT 10 samples from 1" in line for line in lines)
    point["metrics"] = {"ttft.p99": float(np.percentile([stats.ttft(r) for r in results], 99))}
    table = bench.ci_table([point])
    assert "time-block" in table[0] and " ev |" in table[1]
    assert table[3].split("|")[1].split()[-2:] == ["10", "1"]  # TTFT: 10 beyond, 1 event


def test_median_ci_from_independent_repeats():
    # seven rounds: the interval is their smallest to their largest (coverage 1 - 2/128 = 98%)
    rounds = [0.15, -0.26, -0.085, 0.115, 0.13, -0.085, 0.134]
    assert stats.median_ci(rounds) == (-0.26, 0.15)
    assert stats.median_ci(range(21)) == (5.0, 15.0)  # the 6th smallest to the 6th largest
    assert all(math.isnan(x) for x in stats.median_ci(range(5)))  # five: at best 94%
    rng = np.random.default_rng(0)
    hits = sum(lo <= math.log(2) <= hi
               for lo, hi in (stats.median_ci(rng.exponential(1.0, 21)) for _ in range(1000)))
    assert 0.95 <= hits / 1000 <= 0.99  # exact order statistics: at least the nominal level
    with pytest.raises(ValueError):
        stats.median_ci(rounds, level=1.0)
