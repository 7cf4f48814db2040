"""The soak (issues 12 and 24): ~30 s of mixed clients against a real server, with the queue
bound low enough that some requests are refused, and issue 24's attackers beside them (a
stalled reader, a slot hog, a compile flood). Asserts what must hold under any load; reports
timings without asserting them (``benchmarks/server_soak.py`` runs the same mix longer)."""

from __future__ import annotations

import asyncio
import gc

import psutil

from benchmarks.server_soak import references, soak
from infer_lab.serve.limits import ServerLimits
from infer_lab.serve.server import make_app
from tests.live_server import metric, running, wait_for

DURATION_S = 30
RSS_GROWTH_BOUND_MB = 200  # what a leak of one object per request would pass within 30 s


def test_soak_mixed_clients_disconnects_and_hostile_requests():
    limits = ServerLimits(send_timeout=1.0, send_buffer_bytes=16384, max_compiles=2)
    app = make_app(None, device="cpu", num_kv_blocks=256, max_num_seqs=16,
                   max_waiting_requests=6, limits=limits)
    refs = references()
    with running(app, header_timeout=2.0) as base:
        asyncio.run(soak(base, 5, clients=8, quitters=2, seed=1, refs=refs))  # warm-up
        gc.collect()
        rss0 = psutil.Process().memory_info().rss
        report = asyncio.run(soak(base, DURATION_S, clients=10, quitters=3, seed=2, refs=refs,
                                  attackers=True, max_n=limits.max_n))
        gc.collect()
        rss1 = psutil.Process().memory_info().rss
        summary = report.summary()
        print(summary, f"rss growth {(rss1 - rss0) / 2**20:.1f} MB")
        assert not report.server_errors, summary
        assert not report.wrong, summary
        assert report.ok >= 20 and report.disconnects >= 5, summary
        assert report.busy_without_retry_after == 0, summary
        # 429: a hostile grammar may find the compile thread busy with the compile flood
        assert all(k.split()[1] in ("0", "400", "413", "429") for k in report.hostile), summary
        assert sum(report.hostile.values()) >= 10, summary
        kinds = {k.split()[0]: k.split()[1] for k in report.attacks}
        assert {"stalled_reader", "slot_hog", "compile_flood"} <= set(kinds), summary
        assert report.attacks.get("stalled_reader cut", 0) >= 1, summary
        assert all(k.split()[1] in ("200", "429") for k in report.attacks
                   if not k.startswith("stalled")), summary
        assert wait_for(lambda: metric(base, "kv_cache_blocks_used") == 0, 30)
        assert metric(base, "num_requests_running") == 0
        assert (rss1 - rss0) / 2**20 < RSS_GROWTH_BOUND_MB
