"""Cross-check ``infer-lab bench`` against NVIDIA's aiperf on the same server, at the same load.

A second, independent load generator (after ``guidellm_compare.py``): this script starts
``infer-lab serve`` (the bundled model) once and then, in interleaved repeats, runs
``infer-lab bench`` and ``aiperf profile`` at each concurrency (closed loop, the same number of
requests after the same number of warm-ups, the same prompt and output lengths with
``ignore_eos``, offline: the bundled tokenizer, no model hub). Repeat r runs ours first when r is
even and aiperf first when it is odd, so a drift of the shared machine's load falls on both tools
alike. Each repeat has its own seed (fresh prompts: no prefix-cache hits across repeats).

Both tools' per-request records are reduced by the same code here: for each metric the median
of all repeats' requests pooled, a 95% interval for it (percentile bootstrap over time blocks of
the pooled timeline, as ``infer-lab bench``'s ``ci_block``; over requests too, ``ci``), and each
repeat's median. The tools *agree* on a metric at a load when the medians are within 10% and
the two intervals overlap.

What aiperf's names mean, against ours (aiperf 0.13, ``aiperf/metrics/types/``):

- **TTFT**: the same (request start to the first chunk that carries content).
- aiperf's **"ITL"** (``inter_token_latency``) is (request latency - TTFT) / (OSL - 1) per
  request: what we (and vLLM) call **TPOT**. Its OSL is the client re-tokenizing the output
  text unless ``--use-server-token-count``; this script passes that flag, so OSL is the
  server's ``usage.completion_tokens`` and the divisor is ours exactly.
- our (and vLLM's) **ITL**, the gap between successive streamed chunks pooled over requests, is
  aiperf's **"ICL"** (``inter_chunk_latency``, one list per request in its JSONL; not shown in
  its console table).
- **E2EL** is aiperf's ``request_latency``: to the last chunk with content, as ours (the
  usage-only chunk and ``[DONE]`` after it are not counted by either tool).
- aiperf's own percentiles: numpy's over per-request values for TTFT, ITL and request latency,
  as ours; over ICL gaps pooled as ours, but from a t-digest sketch (approximate). The medians
  compared here are recomputed from its per-request JSONL with our code; its own are kept in
  the JSON (``own_p50_ms`` of each run) beside them.

aiperf gets the bundled tokenizer as a local folder with ``HF_HUB_OFFLINE`` emptied: in offline
mode aiperf 0.13 looks even a local folder up as a hub snapshot and fails ("Repo id must be in
the form 'repo_name'"); online, it loads a local folder directly and asks the hub nothing.
aiperf's warm-up requests are in its JSONL too (``benchmark_phase: warmup``) and are dropped.
aiperf runs as many processes (controller, dataset manager, timing manager, workers, record
processors); ``--workers-max 1 --record-processors 1`` and no server-metrics scraping keep it
as light as it goes, but on a 2-core machine it still competes with the server it measures:
the JSON keeps its CPU seconds (whole invocation, start-up included) and the server's own
``/metrics`` means while each tool ran (measured: aiperf kept a whole core busy at C = 1, 30 CPU s
in a 32 s run, and the server slowed under it; ``--pin`` gives the server a core of its own).
Not a test: a benchmark on a shared machine.

aiperf pins versions (pandas, rich, pyzmq, pillow) that clash with the dev environment, so it is
best installed in a venv of its own; the script looks for ``aiperf`` next to this interpreter,
then in ``build/aiperf/bin``, then on PATH (or give ``--aiperf``)::

    python -m venv build/aiperf && build/aiperf/bin/pip install 'aiperf==0.13.0'
    python -m benchmarks.aiperf_compare [--concurrency 1 8] [-n 100] [--repeats 3] [--pin]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from benchmarks._common import RESULTS, provenance, write_results
from benchmarks.guidellm_compare import OFFLINE_ENV, server_means_ms, server_totals
from benchmarks.serve_sweep import exit_on_sigterm, served
from infer_lab.measure import stats
from infer_lab.measure.bench import jsonable, parse_bench_args, run_bench
from infer_lab.measure.loadgen import RequestResult
from infer_lab.model.loader import BUNDLED_MODEL_DIR

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("infer_lab", "aiperf")
# (our metric, aiperf's JSONL field, aiperf's name for it)
METRICS = (
    ("ttft", "time_to_first_token", "TTFT"),
    ("itl", "inter_chunk_latency", "ICL"),
    ("tpot", "inter_token_latency", "ITL"),
    ("e2el", "request_latency", "Request Latency"),
)
# aiperf 0.13 in HF offline mode looks a tokenizer up as a hub snapshot, even a local folder,
# and fails; online, a local folder is loaded as it is, with no hub request. It reads any
# non-empty value as "offline", so the variables are emptied for aiperf alone.
AIPERF_ONLINE = {"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": ""}
AGREE_WITHIN = 0.10  # medians within 10% (and the intervals overlap)
MS = 1e-3


@dataclass
class Req:
    """One measured request, as either tool saw it (seconds; ``sent`` on the run's timeline)."""

    sent: float
    ttft: float
    e2el: float
    tpot: float | None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0


def aiperf_command(explicit: str | None = None) -> list[str]:
    """aiperf's console script: ``--aiperf``, next to this interpreter, build/aiperf, or PATH."""
    candidates = [explicit] if explicit else [
        str(Path(sys.executable).with_name("aiperf")), str(ROOT / "build/aiperf/bin/aiperf"),
        shutil.which("aiperf")]
    for c in candidates:
        if c and Path(c).exists():
            return [c]
    raise SystemExit("aiperf not found: python -m venv build/aiperf && "
                     "build/aiperf/bin/pip install 'aiperf==0.13.0' (or pass --aiperf PATH)")


def aiperf_argv(base: str, model: str, concurrency: int, n: int, warmups: int, input_len: int,
                output_len: int, seed: int, artifacts: Path) -> list[str]:
    """``aiperf profile`` at our load: closed loop, fixed lengths, EOS ignored, offline, quiet."""
    return ["profile", "--url", base, "--model", model, "--endpoint-type", "completions",
            "--streaming", "--tokenizer", str(BUNDLED_MODEL_DIR),
            "--concurrency", str(concurrency), "--request-count", str(n),
            "--warmup-request-count", str(warmups),
            "--synthetic-input-tokens-mean", str(input_len), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(output_len), "--output-tokens-stddev", "0",
            "--extra-inputs", '{"ignore_eos": true}', "--use-server-token-count",
            "--random-seed", str(seed), "--artifact-dir", str(artifacts), "--ui-type", "none",
            "--workers-max", "1", "--record-processors", "1", "--no-server-metrics",
            "--no-gpu-telemetry"]


def run_aiperf(cmd: list[str], argv: list[str], artifacts: Path) -> tuple[Path, float, float]:
    """Run aiperf; return the folder its exports landed in, wall seconds and CPU seconds (all
    its processes, start-up included)."""
    env = {**os.environ, **OFFLINE_ENV, **AIPERF_ONLINE}
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run([*cmd, *argv], env=env, capture_output=True, text=True, timeout=900,
                          cwd=artifacts.parent)
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    found = sorted(artifacts.rglob("profile_export.jsonl"))
    if done.returncode != 0 or not found:
        raise RuntimeError(f"aiperf failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return found[0].parent, wall, cpu


def _value_s(metrics: dict[str, Any], tag: str) -> Any:
    """A metric of one aiperf record in seconds (lists element-wise); None if absent."""
    m = metrics.get(tag)
    if m is None:
        return None
    scale = {"ms": 1e-3, "ns": 1e-9, "us": 1e-6, "s": 1.0}[m.get("unit", "ms")]
    v = m["value"]
    return [x * scale for x in v] if isinstance(v, list) else v * scale


def aiperf_requests(lines: Sequence[str]) -> tuple[list[Req], dict[str, int]]:
    """aiperf's per-request JSONL as :class:`Req` (measured phase only, send times from 0).

    Returns the requests and counts of what was left out (warm-ups, errors)."""
    reqs, starts, left = [], [], {"warmup": 0, "errored": 0}
    for line in lines:
        if not line.strip():
            continue
        rec = json.loads(line)
        meta, metrics = rec["metadata"], rec.get("metrics") or {}
        if meta.get("benchmark_phase") != "profiling":
            left["warmup"] += 1
            continue
        ttft, e2el = _value_s(metrics, "time_to_first_token"), _value_s(metrics, "request_latency")
        if rec.get("error") or ttft is None or e2el is None:
            left["errored"] += 1
            continue
        osl = metrics.get("output_sequence_length", {}).get("value")
        isl = metrics.get("input_sequence_length", {}).get("value")
        starts.append(meta["request_start_ns"] * 1e-9)
        reqs.append(Req(sent=0.0, ttft=ttft, e2el=e2el,
                        tpot=_value_s(metrics, "inter_token_latency"),
                        itl=_value_s(metrics, "inter_chunk_latency") or [],
                        output_tokens=int(osl or 0), prompt_tokens=int(isl or 0)))
    t0 = min(starts, default=0.0)
    for r, s in zip(reqs, starts):
        r.sent = s - t0
    return reqs, left


def our_requests(saved: Sequence[dict[str, Any]]) -> list[Req]:
    """``infer-lab bench --save-requests`` records as :class:`Req` (successful ones)."""
    out = []
    for d in saved:
        r = RequestResult.from_dict(d)
        if r.success and r.chunk_times:
            out.append(Req(sent=r.sent, ttft=stats.ttft(r), e2el=stats.e2el(r), tpot=stats.tpot(r),
                           itl=stats.itls(r), output_tokens=r.output_tokens,
                           prompt_tokens=r.prompt_len))
    return out


def _samples(reqs: Sequence[Req], metric: str) -> tuple[list[Any], list[float]]:
    """One metric's samples (ITL: one group of gaps per request) and their requests' send times."""
    if metric == "itl":
        return [r.itl for r in reqs], [r.sent for r in reqs]
    keep = [r for r in reqs if getattr(r, metric) is not None]
    return [getattr(r, metric) for r in keep], [r.sent for r in keep]


def _p50(values: list[Any], metric: str) -> float:
    flat = [x for g in values for x in g] if metric == "itl" else values
    return float(np.median(flat)) if flat else math.nan


def pooled(repeats: Sequence[Sequence[Req]], seed: int = 0) -> dict[str, Any]:
    """Per metric: the median of all repeats' requests, its two 95% intervals, each repeat's
    median (ms). Repeats are laid one after another on one timeline for the block intervals."""
    reqs, offset = [], 0.0
    for rep in repeats:
        reqs += [Req(r.sent + offset, r.ttft, r.e2el, r.tpot, r.itl, r.output_tokens,
                     r.prompt_tokens) for r in rep]
        offset += max((r.sent + r.e2el for r in rep), default=0.0) + 1.0
    out: dict[str, Any] = {
        "num_requests": len(reqs),
        "prompt_tokens_p50": float(np.median([r.prompt_tokens for r in reqs])),
        "output_tokens_p50": float(np.median([r.output_tokens for r in reqs]))}
    for metric, *_ in METRICS:
        values, times = _samples(reqs, metric)
        groups = values if metric == "itl" else np.array(values)
        ci = stats.bootstrap_ci(groups, ps=(50,), seed=seed)["p50"]
        block = stats.block_bootstrap_ci(groups, times, ps=(50,), seed=seed)["p50"]
        out[metric] = {
            "p50_ms": _p50(values, metric) / MS,
            "ci_ms": [x / MS for x in ci], "ci_block_ms": [x / MS for x in block],
            "per_repeat_p50_ms": [_p50(_samples(rep, metric)[0], metric) / MS
                                  for rep in repeats],
            "samples": sum(len(g) for g in values) if metric == "itl" else len(values),
        }
    return out


def verdict(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Per metric: aiperf's median against ours, and whether they agree (within 10%, the block
    intervals overlapping)."""
    out = {}
    for metric, _, their_name in METRICS:
        a, b = ours[metric], theirs[metric]
        diff = (b["p50_ms"] - a["p50_ms"]) / a["p50_ms"]
        overlap = a["ci_block_ms"][0] <= b["ci_block_ms"][1] and \
            b["ci_block_ms"][0] <= a["ci_block_ms"][1]
        out[metric] = {"aiperf_name": their_name, "ours_p50_ms": a["p50_ms"],
                       "aiperf_p50_ms": b["p50_ms"], "diff": diff,
                       "intervals_overlap": bool(overlap),
                       "agree": bool(abs(diff) <= AGREE_WITHIN and overlap)}
    return out


def aiperf_own_p50(summary: dict[str, Any]) -> dict[str, float | None]:
    """aiperf's own medians (ms) from its summary JSON, by our metric names."""
    out = {}
    for metric, tag, _ in METRICS:
        m = summary.get(tag) or {}
        out[metric] = m.get("p50") if m.get("unit", "ms") == "ms" else None
    return out


def headline(payload: dict[str, Any]) -> str:
    """The figures the README quotes, from a results file: per load, both tools' TTFT and ITL
    medians (ms), aiperf's difference, the verdict, and the server's own mean ITL under each."""
    parts = []
    for pt in payload["points"]:
        v, srv = pt["verdict"], [r["server_mean_ms"]["itl"] for r in pt["runs"]["aiperf"]]
        ours_srv = [r["server_mean_ms"]["itl"] for r in pt["runs"]["infer_lab"]]
        cells = ", ".join(f"{m.upper()} {v[m]['ours_p50_ms']:.1f} vs {v[m]['aiperf_p50_ms']:.1f}"
                          f" ms ({v[m]['diff']:+.0%}, {'agree' if v[m]['agree'] else 'differ'})"
                          for m in ("ttft", "itl"))
        parts.append(f"C = {pt['concurrency']}: {cells}; server's mean ITL "
                     f"{np.median(ours_srv):.1f} ms under ours, {np.median(srv):.1f} under aiperf")
    return "; ".join(parts)


def run_ours(base: str, model: str, c: int, n: int, input_len: int, output_len: int,
             seed: int) -> tuple[list[Req], dict[str, Any]]:
    """One ``infer-lab bench`` run at concurrency ``c`` (its default warm-ups, max(C, 4))."""
    argv = ["--base-url", base, "--model", model, "--concurrency", str(c), "-n", str(n),
            "--input-len", str(input_len), "--output-len", str(output_len), "--seed", str(seed),
            "--save-requests", "--no-progress"]
    result = run_bench(parse_bench_args(argv))
    run = result["points"][0]["runs"][0]
    info = {"client_cpu": run["client_cpu"], "duration_s": run["summary"]["duration"],
            "failed": sum(not d["success"] for d in run["requests"])}
    return our_requests(run["requests"]), info


def print_point(c: int, ours: dict[str, Any], theirs: dict[str, Any],
                rows: dict[str, Any]) -> None:
    """The side-by-side medians at one load, with each tool's interval and the verdict."""
    print(f"\nC={c}: infer-lab bench N={ours['num_requests']}, aiperf N={theirs['num_requests']}"
          f" (pooled over repeats)")
    print(f"{'metric (ours / aiperf name)':30}{'ours p50':>10}{'95% block CI':>18}"
          f"{'aiperf p50':>12}{'95% block CI':>18}{'diff':>8}  agree")
    for metric, row in rows.items():
        a, b = ours[metric], theirs[metric]
        ci = lambda x: f"[{x['ci_block_ms'][0]:.2f}, {x['ci_block_ms'][1]:.2f}]"
        print(f"{metric.upper() + ' / ' + row['aiperf_name']:30}{a['p50_ms']:10.2f}{ci(a):>18}"
              f"{b['p50_ms']:12.2f}{ci(b):>18}{row['diff']:+8.1%}  {row['agree']}")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("-n", "--num-requests", type=int, default=100,
                   help="measured requests per tool, load and repeat (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--aiperf", default=None, help="path of the aiperf executable")
    p.add_argument("--pin", action="store_true",
                   help="Linux: the server on CPU 0, this script and aiperf on CPU 1, so that "
                        "neither client can take the server's core")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--name", default="aiperf_compare", help="results file name, no .json")
    args = p.parse_args(argv)

    exit_on_sigterm()
    cmd = aiperf_command(args.aiperf)
    version = subprocess.run([*cmd, "--version"], capture_output=True, text=True,
                             env={**os.environ, **OFFLINE_ENV}).stdout.strip().split()[-1]
    where = provenance("cuda" if torch.cuda.is_available() else "cpu")
    load_before, start = os.getloadavg(), time.perf_counter()
    reqs = {(t, c): [] for t in TOOLS for c in args.concurrency}
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {k: [] for k in reqs}
    if args.pin:
        os.sched_setaffinity(0, {0})  # the server inherits it
    with served() as base, tempfile.TemporaryDirectory() as tmp:
        if args.pin:
            os.sched_setaffinity(0, {1})  # this process, and aiperf's processes after it
        model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        for rep in range(args.repeats):
            seed = args.seed + rep
            for c in args.concurrency:
                order = TOOLS if rep % 2 == 0 else TOOLS[::-1]
                for tool in order:
                    print(f"\n== repeat {rep + 1}/{args.repeats}, C={c}: {tool}", flush=True)
                    t0 = server_totals(base)
                    load = os.getloadavg()[0]
                    if tool == "infer_lab":
                        got, info = run_ours(base, model, c, args.num_requests, args.input_len,
                                             args.output_len, seed)
                    else:
                        art = Path(tmp) / f"aiperf_c{c}_r{rep}"
                        art, wall, cpu = run_aiperf(
                            cmd, aiperf_argv(base, model, c, args.num_requests, max(c, 4),
                                             args.input_len, args.output_len, seed, art), art)
                        got, left = aiperf_requests(
                            (art / "profile_export.jsonl").read_text().splitlines())
                        summary = json.loads((art / "profile_export_aiperf.json").read_text())
                        info = {"left_out": left, "own_p50_ms": aiperf_own_p50(summary),
                                "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}
                    info |= {"repeat": rep, "seed": seed, "load_average_1m": round(load, 2),
                             "server_mean_ms": server_means_ms(t0, server_totals(base))}
                    reqs[tool, c].append(got)
                    runs[tool, c].append(info)
                    print(f"   {len(got)} requests; p50 " + ", ".join(
                        f"{m.upper()} {_p50(_samples(got, m)[0], m) / MS:.2f} ms"
                        for m, *_ in METRICS), flush=True)
    points = []
    for c in args.concurrency:
        ours, theirs = pooled(reqs["infer_lab", c]), pooled(reqs["aiperf", c])
        rows = verdict(ours, theirs)
        print_point(c, ours, theirs, rows)
        points.append({"concurrency": c, "verdict": rows, "infer_lab": ours, "aiperf": theirs,
                       "runs": {t: runs[t, c] for t in TOOLS}})
    payload = {
        "benchmark": "aiperf_compare", **where, "aiperf_version": version,
        "aiperf_args": aiperf_argv("URL", "MODEL", 0, args.num_requests, 0, args.input_len,
                                   args.output_len, args.seed, Path("DIR")),
        "load_average": {"before": [round(x, 2) for x in load_before],
                         "after": [round(x, 2) for x in os.getloadavg()]},
        "wall_s": round(time.perf_counter() - start, 1),
        "pinned": "server on CPU 0; infer-lab bench and aiperf on CPU 1" if args.pin else None,
        "workload": {"input_len": args.input_len, "output_len": args.output_len,
                     "num_requests": args.num_requests, "repeats": args.repeats,
                     "seeds": [args.seed + r for r in range(args.repeats)],
                     "warmups": "max(C, 4) per tool and run", "mode": "closed loop",
                     "ignore_eos": True, "order": "interleaved: ours first in even repeats, "
                     "aiperf first in odd ones",
                     "prompts": "infer-lab: random token ids; aiperf: synthetic text of the same "
                                "token count (bundled tokenizer)"},
        "naming": {"TTFT": "the same in both", "ITL": "ours/vLLM: gap between successive "
                   "chunks, pooled; aiperf calls it ICL (inter_chunk_latency)",
                   "TPOT": "ours/vLLM: (E2EL - TTFT)/(output tokens - 1); aiperf calls it ITL "
                   "(inter_token_latency), OSL from the server's usage here",
                   "E2EL": "aiperf's request_latency (to the last content chunk)"},
        "agreement": f"|aiperf p50 - ours| / ours <= {AGREE_WITHIN:.0%} and the 95% time-block "
                     "bootstrap intervals of the pooled medians overlap",
        "points": points,
    }
    print(f"\nREADME figures: {headline(payload)}")
    print(f"\nwrote {write_results(args.name, jsonable(payload), args.out)}")


if __name__ == "__main__":
    main()
