"""Cross-check ``infer-lab bench`` against guidellm on the same server, at the same load.

Two load generators that agree on the definitions should agree on the numbers; where they do
not, the difference is either in what they call a metric or in the client itself. So this script
starts ``infer-lab serve`` once and, at each concurrency, runs ``infer-lab bench`` and then
``guidellm run`` (closed loop at the same concurrency, synthetic prompts of the same token count,
the same output length with ``ignore_eos``, warm-ups left out), offline, then prints TTFT, TPOT
and E2EL percentiles side by side with their difference.

Names differ between the tools, and this is the part that trips people up:

- our (and vLLM's) **TPOT** = (E2EL - TTFT) / (output tokens - 1), per request. guidellm calls
  exactly this **"ITL"** (``inter_token_latency_ms``).
- our (and vLLM's) **ITL** is the gap between successive streamed chunks, pooled over requests;
  guidellm reports no such distribution.
- guidellm's **"TPOT"** (``time_per_output_token_ms``) is E2EL / output tokens, with the first
  token's wait included: larger than our TPOT by about TTFT / output tokens.

guidellm weights its per-request latencies by output tokens and uses its own percentile rule, so
the script also recomputes guidellm's per-request values with ours (numpy linear, one value per
request): that separates "the clients measured different times" from "the statistics differ".
Not a test: the two runs are seconds apart on a shared machine, so a few percent is noise.

    python -m benchmarks.guidellm_compare [--concurrency 1 8] [-n 160]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
import torch

from benchmarks._common import RESULTS, provenance, write_results
from benchmarks.serve_sweep import bench, exit_on_sigterm, served
from infer_lab.measure.bench import jsonable
from infer_lab.model.loader import BUNDLED_MODEL_DIR

QS = ("p50", "p90", "p99")
# (row label, our metric, guidellm's field, guidellm's name for it); None = that tool has none.
ROWS = (
    ("TTFT", "ttft", "time_to_first_token_ms", "TTFT"),
    ("TPOT = (E2EL-TTFT)/(out-1)", "tpot", "inter_token_latency_ms", "ITL"),
    ("E2EL", "e2el", "request_latency", "Request Latency"),
    ("ITL per chunk (pooled)", "itl", None, None),
    ("E2EL / out tokens", None, "time_per_output_token_ms", "TPOT"),
)
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}


SERVER_HISTOGRAMS = {"ttft": "time_to_first_token_seconds", "itl": "inter_token_latency_seconds",
                     "e2el": "e2e_request_latency_seconds"}


def server_totals(base: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the server's own latency histograms, from its Prometheus ``/metrics``."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    out = {}
    for key, name in SERVER_HISTOGRAMS.items():
        vals = {}
        for line in text.splitlines():
            for part in ("sum", "count"):
                if line.startswith(f"infer_lab:{name}_{part}{{"):
                    vals[part] = float(line.rsplit(" ", 1)[1])
        out[key] = (vals["sum"], vals["count"])
    return out


def server_means_ms(before: dict[str, tuple[float, float]],
                    after: dict[str, tuple[float, float]]) -> dict[str, float | None]:
    """The server's mean of each latency between two scrapes, in ms (warm-ups included).

    A diagnostic, not a report: if the server's own ITL rises while a client runs, the client
    slowed the server (on a small machine, by taking its CPU); if not, the client adds its own.
    """
    out: dict[str, float | None] = {}
    for key in SERVER_HISTOGRAMS:
        n = after[key][1] - before[key][1]
        out[key] = round((after[key][0] - before[key][0]) / n * 1e3, 3) if n else None
    return out


def guidellm_command() -> list[str]:
    """guidellm from this interpreter's environment (its console script, or ``-m guidellm``)."""
    exe = Path(sys.executable).with_name("guidellm")
    return [str(exe)] if exe.exists() else [shutil.which("guidellm") or "guidellm"]


