"""``infer-lab bench``: TTFT, TPOT, ITL and E2EL at the tail, at a stated load, over HTTP.

Closed loop sweeps concurrency (``--concurrency 1 2 4 ... 128``); open loop sweeps the request
rate (``--request-rate 1 2 4``, Poisson or, with ``--burstiness``, gamma arrivals). Every table
and plot states the load, N, the lengths and the seed, because a latency quoted without the load
it was measured at means nothing. Definitions: :mod:`infer_lab.measure.stats` (vLLM's).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from infer_lab.measure import stats
from infer_lab.measure.loadgen import (
    ClientPool,
    Endpoint,
    RequestResult,
    RunResult,
    fetch_model,
    make_prompt,
    run_closed_loop,
    run_open_loop,
    run_sync,
)
from infer_lab.measure.report import describe, jsonable, load_label
from infer_lab.measure.workloads import LONG_TAIL, RequestSpec, arrival_times, long_tail_mix

__all__ = ["add_bench_parser", "build_workload", "describe", "format_table", "jsonable",
           "load_label", "parse_bench_args", "run_bench"]

DEFAULT_N = {"random": stats.MIN_REQUESTS_FOR_P99, "long-tail": 128,
             "file": stats.MIN_REQUESTS_FOR_P99}
CDF_LEVELS = np.linspace(0.0, 1.0, 201)  # quantiles saved per metric, enough to draw a CDF


def _loads(text: str) -> list[float]:
    """``"8"`` -> [8]; ``"1:128"`` -> powers of two 1, 2, 4, ..., 128; ``"inf"`` -> [inf]."""
    if ":" in text:
        lo, hi = (float(x) for x in text.split(":"))
        if not 0 < lo <= hi or math.isinf(hi):
            raise argparse.ArgumentTypeError(f"bad range {text!r}: want LO:HI, 0 < LO <= HI")
        return [lo * 2**k for k in range(int(math.log2(hi / lo) + 1e-9) + 1)]
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return [v]


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on the ``infer-lab`` sub-command parser and return its parser."""
    p = subparsers.add_parser(
        "bench", help="measure TTFT/TPOT/ITL/E2EL of an OpenAI-compatible server at a load",
        description="Measure TTFT, TPOT, ITL and E2EL (vLLM's definitions) of an "
        "OpenAI-compatible server at a stated load: closed loop at concurrency C, or open loop "
        "at a request rate. Prints a table that states the load, N, lengths and seed.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root (with or without /v1) (default: %(default)s)")
    p.add_argument("--model", default=None,
                   help="model name to send (default: the first that GET /v1/models lists)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions (prompt as token ids) or /v1/chat/completions (text)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", nargs="+", type=_loads, metavar="C",
                      help="closed loop: requests kept in flight; several values sweep, "
                           "LO:HI sweeps powers of two (default: 1)")
    load.add_argument("--request-rate", nargs="+", type=_loads, metavar="R",
                      help="open loop: mean arrivals per second (inf: all at t=0); "
                           "several values or LO:HI sweep")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="open loop: gamma shape of the gaps; 1 = Poisson, <1 = burstier "
                        "(default: %(default)s)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="open loop: cap on requests in flight (default: none)")
    p.add_argument("--num-requests", "-n", type=int, default=None,
                   help=f"measured requests per run (default: {DEFAULT_N['random']} for random, "
                        f"so ~10 requests lie above each p99; 128 for long-tail)")
    p.add_argument("--num-warmups", type=int, default=None,
                   help="requests sent before each load point and left out of every statistic "
                        "(default: closed loop max(C, 4), so every connection is open and the "
                        "server has seen the batch; open loop 4)")
    p.add_argument("--dataset", choices=("random", "long-tail", "file"), default="random",
                   help="random: --input-len/--output-len (± --range-ratio); long-tail: "
                        f"the {LONG_TAIL}; file: the prompts of --dataset-path")
    p.add_argument("--dataset-path", default=None, metavar="JSONL",
                   help="file dataset: one JSON object per line, {\"prompt\": text or token "
                        "ids, \"output_len\": N (optional, else --output-len)}, sent in order "
                        "and cycled; each load point and repeat starts further along")
    p.add_argument("--input-len", type=int, default=128,
                   help="prompt tokens (random dataset; default: %(default)s)")
    p.add_argument("--output-len", type=int, default=128,
                   help="output tokens, forced with ignore_eos (random dataset; "
                        "default: %(default)s)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="random dataset: lengths uniform in [L·(1-r), L·(1+r)]; 0 = fixed "
                        "(default: %(default)s)")
    p.add_argument("--prompt-kind", choices=("ids", "text"), default=None,
                   help="prompt as random token ids (exact length) or words (≈ tokens); "
                        "default ids for completions, text for chat")
    p.add_argument("--token-id-range", nargs=2, type=int, default=(10, 3000),
                   metavar=("LO", "HI"), help="random prompt ids come from [LO, HI), which "
                   "must be valid ids in the model's vocabulary (default: 10 3000)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly the output length (vLLM's ignore_eos; default: on)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds lengths, arrivals and prompts (default: %(default)s)")
    p.add_argument("--slo", default=None,
                   help="goodput bounds, e.g. ttft=500ms,tpot=50ms (also itl, e2el; s/ms/us)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds before a request counts as failed (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per load point; more than one reports the spread "
                        "(default: %(default)s)")
    p.add_argument("--out", default=None, help="write all results as JSON to this file")
    p.add_argument("--save-requests", action="store_true",
                   help="also store every request's timestamps in the JSON (large)")
    p.add_argument("--plot", default=None, metavar="PREFIX",
                   help="save PREFIX_throughput_latency.png, PREFIX_cdf.png, PREFIX_vs_load.png")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.set_defaults(func=bench_command)
    return p


