"""The benchmarks' helpers that drive the engine's internals still run against the engine (a
refactor of ``step()`` once broke ``cpu_cost_per_step`` without a test noticing)."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pytest

import infer_lab as il
from benchmarks._common import provenance
from benchmarks.batching import cpu_cost_per_step


def test_cpu_cost_per_step_runs_every_sequence_through_whole_steps():
    model, tok = il.load()
    cost = cpu_cost_per_step(model, tok, num_seqs=8, steps=5)
    assert cost["num_seqs"] == 8  # none failed, none finished
    assert 0 < cost["scheduler_runner_us"] < cost["full_step_us"]


def test_provenance_says_which_host_and_when_the_run_started_and_ended():
    """Two committed runs can be told apart as sequential or overlapping (Chapter 13 found
    two that overlapped only from their end times and durations)."""
    prov = provenance("cpu")
    started = dt.datetime.fromisoformat(prov["started"])
    ended = dt.datetime.fromisoformat(prov["date"])
    assert prov["host"] and started <= ended
    assert ended - started < dt.timedelta(days=1)  # the import time, not a constant


def test_quant_formats_merge_replaces_rerun_rows_and_keeps_both_provenances(tmp_path):
    import json

    from benchmarks.quant_formats import merge

    def run(path, commit, rows):
        path.write_text(json.dumps({"provenance": {"commit": commit}, "models": [
            {"model": "m", "rows": [{"format": f, "kl_mean": v} for f, v in rows]}]}))
        return path

    a = run(tmp_path / "a.json", "aaa", [("RTN", 1.0), ("AWQ", 2.0)])
    b = run(tmp_path / "b.json", "bbb", [("AWQ", 3.0), ("new", 4.0)])
    out = merge([a, b])
    assert [(r["format"], r["kl_mean"]) for r in out["models"][0]["rows"]] == [
        ("RTN", 1.0), ("AWQ", 3.0), ("new", 4.0)]
    run_m = out["runs"]["m"]
    assert run_m["provenance"]["commit"] == "aaa"
    assert run_m["reruns"] == [{"formats": ["AWQ", "new"], "provenance": {"commit": "bbb"}}]
    # every row rerun on one length: the model's eval_tokens follows; mixed lengths: kept
    def sized(path, tokens, rows):
        path.write_text(json.dumps({"models": [{"model": "m", "eval_tokens": tokens, "rows": [
            {"format": f, "tokens": tokens} for f in rows]}]}))
        return path

    short = sized(tmp_path / "s.json", 511, ["RTN", "AWQ"])
    both = merge([short, sized(tmp_path / "l.json", 10000, ["RTN", "AWQ"])])
    assert both["models"][0]["eval_tokens"] == 10000
    part = merge([short, sized(tmp_path / "p.json", 10000, ["AWQ"])])
    assert part["models"][0]["eval_tokens"] == 511


def test_quant_formats_row_carries_both_intervals_and_no_per_token_values():
    """A short real run of one row: the interval of the p99 holds it, the count beyond it is
    Chapter 7's, and the row (what the result file stores) is JSON without the per-token KL."""
    import argparse
    import json

    from benchmarks.quant_formats import run_model
    from infer_lab.measure import stats

    args = argparse.Namespace(calib_seqs=2, calib_len=64, eval_tokens=1024, window=128,
                              stride=64, only=["int4 g32 RTN"])
    rows = run_model("tiny-kjv", args)["rows"]
    assert [r["format"] for r in rows] == ["int4 g32 RTN"]
    row = json.loads(json.dumps(rows[0]))  # what write_results would store
    assert "window_kls" not in row and len(row["window_sums"]) >= 15
    lo, hi = row["kl_p99_ci95"]
    assert lo <= row["kl_p99"] <= hi and row["kl_mean_ci95"][1] < lo
    assert row["beyond_p99"] == stats.beyond(row["tokens"], 99) == 11
    assert row["windows_beyond_p99"] == 5  # those 11 tokens come from 5 of the 16 windows


def _aiperf_record(phase, start_ns, ttft_ms, e2el_ms, icl_ms, error=None):
    """One line of aiperf 0.13's ``profile_export.jsonl``, as its record exporter writes it."""
    import json

    metrics = {"time_to_first_token": {"value": ttft_ms, "unit": "ms"},
               "request_latency": {"value": e2el_ms, "unit": "ms"},
               "inter_token_latency": {"value": (e2el_ms - ttft_ms) / len(icl_ms), "unit": "ms"},
               "inter_chunk_latency": {"value": icl_ms, "unit": "ms"},
               "output_sequence_length": {"value": len(icl_ms) + 1, "unit": "tokens"}}
    return json.dumps({"metadata": {"benchmark_phase": phase, "request_start_ns": start_ns},
                       "metrics": {} if error else metrics, "error": error})


