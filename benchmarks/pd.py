"""Colocated vs disaggregated vs two replicas, at one offered load, on this 2-core machine.

Short chat-like requests (streaming) arrive as a Poisson process, and long prompts arrive among
them; three ways to serve them with the bundled model, each worker pinned with ``taskset`` (the
router and the load generator are not pinned):

- ``colocated``: one ``infer-lab serve`` on both cores (2 threads, chunked prefill);
- ``disaggregated``: a prefill worker on core 0 and a decode worker on core 1 (1 thread each),
  behind ``vllm-router --vllm-pd-disaggregation`` (0.1.17, unchanged);
- ``replicas``: two colocated workers, one per core (1 thread each), behind ``vllm-router``
  round robin.

For the short requests: inter-token latency p50/p99 (the interference a long prefill causes) and
TTFT p50/p99, with 95% bootstrap intervals that resample requests as independent (a stall shared
by every running request is not: read them as a floor on the uncertainty) and, beside them,
block-bootstrap intervals that resample stretches of the timeline (``stats.block_bootstrap_ci``:
requests one stall slowed were sent close together and come in or stay out together); with a
few dozen short requests a TTFT p99 is close to their maximum. For every request, short or long:
the largest gap between two successive streamed tokens, which request and when, and how many gaps
(and how many distinct stalls) exceeded 100 and 250 ms (:func:`gap_extremes`): a p99 over
thousands of gaps can hide the handful that a long prefill stretches. For all: goodput, the
requests per second that met the SLO. The router's and the load generator's CPU seconds are
recorded beside the figures, and the load average before and after (sampled then, not during):
this machine is shared, so one run's figures are noisy; quote differences only where they
exceed the intervals.

    python -m benchmarks.pd [--duration 40] [--rate 2] [--long-every 4] [--out pd]

writes ``benchmarks/results/<out>.json``. The committed ``pd.json`` came from
``--duration 120 --rate 0.5 --long-every 6``, and ``pd_overload.json`` from
``--duration 30 --rate 2 --long-every 4 --out pd_overload``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks._common import print_table, provenance, write_results
from infer_lab.measure.loadgen import Endpoint, make_prompt, run_open_loop, run_sync
from infer_lab.measure.stats import (
    block_bootstrap_ci,
    bootstrap_ci,
    itls,
    meets_slo,
    parse_slo,
    ttft,
)
from infer_lab.measure.workloads import RequestSpec
from infer_lab.serve.launch import free_port

GAP_THRESHOLDS_MS = (100.0, 250.0)
# written beside the rows: why the maximum gap has no interval
MAX_GAP_NOTE = ("max_gap_ms has no interval: a bootstrap resample's maximum can never exceed the "
                "sample's, so resampling says nothing about it; the counts of gaps and of "
                "distinct stalls over each threshold are reported instead")
ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
TOKEN = "pd-bench"


def wait_health(base: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{base}: the process exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{base} did not come up")


def worker(cores: str, threads: int, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "INFER_LAB_KV_TOKEN": TOKEN}
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115
    proc = subprocess.Popen(
        ["taskset", "-c", cores, sys.executable, "-m", "infer_lab.cli", "serve", "--port",
         str(port), "--device", "cpu", "--dtype", "fp32", "--num-kv-blocks", "512", *args],
        stdout=subprocess.DEVNULL, stderr=log, env=env)
    return proc, f"http://127.0.0.1:{port}"


def router(*args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([ROUTER, *args, "--host", "127.0.0.1", "--port", str(port),
                             "--prometheus-host", "127.0.0.1", "--prometheus-port",
                             str(free_port())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def start(config: str) -> tuple[list[subprocess.Popen], str, subprocess.Popen | None, str]:
    """The processes, the URL to send to, the router (if any), and one worker's URL."""
    if config == "colocated":
        proc, base = worker("0,1", 2)
        wait_health(base, proc)
        return [proc], base, None, base
    if config == "disaggregated":
        kv = free_port()
        p, pbase = worker("0", 1, "--kv-role", "prefill", "--kv-transfer-port", str(kv))
        d, dbase = worker("1", 1, "--kv-role", "decode", "--kv-peers", f"127.0.0.1:{kv}")
        wait_health(pbase, p)
        wait_health(dbase, d)
        r, base = router("--vllm-pd-disaggregation", "--prefill", pbase, "--decode", dbase,
                         "--policy", "round_robin")
        wait_health(base, r)
        return [p, d], base, r, dbase
    a, abase = worker("0", 1)
    b, bbase = worker("1", 1)
    wait_health(abase, a)
    wait_health(bbase, b)
    r, base = router("--worker-urls", abase, bbase, "--policy", "round_robin")
    wait_health(base, r)
    return [a, b], base, r, abase


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def workload(args: argparse.Namespace) -> list[RequestSpec]:
    rng = np.random.default_rng(0)
    specs, t = [], 0.0
    while t < args.duration:
        t += rng.exponential(1 / args.rate)
        specs.append(RequestSpec(32, args.short_out, t, make_prompt(rng, 32)))
    for t in np.arange(args.long_every / 2, args.duration, args.long_every):
        specs.append(RequestSpec(args.long_len, 4, float(t), make_prompt(rng, args.long_len)))
    return sorted(specs, key=lambda s: s.arrival)


