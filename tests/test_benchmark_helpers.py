"""The benchmarks' helpers that drive the engine's internals still run against the engine (a
refactor of ``step()`` once broke ``cpu_cost_per_step`` without a test noticing)."""

from __future__ import annotations

import datetime as dt

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