def test_aiperf_records_become_our_requests_in_seconds_without_warmups_or_errors():
    from pytest import approx

    from benchmarks.aiperf_compare import aiperf_requests

    lines = [_aiperf_record("warmup", 0, 5.0, 20.0, [5.0, 10.0]),
             _aiperf_record("profiling", 3_000_000_000, 10.0, 40.0, [10.0, 20.0]),
             _aiperf_record("profiling", 3_500_000_000, 1.0, 2.0, [1.0], error={"code": 500}),
             _aiperf_record("profiling", 4_000_000_000, 12.0, 32.0, [8.0, 12.0]), ""]
    reqs, left = aiperf_requests(lines)
    assert left == {"warmup": 1, "errored": 1}
    assert [r.sent for r in reqs] == approx([0.0, 1.0])  # the measured phase's first send is 0
    assert (reqs[0].ttft, reqs[0].e2el, reqs[0].tpot) == approx((0.010, 0.040, 0.015))
    assert reqs[0].output_tokens == 3 and reqs[1].itl == approx([0.008, 0.012])


def test_aiperf_verdict_needs_close_medians_and_overlapping_intervals():
    from benchmarks.aiperf_compare import METRICS, Req, pooled, verdict

    rng = np.random.default_rng(0)

    def run(scale, n=200):
        return [Req(sent=i * 0.1, ttft=scale * (0.010 + 0.001 * rng.random()),
                    e2el=scale * 0.3, tpot=scale * 0.0045,
                    itl=list(scale * (0.0045 + 0.0005 * rng.random(8))), output_tokens=9)
                for i in range(n)]

    ours = pooled([run(1.0), run(1.0), run(1.0)])
    assert ours["num_requests"] == 600 and ours["itl"]["samples"] == 600 * 8
    lo, hi = ours["ttft"]["ci_block_ms"]
    assert lo <= ours["ttft"]["p50_ms"] <= hi and len(ours["ttft"]["per_repeat_p50_ms"]) == 3
    same = verdict(ours, pooled([run(1.0), run(1.0), run(1.0)]))
    assert set(same) == {m for m, *_ in METRICS}
    assert same["ttft"]["agree"] and abs(same["ttft"]["diff"]) < 0.02
    slower = verdict(ours, pooled([run(1.2), run(1.2), run(1.2)]))  # 20% apart
    assert not slower["ttft"]["agree"] and slower["ttft"]["diff"] > 0.15
    assert not slower["itl"]["intervals_overlap"]


def test_the_readme_quotes_the_committed_aiperf_comparison():
    """The README's aiperf row is plain Markdown: its figures must be what
    benchmarks/results/aiperf_compare.json holds, as ``headline`` prints them."""
    import json
    from pathlib import Path

    from benchmarks.aiperf_compare import headline

    root = Path(__file__).parents[1]
    row = next(line for line in (root / "README.md").read_text().splitlines()
               if line.startswith("| `python -m benchmarks.aiperf_compare"))
    for name in ("aiperf_compare", "aiperf_compare_pinned"):
        data = json.loads((root / "benchmarks" / "results" / f"{name}.json").read_text())
        assert headline(data) in row and f"aiperf {data['aiperf_version']}" in row
        assert data["workload"]["repeats"] >= 3 and all(
            len(pt["runs"][tool]) == data["workload"]["repeats"]
            for pt in data["points"] for tool in ("infer_lab", "aiperf"))
        assert (data.get("pinned") is not None) == (name == "aiperf_compare_pinned")


def test_eagle_intervals_take_prompts_as_the_unit():
    """benchmarks/eagle.py: per-prompt figures from round-major runs, and an interval of the
    pooled tokens per verification that resamples prompts (wide when prompts differ)."""
    from benchmarks.eagle import per_prompt, pooled_length_ci

    # 2 rounds x 2 prompts, round-major: prompt 0 accepts 1 per draft, prompt 1 none
    runs = [{"num_drafts": 10, "accepted_tokens": a, "seconds": s}
            for a, s in ((10, 1.0), (0, 2.0), (10, 3.0), (0, 2.0))]
    bases = [{"seconds": 1.0}, {"seconds": 1.0}, {"seconds": 1.0}, {"seconds": 1.0}]
    prompts = per_prompt(runs, bases, 2)
    assert [p["mean_accepted_length"] for p in prompts] == [2.0, 1.0]
    assert [p["num_drafts"] for p in prompts] == [20, 20]
    assert prompts[0]["speedup"] == np.median([1.0, 1 / 3])  # its two rounds
    same = pooled_length_ci([5] * 8, [10] * 8)
    assert same == (1.5, 1.5)  # identical prompts: no spread
    lo, hi = pooled_length_ci([10, 0] * 4, [10] * 8)
    assert 1.0 <= lo < 1.5 < hi <= 2.0  # the pooled 1.5, inside a real interval
    assert np.isnan(pooled_length_ci([3], [4])).all()  # one prompt: no interval


