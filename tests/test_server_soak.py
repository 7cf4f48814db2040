"""The soak (issue 12): ~30 s of mixed clients against a real server, with the queue bound low
enough that some requests are refused. Asserts what must hold under any load; reports timings
without asserting them (``benchmarks/server_soak.py`` runs the same mix longer)."""

from __future__ import annotations

import asyncio
import gc

import psutil

from benchmarks.server_soak import references, soak
from infer_lab.serve.server import make_app
from tests.live_server import metric, running, wait_for

DURATION_S = 30
RSS_GROWTH_BOUND_MB = 200  # what a leak of one object per request would pass within 30 s


def test_soak_mixed_clients_disconnects_and_hostile_requests():
    app = make_app(None, device="cpu", num_kv_blocks=256, max_num_seqs=16,
                   max_waiting_requests=6)
    refs = references()
    with running(app, header_timeout=2.0) as base:
        asyncio.run(soak(base, 5, clients=8, quitters=2, seed=1, refs=refs))  # warm-up
        gc.collect()
        rss0 = psutil.Process().memory_info().rss
        report = asyncio.run(soak(base, DURATION_S, clients=10, quitters=3, seed=2, refs=refs))
        gc.collect()
        rss1 = psutil.Process().memory_info().rss
        summary = report.summary()
        print(summary, f"rss growth {(rss1 - rss0) / 2**20:.1f} MB")
        assert not report.server_errors, summary
        assert not report.wrong, summary
        assert report.ok >= 20 and report.disconnects >= 5, summary
        assert report.busy_without_retry_after == 0, summary
        assert all(k.split()[1] in ("0", "400", "413") for k in report.hostile), summary
        assert sum(report.hostile.values()) >= 10, summary
        assert wait_for(lambda: metric(base, "kv_cache_blocks_used") == 0, 30)
        assert metric(base, "num_requests_running") == 0
        assert (rss1 - rss0) / 2**20 < RSS_GROWTH_BOUND_MB