def scenario(base: str, model: str, concurrency: int, n: int, warmups: int, input_len: int,
             output_len: int, seed: int, out: Path) -> dict[str, Any]:
    """A guidellm 0.8 scenario: our load, our lengths, our tokenizer, nothing from the network."""
    return {"spec": {
        "backend": {"kind": "openai_http", "target": base, "model": model,
                    "request_format": "/v1/completions", "http2": False},
        "profile": {"kind": "concurrent", "streams": [concurrency],
                    "warmup": {"value": warmups, "mode": "requests"}},
        "constraints": [{"kind": "max_requests", "count": n + warmups}],
        "tokenizer": {"kind": "hf_auto", "model": str(BUNDLED_MODEL_DIR)},
        "data": [{"kind": "synthetic_text", "prompt_tokens": input_len,
                  "output_tokens": output_len}],
        "seed": {"kind": "static", "value": seed},
        "outputs": [{"kind": "json", "path": str(out)}],
    }}


def run_guidellm(spec: dict[str, Any], workdir: Path, workers: int = 1,
                 ) -> tuple[dict[str, Any], float, float]:
    """Run guidellm on a scenario file; return its JSON report, wall seconds and CPU seconds.

    ``workers`` caps guidellm's worker processes: one event loop for all streams, as in
    ``infer-lab bench``, and fewer processes competing with the server on a small machine.
    """
    path = workdir / "scenario.json"
    path.write_text(json.dumps(spec, indent=1))
    env = {**os.environ, **OFFLINE_ENV, "GUIDELLM__MAX_WORKER_PROCESSES": str(workers)}
    cmd = [*guidellm_command(), "run", "-c", str(path), "--disable-console-interactive"]
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=900)
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"guidellm failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    report = json.loads(Path(spec["spec"]["outputs"][0]["path"]).read_text())
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return report, wall, cpu


def guidellm_summary(report: dict[str, Any]) -> dict[str, Any]:
    """guidellm's own percentiles (ms) and ours recomputed from its per-request records.

    The report lists warm-up requests too; those that started before the measured window
    opened are left out, as guidellm's own TTFT statistics leave them out.
    """
    bench_ = report["benchmarks"][0]
    m = bench_["metrics"]
    ok = [r for r in bench_["requests"]["successful"]
          if r["request_start_time"] >= bench_["start_time"]]
    own: dict[str, dict[str, float]] = {}
    recomputed: dict[str, dict[str, float]] = {}
    for _, _, field, _ in ROWS:
        if field is None:
            continue
        scale = 1e3 if field == "request_latency" else 1.0  # seconds in guidellm's JSON
        dist = m[field]["successful"]
        own[field] = {q: dist["percentiles"][q] * scale for q in QS}
        values = [r[field] * scale for r in ok if r.get(field) is not None]
        recomputed[field] = {f"p{p}": float(np.percentile(values, p)) for p in (50, 90, 99)}
    duration = bench_["duration"]
    out_tokens = sum(r["output_tokens"] or 0 for r in ok)
    return {
        "num_requests": len(ok), "ttft_samples": m["time_to_first_token_ms"]["successful"]["count"],
        "errored": m["request_totals"]["errored"], "warmup_s": bench_["warmup_duration"],
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "prompt_tokens_p50": float(np.median([r["prompt_tokens"] for r in ok])),
        "output_tokens_p50": float(np.median([r["output_tokens"] for r in ok])),
        "percentiles_ms": own, "percentiles_ms_recomputed": recomputed,
    }