def test_eagle_speedup_decomposes_into_tokens_verification_and_draft():
    """benchmarks/eagle.py: with v (a step's cost less its draft's, in plain steps) the
    measured speedup is exactly tokens per step / (v + k c)."""
    from benchmarks.eagle import summarize

    spec = {"method": "eagle", "num_speculative_tokens": 2}
    # plain: 20 steps of 0.01 s; EAGLE: 10 steps of 0.015 s verify + 0.002 s draft
    bases = [{"seconds": 0.2, "steps": 20, "tokens": [1] * 20}]
    runs = [{"seconds": 0.17, "steps": 10, "propose_s": 0.02, "num_drafts": 10,
             "draft_tokens": 20, "accepted_tokens": 10, "per_pos": [10], "tokens": [1] * 20}]
    row = summarize("eagle k=2", spec, runs, bases, 1)
    assert row["verify_cost_v"] == pytest.approx(1.5)
    assert row["draft_cost_c"] == pytest.approx(0.1)
    tokens = row["mean_accepted_length"]
    assert tokens == 2.0
    assert row["speedup"] == pytest.approx(tokens / (row["verify_cost_v"] + 2 * 0.1))


def test_eagle_serve_ratio_is_taken_within_each_round():
    """benchmarks/eagle_serve.py: a round's ratio is its own two throughputs' ratio, so a
    round that ran slow for both servers does not move it."""
    from benchmarks.eagle_serve import summary

    raw = []
    for rnd, (base, spec) in enumerate(((10.0, 5.0), (40.0, 20.0), (20.0, 12.0))):
        for method, tok_s in (("none", base), ("eagle k=2", spec)):
            raw.append({"round": rnd, "method": method, "concurrency": 8, "failed": 0,
                        "output_tok_s": tok_s, "itl_p50_ms": 1000 / tok_s,
                        "tpot_p50_ms": 1000 / tok_s, "ttft_p50_ms": 5.0,
                        "load_average": 2.0 + rnd})
    rows = {r["method"]: r for r in summary(raw)}
    spec = rows["eagle k=2"]
    assert (spec["ratio"], spec["ratio_lo"], spec["ratio_hi"]) == (0.5, 0.5, 0.6)
    assert spec["output_tok_s"] == 12.0 and spec["rounds"] == 3  # the median of the rounds
    assert rows["none"]["ratio"] == 1.0 and spec["load_average"] == [2.0, 4.0]
    assert spec["ratio_ci95"] is None  # three rounds: too few for a 95 % interval
    six = [{**r, "round": r["round"] + 3 * i} for i in range(2) for r in raw]
    assert {r["method"]: r for r in summary(six)}["eagle k=2"]["ratio_ci95"] == [0.5, 0.6]
    # part-way through a sweep (the JSON is written after every point): what is there
    partial = summary(raw[:1] + [{**raw[0], "concurrency": 32}, {**raw[1], "concurrency": 1}])
    assert [(r["method"], r["concurrency"], r["ratio"]) for r in partial] == [
        ("none", 8, 1.0), ("none", 32, 1.0), ("eagle k=2", 1, None)]


def test_provenance_says_whether_the_code_was_the_commits(tmp_path):
    """A run with uncommitted changes to tracked files is marked: its commit alone does not
    name the code that ran. Checked on a scratch repository, clean and then edited."""
    import subprocess

    from benchmarks._common import git_state

    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    commit, dirty = git_state(tmp_path)
    assert len(commit) >= 7 and dirty is False
    (tmp_path / "b.py").write_text("untracked\n")  # untracked files are not the run's code
    assert git_state(tmp_path) == (commit, False)
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "r.json").write_text("{}\n")
    subprocess.run([*git, "add", "benchmarks"], check=True)
    subprocess.run([*git, "commit", "-qm", "r"], check=True)
    commit, _ = git_state(tmp_path)
    (results / "r.json").write_text('{"new": 1}\n')  # a run writing its result: not code
    assert git_state(tmp_path) == (commit, False)
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_state(tmp_path) == (commit, True)
    assert "uncommitted_changes" in provenance("cpu")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_linear_times_the_inner_product_in_both_dtypes(dtype):
    """The oneDNN column is the inner product in bf16 too, though ``kernels.linear`` sends bf16
    to ``F.linear``: without it the bf16 rows would time F.linear against itself."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.cpu_linear import onednn_route

    x, w = (torch.randn(3, 32).to(getattr(torch, dtype)),
            torch.randn(48, 32).to(getattr(torch, dtype)))
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        got = onednn_route(x.dtype)(x, w)
    assert "mkldnn::_linear_pointwise" in {e.key for e in prof.key_averages()}
    want = F.linear(x.float(), w.float())
    tol = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * float(want.abs().max()))