def _check(args: argparse.Namespace) -> None:
    """Refuse arguments that would make a run meaningless, with a message that says why."""
    checks = [
        (args.num_requests is None or args.num_requests >= 1, "--num-requests must be >= 1"),
        (args.num_warmups is None or args.num_warmups >= 0, "--num-warmups must be >= 0"),
        (args.input_len >= 1 and args.output_len >= 1, "--input-len/--output-len must be >= 1"),
        (0 <= args.range_ratio < 1, "--range-ratio must be in [0, 1)"),
        (args.burstiness > 0, "--burstiness must be positive"),
        (args.repeats >= 1, "--repeats must be >= 1"),
        (args.timeout > 0, "--timeout must be positive"),
        (args.max_concurrency is None or args.max_concurrency >= 1,
         "--max-concurrency must be >= 1"),
        (0 <= args.token_id_range[0] < args.token_id_range[1], "--token-id-range needs LO < HI"),
        (args.dataset != "file" or bool(args.dataset_path),
         "--dataset file needs --dataset-path"),
        (not args.concurrency or all(not math.isinf(c) and c == int(c)
                                     for c in _flat(args.concurrency)),
         "--concurrency must be whole numbers"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def read_prompt_file(path: str) -> list[tuple[list[int] | str, int, int | None]]:
    """(prompt, its length, output_len or None) per line of a JSONL prompt file.

    A text prompt's length is its word count (what the statistics use to weigh it; the server
    counts tokens itself). Errors name the line, so a bad file fails before any request is sent.
    """
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not JSON ({e.msg})") from None
            prompt = row.get("prompt") if isinstance(row, dict) else None
            ids = isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
            if not (isinstance(prompt, str) and prompt) and not ids:
                raise ValueError(f"{path}:{number}: 'prompt' must be non-empty text or a list "
                                 "of token ids")
            out = row.get("output_len")
            if out is not None and (not isinstance(out, int) or isinstance(out, bool)
                                    or out < 1):
                raise ValueError(f"{path}:{number}: 'output_len' must be an integer >= 1")
            length = len(prompt) if ids else len(prompt.split())
            rows.append((prompt, length, out))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def _flat(groups: Sequence[Sequence[float]] | None) -> list[float]:
    return [x for g in groups or [] for x in g]


def build_workload(args: argparse.Namespace, rate: float | None, salt: int = 0,
                   n: int | None = None) -> list[RequestSpec]:
    """The seeded requests of one run: lengths and arrivals depend only on the seed (and rate).

    ``salt`` changes only the prompt contents, so repeats and load points send the same shapes
    but never the same prompt twice (a server's prefix cache must not turn repeats into hits).
    """
    n = n or args.num_requests or DEFAULT_N[args.dataset]
    open_rate = rate if rate is not None and not math.isinf(rate) else None
    if args.dataset == "file":
        rng = np.random.default_rng(args.seed)
        arrivals = (arrival_times(n, open_rate, args.burstiness, rng) if open_rate
                    else np.zeros(n))
        rows = read_prompt_file(args.dataset_path)
        picked = [rows[(salt * n + i) % len(rows)] for i in range(n)]
        return [RequestSpec(length, out or args.output_len, float(t), prompt)
                for (prompt, length, out), t in zip(picked, arrivals)]
    if args.dataset == "long-tail":
        mix = long_tail_mix(n, seed=args.seed, rate=open_rate, burstiness=args.burstiness)
        shapes = [(r.prompt_len, r.output_len, r.arrival) for r in mix]
    else:
        rng = np.random.default_rng(args.seed)
        lengths = []
        for length in (args.input_len, args.output_len):
            lo = max(1, int(length * (1 - args.range_ratio)))
            hi = max(lo, int(length * (1 + args.range_ratio)))
            lengths.append(rng.integers(lo, hi + 1, n))
        arrivals = (arrival_times(n, open_rate, args.burstiness, rng) if open_rate
                    else np.zeros(n))
        shapes = [(int(p), int(o), float(t)) for p, o, t in zip(*lengths, arrivals)]
    kind = args.prompt_kind or ("ids" if args.endpoint == "completions" else "text")
    prompt_rng = np.random.default_rng([args.seed, 1 + salt])
    ids = tuple(args.token_id_range)
    return [RequestSpec(p, o, t, make_prompt(prompt_rng, p, kind, ids)) for p, o, t in shapes]


def _git_commit() -> str | None:
    """The commit of the tool that took the numbers, if this is a git checkout."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5, cwd=Path(__file__).parent)
        return done.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _cdf(values: Sequence[float]) -> list[float] | None:
    """Quantiles at :data:`CDF_LEVELS`: a latency CDF in 201 numbers, whatever N is."""
    if len(values) == 0:
        return None
    return [round(float(x), 6) for x in np.quantile(values, CDF_LEVELS)]


def _metric_samples(ok: Sequence[RequestResult], offsets: Sequence[float]) -> dict[str, Any]:
    """Per metric: the samples (groups for ITL), one time per request, and each sample's slow
    period (start, duration) on the run's timeline, for intervals and stall events."""
    rows: dict[str, Any] = {m: {"values": [], "times": [], "starts": [], "spans": []}
                            for m in stats.METRICS}
    for r, off in zip(ok, offsets):
        sent = r.sent + off
        first, last, per = stats.ttft(r), stats.e2el(r), stats.tpot(r)
        gaps = stats.itls(r)
        for m, v, start, span in (("ttft", first, sent, first), ("e2el", last, sent, last),
                                  ("tpot", per, sent + (first or 0), (last or 0) - (first or 0))):
            if v is not None:
                rows[m]["values"].append(v)
                rows[m]["times"].append(sent)
                rows[m]["starts"].append(start)
                rows[m]["spans"].append(span)
        rows["itl"]["values"].append(gaps)
        rows["itl"]["times"].append(sent)
        rows["itl"]["starts"].extend(t + off for t in r.chunk_times[:-1])
        rows["itl"]["spans"].extend(gaps)
    return rows


def intervals(pooled: Sequence[RequestResult], seed: int = 0, n_boot: int = stats.N_BOOT,
              offsets: Sequence[float] | None = None) -> dict[str, Any]:
    """For each metric: samples, how many lie beyond its p99, from how many distinct stall
    events, and two bootstrap intervals per percentile.

    ``ci`` resamples requests (all of a request's ITL gaps go together) and assumes requests
    are independent; ``ci_block`` resamples stretches of the timeline (send times), so that the
    requests one stall slowed stay together: the interval to judge a tail by. ``offsets`` (one
    per request, seconds) place repeats one after another on one timeline. Seeded.
    """
    ok = [r for r in pooled if r.success]
    offs = [o for r, o in zip(pooled, offsets or [0.0] * len(pooled)) if r.success]
    rows = _metric_samples(ok, offs)
    ci, ci_block, samples, above, events = {}, {}, {}, {}, {}
    for m, row in rows.items():
        groups = row["values"] if m == "itl" else np.array(row["values"])
        flat = [x for g in groups for x in g] if m == "itl" else list(groups)
        samples[m] = len(flat)
        above[m] = stats.beyond(len(flat), 99)
        events[m] = stats.stall_events(flat, row["starts"], row["spans"]) if flat else 0
        for q, (lo, hi) in stats.bootstrap_ci(groups, seed=seed, n_boot=n_boot).items():
            ci[f"{m}.{q}"] = [_round(lo), _round(hi)]
        block = (stats.block_bootstrap_ci(groups, row["times"], seed=seed, n_boot=n_boot)
                 if row["times"] else {})
        for q, (lo, hi) in block.items():
            ci_block[f"{m}.{q}"] = [_round(lo), _round(hi)]
    return {"ci": ci, "ci_level": stats.CI_LEVEL, "ci_method": f"percentile bootstrap over "
            f"requests, {n_boot} resamples, seed {seed}", "ci_block": ci_block,
            "ci_block_method": f"time-block bootstrap over send times, {stats.N_BLOCKS} blocks, "
            f"{n_boot} resamples, seed {seed}", "samples": samples, "beyond_p99": above,
            "stall_events_p99": events}


def _round(x: float) -> float:
    return x if math.isnan(x) else round(x, 6)


def _point(mode: str, load: float, runs: list[dict[str, Any]], warmup_failed: int,
           pooled: list[RequestResult], seed: int = 0,
           offsets: Sequence[float] | None = None) -> dict[str, Any]:
    """One load point: its runs, the median over repeats, their spread, CIs and pooled CDFs."""
    ok = [r for r in pooled if r.success]
    samples = {
        "ttft": [x for r in ok if (x := stats.ttft(r)) is not None],
        "tpot": [x for r in ok if (x := stats.tpot(r)) is not None],
        "itl": [g for r in ok for g in stats.itls(r)],
        "e2el": [x for r in ok if (x := stats.e2el(r)) is not None],
    }
    summaries = [run["summary"] for run in runs]
    lags = [r.sent - r.scheduled for r in pooled if not math.isnan(r.sent)]
    return {
        "mode": mode, "load": load,
        "concurrency": load if mode == "closed" else None,
        "request_rate": load if mode == "open" else None,
        "warmup_failed": warmup_failed,
        # over runs of at least a second: a shorter one is mostly start-up, not load
        "client_cpu_max": max((r["client_cpu"] for r in runs if not math.isnan(r["client_cpu"])
                               and r["summary"]["duration"] >= 1.0), default=None),
        "metrics": {k: v["median"] for k, v in stats.spread(summaries).items()},
        "spread": stats.spread(summaries) if len(runs) > 1 else None,
        **intervals(pooled, seed, offsets=offsets),
        "send_lag_p99": round(float(np.percentile(lags, 99)), 6) if lags and mode == "open"
        else None,
        "cdf": {"levels": [round(float(q), 4) for q in CDF_LEVELS]}
        | {m: _cdf(v) for m, v in samples.items()},
        "runs": runs,
    }


async def _run_point(args: argparse.Namespace, endpoint: Endpoint, mode: str, load: float,
                     index: int, tick: Callable[[RequestResult], None],
                     ) -> tuple[RunResult | None, list[RunResult]]:
    """Warm-up, then each repeat, at one load, on one pool of connections.

    One event loop and one pool for the whole point, so the measured requests find the
    connections that the warm-up opened (TCP set-up is not the server's latency).
    """
    n_warm = args.num_warmups
    if n_warm is None:
        n_warm = max(int(load), 4) if mode == "closed" else 4
    warm = build_workload(args, None, salt=10_000 + index, n=n_warm)[:n_warm] if n_warm else []
    runs = []
    async with ClientPool(endpoint) as pool:
        warm_c = int(load) if mode == "closed" else (args.max_concurrency or len(warm))
        warm_run = await run_closed_loop(endpoint, warm, max(1, warm_c), tick, pool) \
            if warm else None
        for rep in range(args.repeats):
            specs = build_workload(args, load if mode == "open" else None,
                                   salt=index * args.repeats + rep)
            if mode == "closed":
                runs.append(await run_closed_loop(endpoint, specs, int(load), tick, pool))
            else:
                runs.append(await run_open_loop(endpoint, specs, load, args.max_concurrency,
                                                tick, pool))
    return warm_run, runs


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run every load point (× repeats), print the table, write JSON and plots; return it all."""
    _check(args)
    slo = stats.parse_slo(args.slo)
    mode = "open" if args.request_rate else "closed"
    loads = _flat(args.request_rate) if mode == "open" else _flat(args.concurrency) or [1.0]
    endpoint = Endpoint(args.base_url, "default", args.endpoint, args.timeout, args.ignore_eos,
                        args.api_key)
    model = args.model or run_sync(fetch_model(endpoint))
    endpoint.model = model or "default"
    n = args.num_requests or DEFAULT_N[args.dataset]
    meta = {
        "tool": "infer-lab bench", "date": dt.datetime.now(dt.timezone.utc).isoformat(
            timespec="seconds"), "commit": _git_commit(), "python": platform.python_version(),
        "client_host": platform.node(), "url": endpoint.url, "model": endpoint.model,
        "model_from": "--model" if args.model else ("/v1/models" if model else "fallback"),
        "endpoint": args.endpoint, "mode": mode, "loads": loads, "num_requests": n,
        "num_warmups": args.num_warmups, "dataset": args.dataset,
        "dataset_path": args.dataset_path, "input_len": args.input_len,
        "output_len": args.output_len, "range_ratio": args.range_ratio,
        "prompt_kind": args.prompt_kind or ("ids" if args.endpoint == "completions" else "text"),
        "ignore_eos": args.ignore_eos, "seed": args.seed, "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency, "slo": slo, "timeout": args.timeout,
        "repeats": args.repeats, "percentiles": "numpy linear, successful requests only",
        "definitions": "vLLM bench serve: TTFT, TPOT (guidellm calls it ITL), ITL per chunk, "
                       "E2EL to the last token chunk",
    }
    warmups = [args.num_warmups if args.num_warmups is not None
               else (max(int(x), 4) if mode == "closed" else 4) for x in loads]
    total = sum(warmups) + len(loads) * args.repeats * n
    bar = _progress(total, args.no_progress)
    points = []
    try:
        for i, load in enumerate(loads):
            bar.set_description(f"{'C' if mode == 'closed' else 'rate'}={load:g}")
            warm_run, measured = run_sync(_run_point(args, endpoint, mode, load, i,
                                                     lambda _r: bar.update(1)))
            runs, pooled, offsets, offset = [], [], [], 0.0
            for rep, run in enumerate(measured):
                summary = stats.summarize(run.results, run.duration, slo)
                record: dict[str, Any] = {"repeat": rep, "summary": summary.to_dict(),
                                          "client_cpu": round(run.client_cpu, 3)}
                if args.save_requests:
                    record["requests"] = [r.to_dict() for r in run.results]
                runs.append(record)
                pooled.extend(run.results)
                offsets.extend([offset] * len(run.results))  # repeats one after another
                offset += max((r.end for r in run.results if not math.isnan(r.end)),
                              default=0.0) + 1.0
            warmup_failed = sum(not r.success for r in warm_run.results) if warm_run else 0
            points.append(_point(mode, load, runs, warmup_failed, pooled, args.seed, offsets))
    finally:
        bar.close()
    result = {"meta": meta, "points": points}
    print(format_table(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(jsonable(result), indent=1, allow_nan=False) + "\n")
    if args.plot:
        from infer_lab.measure.plots import plot_all

        result["plots"] = [str(p) for p in plot_all(result, args.plot)]
    return result


def _progress(total: int, disable: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="req", disable=disable, file=sys.stderr, leave=False)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def format_table(result: dict[str, Any]) -> str:
    """The printed table: one row per load point, the conditions in the header, failures after."""
    meta, points = result["meta"], result["points"]
    lines = [f"infer-lab bench  {meta['url']}  model {meta['model']}", describe(meta)]
    if meta["slo"]:
        lines.append("SLO (goodput): " + ", ".join(f"{k} <= {v * 1e3:g} ms"
                                                  for k, v in meta["slo"].items()))
    head = (f"{'load':>11} {'ok/sent':>10} {'req/s':>7} {'out tok/s':>9} {'goodput':>7} |"
            + "".join(f" {m.upper() + ' ms p50/p90/p99':>23} |" for m in stats.METRICS))
    lines += [head, "-" * len(head)]
    for pt in points:
        m = pt["metrics"]
        ok = sum(run["summary"]["completed"] for run in pt["runs"])
        sent = sum(run["summary"]["num_requests"] for run in pt["runs"])
        good = f"{m['goodput']:.2f}" if "goodput" in m else "-"
        row = (f"{load_label(pt):>11} {f'{ok}/{sent}':>10} {m.get('request_throughput', 0):>7.2f}"
               f" {m.get('output_throughput', 0):>9.1f} {good:>7} |")
        for name in stats.METRICS:
            trio = "/".join(_ms(m.get(f"{name}.{p}")) for p in ("p50", "p90", "p99"))
            row += f" {trio:>23} |"
        lines.append(row)
    lines += ci_table(points)
    repeats = meta["repeats"]
    if repeats > 1:
        lines.append(f"spread over {repeats} repeats, (max-min)/median:")
        for pt in points:
            parts = [f"{k} {v['rel_range']:.0%}" for k, v in pt["spread"].items()
                     if k in ("output_throughput", "ttft.p50", "ttft.p99", "itl.p99", "tpot.p99")
                     and v["rel_range"] is not None]
            lines.append(f"  {load_label(pt)}: " + ", ".join(parts))
    for pt in points:
        failed = sum(run["summary"]["failed"] for run in pt["runs"])
        if failed:
            errors: dict[str, int] = {}
            for run in pt["runs"]:
                for msg, k in run["summary"]["errors"].items():
                    errors[msg] = errors.get(msg, 0) + k
            top = "; ".join(f"{k}× {msg}" for msg, k in list(errors.items())[:3])
            lines.append(f"FAILED at {load_label(pt)}: {failed} of "
                         f"{sum(r['summary']['num_requests'] for r in pt['runs'])} — {top}")
        if pt["warmup_failed"]:
            lines.append(f"warm-up at {load_label(pt)}: {pt['warmup_failed']} failed")
        mismatch = sum(run["summary"]["output_len_mismatch"] for run in pt["runs"])
        if mismatch:
            lines.append(f"note at {load_label(pt)}: {mismatch} requests returned another number "
                         "of tokens than asked (is ignore_eos honoured?)")
        if pt["client_cpu_max"] is not None and pt["client_cpu_max"] > 0.7:
            lines.append(f"note at {load_label(pt)}: this client used {pt['client_cpu_max']:.0%} "
                         "of a CPU core: near 100% it adds to the latencies it measures")
        if pt["send_lag_p99"] is not None and pt["send_lag_p99"] > 0.01:
            lines.append(f"note at {load_label(pt)}: sends lagged their schedule by "
                         f"{pt['send_lag_p99'] * 1e3:.0f} ms (p99): the client could not keep up")
    lines += tail_warnings(points)
    return "\n".join(lines)


def _ci_cell(pt: dict[str, Any], key: str) -> str:
    """``p99 [lo, hi]`` in ms, from the point's time-block interval (request bootstrap if old)."""
    ci = (pt.get("ci_block") or pt.get("ci") or {}).get(key)
    value = pt["metrics"].get(key)
    if value is None or not ci or ci[0] is None:
        return "-"
    return f"{value * 1e3:.1f} [{ci[0] * 1e3:.1f}, {ci[1] * 1e3:.1f}]"


def ci_table(points: Sequence[dict[str, Any]]) -> list[str]:
    """p99 of each metric with its confidence interval, the samples beyond it, and from how many
    distinct stall events they come."""
    if not points or "ci" not in points[0]:
        return []
    level = points[0]["ci_level"]
    kind = "time-block" if "ci_block" in points[0] else "request"
    head = (f"{'load':>11} |" + "".join(f" {m.upper() + ' p99 ms [CI]':>26} {'>p99':>5} "
                                        f"{'ev':>3} |" for m in stats.METRICS))
    lines = [f"p99 with its {level:.0%} {kind} bootstrap interval; >p99: samples beyond it; "
             "ev: distinct stall events they come from (overlapping slow periods are one)",
             head, "-" * len(head)]
    for pt in points:
        row = f"{load_label(pt):>11} |"
        for m in stats.METRICS:
            ev = (pt.get("stall_events_p99") or {}).get(m)
            row += (f" {_ci_cell(pt, f'{m}.p99'):>26} {pt['beyond_p99'][m]:>5} "
                    f"{'-' if ev is None else ev:>3} |")
        lines.append(row)
    return lines


def tail_warnings(points: Sequence[dict[str, Any]], p: float = 99) -> list[str]:
    """A warning per load point whose p99 rests on fewer than :data:`stats.MIN_BEYOND` samples,
    or on enough samples from fewer than that many distinct stall events."""
    lines = []
    for pt in points:
        beyond = pt.get("beyond_p99") or {}
        thin = {m: n for m, n in beyond.items() if n < stats.MIN_BEYOND}
        if thin:
            parts = ", ".join(f"{m.upper()} {n}" for m, n in thin.items())
            lines.append(f"WARNING at {load_label(pt)}: p{p:g} rests on fewer than "
                         f"{stats.MIN_BEYOND} samples beyond it ({parts}): it is the largest "
                         f"value or two, not a tail; raise -n to >= "
                         f"{stats.MIN_REQUESTS_FOR_P99}")
        few = {m: (beyond[m], e) for m, e in (pt.get("stall_events_p99") or {}).items()
               if m not in thin and m in beyond and e < stats.MIN_BEYOND}
        if few:
            parts = ", ".join(f"{m.upper()} {n} samples from {e}" for m, (n, e) in few.items())
            lines.append(f"WARNING at {load_label(pt)}: p{p:g} rests on fewer than "
                         f"{stats.MIN_BEYOND} distinct stall events ({parts}): the samples "
                         "beyond it were slowed together; judge it by its time-block interval, "
                         "and measure longer or repeat the run for a tail")
    return lines


def bench_command(args: argparse.Namespace) -> int:
    """The ``infer-lab bench`` entry: 0 if any request succeeded, 1 if none did (reported)."""
    result = run_bench(args)
    if not any(run["summary"]["completed"] for pt in result["points"] for run in pt["runs"]):
        print("infer-lab bench: no request succeeded (see the failures above)", file=sys.stderr)
        return 1
    return 0


def parse_bench_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``bench`` options from a list, as a notebook does: ``run_bench(parse_bench_args(
    ["--concurrency", "1", "4"]))``."""
    parser = argparse.ArgumentParser(prog="infer-lab")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry (``python -m infer_lab.measure.bench``) until the CLI registers it."""
    args = parse_bench_args(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"infer-lab bench: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