def side_by_side(ours: dict[str, Any], theirs: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per metric: both tools' p50/p90/p99 (ms) and guidellm's difference from ours."""
    rows = []
    m = ours["points"][0]["metrics"]
    for label, key, field, their_name in ROWS:
        row: dict[str, Any] = {"metric": label, "infer_lab_name": key.upper() if key else None,
                               "guidellm_name": their_name}
        for q in QS:
            a = m.get(f"{key}.{q}") * 1e3 if key and m.get(f"{key}.{q}") is not None else None
            b = theirs["percentiles_ms"][field][q] if field else None
            row[f"ours_{q}"] = a
            row[f"guidellm_{q}"] = b
            row[f"guidellm_recomputed_{q}"] = (theirs["percentiles_ms_recomputed"][field][q]
                                               if field else None)
            row[f"diff_{q}"] = (b - a) / a if a and b is not None else None
        rows.append(row)
    return rows


def print_rows(concurrency: int, n: int, theirs: dict[str, Any], ours: dict[str, Any],
               rows: list[dict[str, Any]]) -> None:
    """The side-by-side table for one load, with what each number is called in each tool."""
    m = ours["points"][0]["metrics"]
    print(f"\nC={concurrency}: infer-lab bench N={n} ({m['output_throughput']:.0f} out tok/s), "
          f"guidellm N={theirs['num_requests']} ({theirs['output_throughput']:.0f} out tok/s)")
    print(f"{'metric (ours / guidellm name)':40}" + "".join(
        f"{q + ' ours':>10}{q + ' gllm':>10}{'diff':>7}" for q in QS))
    for r in rows:
        name = f"{r['metric']} ({r['infer_lab_name'] or '-'} / {r['guidellm_name'] or '-'})"
        cells = ""
        for q in QS:
            a, b, d = r[f"ours_{q}"], r[f"guidellm_{q}"], r[f"diff_{q}"]
            cells += (f"{'-' if a is None else f'{a:.1f}':>10}"
                      f"{'-' if b is None else f'{b:.1f}':>10}"
                      f"{'' if d is None else f'{d:+.0%}':>7}")
        print(f"{name:40}{cells}")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("-n", "--num-requests", type=int, default=160)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--guidellm-workers", type=int, default=1,
                   help="GUIDELLM__MAX_WORKER_PROCESSES (default: %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)

    exit_on_sigterm()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    where = provenance(device)  # at the start: the commit and date the numbers were taken at
    version = subprocess.run([*guidellm_command(), "--version"], capture_output=True,
                             text=True).stdout.split()[-1]  # "guidellm version: X"
    points = []
    with served() as base, tempfile.TemporaryDirectory() as tmp:
        for c in args.concurrency:
            warm = max(c, 4)  # as infer-lab bench's default
            t0 = server_totals(base)
            ours = bench(base, [c], args.num_requests, args.input_len, args.output_len,
                         args.seed, None)
            t1 = server_totals(base)
            ours["points"][0].pop("per_request_ms", None)
            spec = scenario(base, ours["meta"]["model"], c, args.num_requests, warm,
                            args.input_len, args.output_len, args.seed,
                            Path(tmp) / f"guidellm_c{c}.json")
            report, wall, cpu = run_guidellm(spec, Path(tmp), args.guidellm_workers)
            t2 = server_totals(base)
            seen_by_server = {"infer_lab": server_means_ms(t0, t1),
                              "guidellm": server_means_ms(t1, t2)}
            # whole process, start-up (imports, tokenizer) included: an upper bound on its load
            theirs = guidellm_summary(report) | {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}
            rows = side_by_side(ours, theirs)
            print_rows(c, args.num_requests, theirs, ours, rows)
            print("the server's own mean latencies while each tool ran (warm-ups included): "
                  + "; ".join(f"{tool}: " + ", ".join(f"{k.upper()} {v:.1f} ms" for k, v in
                                                      means.items() if v is not None)
                              for tool, means in seen_by_server.items()))
            points.append({"concurrency": c, "rows": rows, "guidellm": theirs,
                           "server_mean_ms": seen_by_server,
                           "guidellm_scenario": spec["spec"],
                           "infer_lab": {"meta": ours["meta"],
                                         "metrics": ours["points"][0]["metrics"],
                                         "client_cpu": ours["points"][0]["client_cpu_max"]}})
    payload = {
        "benchmark": "guidellm_compare", **where, "guidellm_version": version,
        "guidellm_workers": args.guidellm_workers,
        "workload": {"input_len": args.input_len, "output_len": args.output_len,
                     "num_requests": args.num_requests, "seed": args.seed,
                     "mode": "closed loop", "ignore_eos": True,
                     "prompts": "infer-lab: random token ids; guidellm: synthetic text of the "
                                "same token count (bundled tokenizer)"},
        "naming": {
            "TPOT": "ours/vLLM: (E2EL - TTFT)/(output tokens - 1) per request; guidellm calls "
                    "it ITL (inter_token_latency_ms)",
            "ITL": "ours/vLLM: gap between successive streamed chunks, pooled; guidellm has none",
            "guidellm TPOT": "time_per_output_token_ms = E2EL / output tokens, first token "
                             "included",
            "percentiles": "guidellm: its own rule over token-weighted samples; "
                           "'recomputed': numpy linear over guidellm's per-request values",
        },
        "diff": "(guidellm - ours) / ours",
        "points": points,
    }
    print(f"\nwrote {write_results('guidellm_compare', jsonable(payload), args.out)}")


if __name__ == "__main__":
    main()
