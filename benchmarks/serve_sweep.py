"""Our server under load: TTFT, TPOT and ITL at the tail, at each load, with intervals (Ch. 7).

Starts ``infer-lab serve`` on a free loopback port, then drives it with ``infer-lab bench``:

1. **sweep**: closed loop at concurrency 1, 2, 4, ..., 64 (or, with ``--mode open``, open loop
   with Poisson arrivals at the rates of ``--rates``), fixed 64-token prompts and 16-token outputs
   (``ignore_eos``), seed 0, warm-ups left out of every statistic, N = 1000 per point so that ten
   requests lie beyond each p99. Every percentile comes with two bootstrap intervals, over
   requests and over stretches of the timeline (which keeps the requests one stall slowed
   together), and each p99 with the number of distinct stall events beyond it; each point keeps
   every request's send time, TTFT, TPOT, E2EL and worst gap, so a reader can compute goodput
   for any SLO later.
2. **knobs** (closed mode): the same server restarted with other scheduler settings (step token
   budget, maximum batch) at one concurrency, on long prompts, to show how those knobs move TTFT
   against ITL.

``--only-knobs`` measures the knobs alone and puts them, with their own provenance, into the
existing ``serve_sweep.json``. ``--reanalyse`` adds time-block intervals and stall-event counts
to results measured before the bench computed them, from send times rebuilt from what those
results kept (closed loop: each request went out when the earliest in-flight one ended; open
loop: the seeded arrival schedule), and says so in each point's ``timeline``.

Writes ``results/serve_sweep.json`` (closed) or ``results/serve_poisson.json`` (open), with
device, commit, date and the machine's load average, and the plots
``results/<name>_{throughput_latency,cdf,vs_load}.png`` (+ ``serve_sweep_knobs.png``), and stops
every server it started. On an idle 2-core machine each mode takes about ten minutes; on a
shared one it takes longer (the JSON's ``wall_s`` and ``load_average`` say how it went).

    python -m benchmarks.serve_sweep [-n 1000] [--concurrency 1 2 4 8 16 32 64] [--no-knobs]
    python -m benchmarks.serve_sweep --mode open --rates 10 20 30 40 [-n 1000]
    python -m benchmarks.serve_sweep --only-knobs [--knobs-n 256]
    python -m benchmarks.serve_sweep --reanalyse
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from benchmarks._common import RESULTS, provenance, write_results
from infer_lab.measure import stats
from infer_lab.measure.bench import _point as bench_point
from infer_lab.measure.bench import build_workload, jsonable, parse_bench_args, run_bench
from infer_lab.measure.loadgen import RequestResult
from infer_lab.measure.stats import itls, tpot, ttft

# One SLO for the goodput column of the table; the per-request lists allow any other later.
DEFAULT_SLO = "ttft=250ms,tpot=25ms"
# What else ran while we measured: the numbers describe their machine, not an idle one.
SHARED_MACHINE_NOTE = (
    "Measured on a 2-core virtual machine shared with other engineers' builds and tests, client "
    "and server on the same cores: absolute figures carry that noise (see load_average); compare "
    "ratios and intervals, and re-measure on your own machine before relying on a figure.")
# Scheduler settings compared at one load: name -> extra ``infer-lab serve`` arguments.
KNOBS: dict[str, list[str]] = {
    "default (budget 2048, 64 seqs)": [],
    "budget 256 (chunked prefill)": ["--max-num-batched-tokens", "256"],
    "max 2 running seqs": ["--max-num-seqs", "2"],
}


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so ``served``'s cleanup stops the server we started."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def free_port() -> int:
    """A loopback port nobody listens on now (the OS picks it, so parallel runs do not clash)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def child_process(cmd: Sequence[str], ready_url: str, what: str,
                  timeout: float = 180.0) -> Iterator[subprocess.Popen]:
    """Run ``cmd`` for the block, once ``ready_url`` answers 200; stop it afterwards.

    Its output goes to a file, not a pipe: a pipe nobody reads fills up and stalls the child.
    """
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read()[-2000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(ready_url, timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not answer {ready_url} within {timeout:.0f} s")
            time.sleep(0.2)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def served(extra_args: Sequence[str] = (), timeout: float = 180.0) -> Iterator[str]:
    """Run ``infer-lab serve`` as a child process for the block; yield its base URL.

    The server is a separate process, as in production, so the client that measures it does not
    share its interpreter (and its global interpreter lock) with the engine it measures.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "infer_lab.cli", "serve", "--port", str(port), *extra_args]
    base = f"http://127.0.0.1:{port}"
    with child_process(cmd, f"{base}/health", "server", timeout):
        yield base


def compact_requests(result: dict[str, Any]) -> None:
    """Replace each run's raw timestamps by four numbers per request (ms), in place.

    Raw chunk times of a whole sweep run to megabytes; TTFT, TPOT, E2EL and the worst gap per
    request are all that goodput under any SLO needs, and the send time places each request on
    the run's timeline (for time-block intervals and stall events later); they keep the JSON
    small.
    """
    for point in result["points"]:
        per: dict[str, list[float | None]] = {"sent": [], "ttft": [], "tpot": [], "e2el": [],
                                              "max_itl": []}
        offset = 0.0  # repeats laid one after another on one timeline, as the bench lays them
        for run in point["runs"]:
            done = [RequestResult.from_dict(d) for d in run.pop("requests", [])]
            for r in done:
                if not r.success:
                    continue
                gaps = itls(r)
                per["sent"].append(_ms(r.sent + offset))
                per["ttft"].append(_ms(ttft(r)))
                per["tpot"].append(_ms(tpot(r)))
                per["e2el"].append(_ms(r.chunk_times[-1] - r.sent))
                per["max_itl"].append(_ms(max(gaps)) if gaps else None)
            offset += max((r.end for r in done if not math.isnan(r.end)), default=0.0) + 1.0
        point["per_request_ms"] = per


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 2)


def bench(base: str, concurrency: Sequence[float], n: int, input_len: int, output_len: int,
          seed: int, slo: str | None, plot: Path | None = None, mode: str = "closed",
          ) -> dict[str, Any]:
    """One ``infer-lab bench`` sweep against ``base``, as the command line would run it.

    ``concurrency`` holds the loads: concurrencies (closed) or request rates (open, Poisson).
    """
    flag = "--concurrency" if mode == "closed" else "--request-rate"
    argv = ["--base-url", base, flag, *(f"{x:g}" for x in concurrency), "-n", str(n),
            "--input-len", str(input_len), "--output-len", str(output_len),
            "--seed", str(seed), "--save-requests", "--no-progress"]
    if slo:
        argv += ["--slo", slo]
    if plot:
        argv += ["--plot", str(plot)]
    result = run_bench(parse_bench_args(argv))
    result.pop("plots", None)
    compact_requests(result)
    return result


def plot_knobs(knobs: dict[str, Any], path: Path) -> Path:
    """TTFT against ITL, one marker pair (p50, p99) per scheduler setting: the trade in one view."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for (name, cfg), marker in zip(knobs["configs"].items(), "osD^v"):
        m = cfg["result"]["points"][0]["metrics"]
        xs = [m["itl.p50"] * 1e3, m["itl.p99"] * 1e3]
        ys = [m["ttft.p50"] * 1e3, m["ttft.p99"] * 1e3]
        ax.plot(xs, ys, marker + "-", label=f"{name}: p50 → p99")
    ax.set(xscale="log", yscale="log", xlabel="ITL (ms, per chunk)", ylabel="TTFT (ms)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    w = knobs["workload"]
    fig.suptitle(f"Scheduler knobs at C={w['concurrency']}, N={w['num_requests']}, input "
                 f"{w['input_len']} / output {w['output_len']} tokens, seed {w['seed']}",
                 fontsize=9)
    fig.savefig(path, dpi=120)
    return path


def rebuilt_send_times(point: dict[str, Any], meta: dict[str, Any]) -> tuple[np.ndarray, str]:
    """Each request's send time (s) for a point that kept none, and how it was rebuilt."""
    per = point["per_request_ms"]
    if per.get("sent"):
        return np.array(per["sent"], dtype=float) / 1e3, "measured send times"
    if point["mode"] == "closed":
        e2el = np.array(per["e2el"], dtype=float) / 1e3
        return (stats.closed_loop_send_times(e2el, int(point["load"])),
                "rebuilt: closed loop, each request sent when the earliest in-flight one ended "
                "(its E2EL; the stream's last bytes after the last token not counted)")
    args = parse_bench_args(["--request-rate", f"{point['load']:g}", "-n",
                             str(meta["num_requests"]), "--input-len", str(meta["input_len"]),
                             "--output-len", str(meta["output_len"]), "--seed", str(meta["seed"]),
                             "--burstiness", str(meta["burstiness"]),
                             "--range-ratio", str(meta["range_ratio"])])
    index = meta["loads"].index(point["load"])
    specs = build_workload(args, point["load"], salt=index)
    lag = (point.get("send_lag_p99") or 0) * 1e3
    return (np.array([r.arrival for r in specs]),
            f"rebuilt: the seeded Poisson schedule; sends lagged it by up to {lag:.0f} ms (p99)")


def dependence(point: dict[str, Any], sent: np.ndarray, seed: int = 0) -> dict[str, Any]:
    """Time-block intervals and stall events of TTFT, TPOT and E2EL from per-request values."""
    per = point["per_request_ms"]
    ttft_s = np.array(per["ttft"], dtype=float) / 1e3
    e2el_s = np.array(per["e2el"], dtype=float) / 1e3
    tpot_s = np.array([np.nan if x is None else x for x in per["tpot"]], dtype=float) / 1e3
    rows = {"ttft": (ttft_s, sent, ttft_s), "e2el": (e2el_s, sent, e2el_s),
            "tpot": (tpot_s, sent + ttft_s, e2el_s - ttft_s)}
    ci_block, events = {}, {}
    for m, (values, starts, spans) in rows.items():
        keep = ~np.isnan(values)
        block = stats.block_bootstrap_ci(values[keep], sent[keep], seed=seed)
        for q, (lo, hi) in block.items():
            ci_block[f"{m}.{q}"] = [round(lo, 6), round(hi, 6)]
        events[m] = stats.stall_events(values[keep], starts[keep], spans[keep])
    return {"ci_block": ci_block, "stall_events_p99": events,
            "ci_block_method": f"time-block bootstrap over send times, {stats.N_BLOCKS} blocks, "
                               f"{stats.N_BOOT} resamples, seed {seed} (no ITL: the per-gap "
                               "times were not kept)"}


def reanalyse(out: Path) -> None:
    """Add time-block intervals and stall events to committed sweeps that predate them."""
    for name in ("serve_sweep", "serve_poisson"):
        path = out / f"{name}.json"
        if not path.exists():
            continue
        payload = json.loads(path.read_text())
        results = [payload["sweep"]] + [cfg["result"] for cfg in
                                        payload.get("knobs", {}).get("configs", {}).values()]
        for result in results:
            for point in result["points"]:
                if "ci_block" in point and "timeline" not in point:
                    continue  # measured by a bench that computed them from real send times
                sent, how = rebuilt_send_times(point, result["meta"])
                point.update(dependence(point, sent, result["meta"]["seed"]), timeline=how)
        payload["reanalysis"] = {**provenance("cpu"), "what": "ci_block, stall_events_p99 and "
                                 "timeline added to each sweep and knobs point by --reanalyse; "
                                 "the measured numbers are unchanged"}
        print(f"reanalysed {write_results(name, jsonable(payload), out)}")


def pooled_rounds(rounds: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    """One bench result from several rounds at the same load: every request pooled.

    Each round is an independent repeat (its own server warm-up, its own seed); the point's
    metrics are those of all requests together, its intervals come from the pooled requests
    laid round after round on one timeline, and ``spread`` says how far the rounds disagreed.
    """
    first = rounds[0]
    runs, pooled, offsets, offset = [], [], [], 0.0
    for rep, result in enumerate(rounds):
        run = result["points"][0]["runs"][0]
        done = [RequestResult.from_dict(d) for d in run["requests"]]
        runs.append({**run, "repeat": rep})
        pooled += done
        offsets += [offset] * len(done)
        offset += max((r.end for r in done if not math.isnan(r.end)), default=0.0) + 1.0
    duration = sum(run["summary"]["duration"] for run in runs)
    load = first["points"][0]["load"]
    point = bench_point("closed", load, runs, 0, pooled, seed, offsets)
    point["metrics"] = stats.scalars(stats.summarize(pooled, duration))
    meta = {**first["meta"], "num_requests": len(pooled), "repeats": len(rounds),
            "seeds": [r["meta"]["seed"] for r in rounds]}
    result = {"meta": meta, "points": [point]}
    compact_requests(result)
    return result


def measure_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """The scheduler settings of :data:`KNOBS` at one load, in interleaved rounds.

    One server per setting, all started first; then round after round, each setting in turn
    gets ``knobs_n / knobs_rounds`` requests (a fresh seed each round, so no prompt repeats
    into a prefix-cache hit). On a shared machine the load drifts: interleaving spreads the
    drift over every setting alike instead of handing it to whichever ran last.
    """
    per_round = -(-args.knobs_n // args.knobs_rounds)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in KNOBS}
    with contextlib.ExitStack() as stack:
        bases = {name: stack.enter_context(served(extra)) for name, extra in KNOBS.items()}
        for rnd in range(args.knobs_rounds):
            for name in KNOBS:
                print(f"\n== knobs round {rnd + 1}/{args.knobs_rounds}: {name}")
                argv = ["--base-url", bases[name], "--concurrency",
                        str(args.knobs_concurrency), "-n", str(per_round), "--input-len",
                        str(args.knobs_input_len), "--output-len", str(args.knobs_output_len),
                        "--seed", str(args.seed + rnd), "--save-requests", "--no-progress"]
                rounds[name].append(run_bench(parse_bench_args(argv)))
    configs = {name: {"server_args": KNOBS[name], "result": pooled_rounds(rs, args.seed)}
               for name, rs in rounds.items()}
    knobs = {
        "workload": {"concurrency": args.knobs_concurrency,
                     "num_requests": per_round * args.knobs_rounds, "rounds": args.knobs_rounds,
                     "input_len": args.knobs_input_len, "output_len": args.knobs_output_len,
                     "seed": args.seed},
        "configs": configs,
    }
    plot_knobs(knobs, args.out / "serve_sweep_knobs.png")
    print(f"\nknobs at C={args.knobs_concurrency}, N={per_round * args.knobs_rounds} in "
          f"{args.knobs_rounds} rounds, input {args.knobs_input_len} / output "
          f"{args.knobs_output_len}:")
    print(f"{'setting':32} {'out tok/s':>9} {'TTFT p50/p90 ms':>17} {'ITL p50/p99 ms':>16}")
    for name, cfg in configs.items():
        m = cfg["result"]["points"][0]["metrics"]
        print(f"{name:32} {m['output_throughput']:9.1f} "
              f"{m['ttft.p50'] * 1e3:8.0f}/{m['ttft.p90'] * 1e3:<8.0f} "
              f"{m['itl.p50'] * 1e3:7.1f}/{m['itl.p99'] * 1e3:<8.1f}")
    return knobs


def only_knobs(args: argparse.Namespace) -> None:
    """Measure the knobs and put them, with their own provenance, into serve_sweep.json."""
    path = args.out / "serve_sweep.json"
    payload = json.loads(path.read_text()) if path.exists() else {"benchmark": "serve_sweep"}
    start, load_before = time.perf_counter(), os.getloadavg()
    where = provenance("cuda" if torch.cuda.is_available() else "cpu")
    knobs = measure_knobs(args)
    knobs["provenance"] = {**where, "conditions": SHARED_MACHINE_NOTE, "note": args.note,
                           "load_average": {"before": [round(x, 2) for x in load_before],
                                            "after": [round(x, 2) for x in os.getloadavg()]},
                           "wall_s": round(time.perf_counter() - start, 1)}
    payload["knobs"] = knobs
    print(f"\nwrote {write_results('serve_sweep', jsonable(payload), args.out)}")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("closed", "open"), default="closed",
                   help="closed loop over --concurrency, or open loop (Poisson) over --rates")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--rates", type=float, nargs="+", default=[10.0, 20.0, 30.0, 40.0],
                   help="open loop: mean request rates, req/s (default: %(default)s)")
    p.add_argument("-n", "--num-requests", type=int, default=1000,
                   help="measured requests per load point (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo", default=DEFAULT_SLO, help="goodput SLO (default: %(default)s)")
    p.add_argument("--knobs", action=argparse.BooleanOptionalAction, default=True,
                   help="also compare scheduler settings (default: on)")
    p.add_argument("--knobs-concurrency", type=int, default=8)
    p.add_argument("--knobs-n", type=int, default=256,
                   help="requests per knob setting: 256 puts 26 beyond each p90 "
                        "(default: %(default)s)")
    p.add_argument("--knobs-input-len", type=int, default=1024)
    p.add_argument("--knobs-output-len", type=int, default=32)
    p.add_argument("--knobs-rounds", type=int, default=4,
                   help="interleaved rounds the knob requests are split into (default: "
                        "%(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--note", default=None, help="a note stored in the JSON (how it was run)")
    p.add_argument("--only-knobs", action="store_true",
                   help="measure the knobs alone, into the existing serve_sweep.json")
    p.add_argument("--reanalyse", action="store_true",
                   help="add time-block intervals and stall events to the committed sweeps")
    args = p.parse_args(argv)

    exit_on_sigterm()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.reanalyse:
        reanalyse(args.out)
        return
    if args.only_knobs:
        only_knobs(args)
        return
    start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    where = provenance(device)  # at the start: the commit and date the numbers were taken at
    result_name = "serve_sweep" if args.mode == "closed" else "serve_poisson"
    loads = args.concurrency if args.mode == "closed" else args.rates
    load_before = os.getloadavg()
    with served() as base:
        sweep = bench(base, loads, args.num_requests, args.input_len, args.output_len,
                      args.seed, args.slo, args.out / result_name, args.mode)
    beyond = sweep["points"][0]["beyond_p99"]
    payload: dict[str, Any] = {
        "benchmark": result_name, **where,
        "server": "infer-lab serve (bundled tiny-kjv, default settings), loopback, same machine "
                  "as the client",
        "conditions": SHARED_MACHINE_NOTE,
        "note": args.note,
        "load_average": {"before": [round(x, 2) for x in load_before]},
        "p99_rests_on": f"{args.num_requests} requests per point: {beyond['ttft']} requests lie "
                        "beyond each p99 of TTFT/TPOT/E2EL; the ITL p99 pools "
                        f"~{args.num_requests * (args.output_len - 1)} gaps per point",
        "sweep": sweep,
    }
    if args.knobs and args.mode == "closed":
        payload["knobs"] = measure_knobs(args)
    payload["load_average"]["after"] = [round(x, 2) for x in os.getloadavg()]
    payload["wall_s"] = round(time.perf_counter() - start, 1)
    print(f"\nwrote {write_results(result_name, jsonable(payload), args.out)} "
          f"in {payload['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