def gap_extremes(streams: Sequence[Sequence[float]],
                 thresholds_ms: Sequence[float] = GAP_THRESHOLDS_MS) -> dict[str, Any]:
    """The largest gap between successive tokens of any stream, and how many gaps were long.

    ``streams`` holds each request's token arrival times in seconds into the run (empty for a
    failed request: it has no gaps). Returns ``gaps`` (their number), ``max_gap_ms``,
    ``max_gap_request`` (the index of its stream), ``max_gap_start_s`` (when its earlier token
    came) and, for each threshold ``t``: ``gaps_over_<t>ms``, the gaps longer than ``t``;
    ``requests_over_<t>ms``, the streams with at least one; and ``stalls_over_<t>ms``, those
    gaps with overlapping spans merged, since one prefill stretches a gap of every request
    decoding at the time. The maximum is None when there are no gaps. No interval (see
    :data:`MAX_GAP_NOTE`): a maximum over one run is an observation, not an estimate.
    """
    spans: list[tuple[float, float, int]] = []  # (start, end, stream) of every gap
    for i, times in enumerate(streams):
        t = np.asarray(times, dtype=float)
        if np.any(np.diff(t) < 0):
            raise ValueError(f"stream {i}: token times must not decrease")
        spans += [(float(a), float(b), i) for a, b in zip(t[:-1], t[1:], strict=True)]
    out: dict[str, Any] = {"gaps": len(spans), "max_gap_ms": None, "max_gap_request": None,
                           "max_gap_start_s": None}
    if spans:
        a, b, i = max(spans, key=lambda s: s[1] - s[0])
        out.update(max_gap_ms=(b - a) * 1e3, max_gap_request=i, max_gap_start_s=a)
    for limit in thresholds_ms:
        long = sorted(s for s in spans if (s[1] - s[0]) * 1e3 > limit)
        stalls, reach = 0, -np.inf
        for start, end, _ in long:  # sorted by start: a new stall when past the last reach
            stalls += start >= reach
            reach = max(reach, end)
        out[f"gaps_over_{limit:g}ms"] = len(long)
        out[f"requests_over_{limit:g}ms"] = len({s[2] for s in long})
        out[f"stalls_over_{limit:g}ms"] = int(stalls)
    return out


def measure(config: str, specs: list[RequestSpec], slo: dict[str, float]) -> dict[str, Any]:
    procs, base, rproc, one = start(config)
    try:
        model = httpx.get(f"{one}/v1/models", timeout=30).json()["data"][0]["id"]
        endpoint = Endpoint(base, model=model)
        warm = [RequestSpec(16, 2, 0.0, make_prompt(np.random.default_rng(9), 16))] * 2
        run_sync(run_open_loop(endpoint, warm))
        r0 = cpu_seconds(rproc.pid) if rproc else 0.0
        run = run_sync(run_open_loop(endpoint, specs))
        router_cpu = (cpu_seconds(rproc.pid) - r0) if rproc else 0.0
    finally:
        for p in [*procs, *([rproc] if rproc else [])]:
            p.terminate()
        for p in [*procs, *([rproc] if rproc else [])]:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
    short = [r for r in run.results if r.prompt_len == 32]
    long = [r for r in run.results if r.prompt_len != 32]
    ok = [r for r in short if r.success]
    gaps = [itls(r) for r in ok]
    short_ttft = [ttft(r) for r in ok]
    sent = [r.sent for r in ok]
    long_ttft = [ttft(r) for r in long if r.success]
    row: dict[str, Any] = {"config": config, "requests": len(run.results),
                           "failed": sum(not r.success for r in run.results),
                           "router_cpu_s": router_cpu,
                           "loadgen_cpu_s": run.client_cpu * run.duration}
    flat = np.concatenate([np.asarray(g) for g in gaps if g]) * 1e3
    for p in (50, 99):
        row[f"itl_p{p}_ms"] = float(np.percentile(flat, p))
        row[f"short_ttft_p{p}_ms"] = float(np.percentile(short_ttft, p)) * 1e3
        row[f"long_ttft_p{p}_ms"] = float(np.percentile(long_ttft, p)) * 1e3 if long_ttft \
            else float("nan")
    ci = bootstrap_ci([[g * 1e3 for g in x] for x in gaps], ps=(50, 99))
    row["itl_p99_ci_ms"] = ci["p99"]
    row["short_ttft_p99_ci_ms"] = bootstrap_ci(np.asarray(short_ttft) * 1e3, ps=(99,))["p99"]
    # the same, resampling stretches of the timeline: requests one stall slowed together
    block = block_bootstrap_ci([[g * 1e3 for g in x] for x in gaps], sent, ps=(50, 99))
    row["itl_p50_block_ci_ms"], row["itl_p99_block_ci_ms"] = block["p50"], block["p99"]
    row["short_ttft_p50_block_ci_ms"] = block_bootstrap_ci(
        np.asarray(short_ttft) * 1e3, sent, ps=(50,))["p50"]
    # every request's gaps, long ones' too: a stall shows in whichever streams it stretched
    extremes = gap_extremes([r.chunk_times if r.success else [] for r in run.results])
    if extremes["max_gap_request"] is not None:
        extremes["max_gap_prompt_len"] = run.results[extremes["max_gap_request"]].prompt_len
    row.update(extremes)
    good = sum(meets_slo(r, slo) for r in run.results)
    row["goodput_rps"] = good / run.duration
    row["slo_met"] = good / len(run.results)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--rate", type=float, default=2.0, help="short requests per second")
    parser.add_argument("--short-out", type=int, default=32)
    parser.add_argument("--long-len", type=int, default=1500)
    parser.add_argument("--long-every", type=float, default=4.0)
    parser.add_argument("--slo", default="ttft=2s,itl=500ms")
    parser.add_argument("--configs", default="colocated,disaggregated,replicas")
    parser.add_argument("--out", default="pd")
    args = parser.parse_args()
    specs, slo = workload(args), parse_slo(args.slo)
    load_before = os.getloadavg()
    rows = [measure(c, specs, slo) for c in args.configs.split(",")]
    print_table(rows, ["config", "requests", "failed", "itl_p50_ms", "itl_p99_ms",
                       "short_ttft_p50_ms", "short_ttft_p99_ms", "long_ttft_p50_ms",
                       "max_gap_ms", "gaps_over_100ms", "stalls_over_100ms",
                       "goodput_rps", "router_cpu_s", "loadgen_cpu_s"])
    payload = {"provenance": provenance("cpu"), "model": "bundled (tiny-kjv)",
               "workload": {"duration_s": args.duration, "short_rate": args.rate,
                            "short_prompt": 32, "short_out": args.short_out,
                            "long_prompt": args.long_len, "long_every_s": args.long_every,
                            "slo": args.slo},
               "load_average_before": load_before, "load_average_after": os.getloadavg(),
               "max_gap_note": MAX_GAP_NOTE, "rows": rows}
    print("wrote", write_results(args.out, payload))


if __name__ == "__main__":
    main()
