"""EAGLE through ``infer-lab serve``: output tokens/s and ITL p50 at concurrency 1, 8 and 32.

Two servers run at once as child processes (SmolLM2-135M-Instruct, fp32, ``--threads`` torch
threads each, prefix caching off so a repeated prompt is not a cache hit): one without
speculation, one with the shipped EAGLE head as a chain of ``--k``. The client is ``infer-lab
bench`` itself, run as a command per point: closed loop at concurrency C, streamed, greedy,
``ignore_eos``, ``--output-len`` tokens, on the 16 held-out free-text prompts of
``benchmarks.eagle_prompts`` (chat-templated token ids, through ``--dataset file``; every point
sends them in the same order, cycled, so both servers get the same prompts). Requests per point:
max(8, C), after min(C, 8) warm-up requests (left out): at C = 32 the 32 requests start
together and, all of one length, run as one batch of 32 to the end. A round measures every
concurrency on both servers back to back, in an order that alternates from round to round, so a
change in the shared machine's load falls on a pair; a round's ratio is its two throughputs'
ratio. Per point: the median over rounds of output tokens/s, ITL p50 and TPOT p50 with the
smallest and largest, the ratio to no speculation likewise, and the load average when each run
ended. From six rounds on, ``ratio_ci95`` is a distribution-free 95 % interval of the median
ratio (``measure.stats.median_ci``: order statistics of the rounds, taken as independent
repeats; with six, their smallest to largest); with fewer, None.

ITL is per streamed chunk (vLLM's definition): a verification that keeps several tokens sends
them in one chunk, so with speculation ITL p50 is the time between verifications and TPOT
(the time per output token after the first) is the per-token figure.

    python -m benchmarks.eagle_serve [--rounds 2] [--concurrency 1 8 32] [--output-len 32]
        [--k 2] [--threads 1] [--disable-by-batch-size N] [--quantization gguf] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS, print_table, provenance
from benchmarks.eagle import HEAD
from benchmarks.eagle_prompts import HELD_OUT
from benchmarks.speculative import chat, spread
from infer_lab.measure.stats import median_ci

MODEL = "smollm2-135m-instruct"
KEYS = ("output_tok_s", "itl_p50_ms", "tpot_p50_ms", "ttft_p50_ms")


def write_dataset(tok, path: Path, output_len: int) -> Path:
    """The held-out prompts, chat-templated token ids, one JSON object a line."""
    with open(path, "w", encoding="utf-8") as f:
        for text in HELD_OUT:
            f.write(json.dumps({"prompt": chat(tok, text), "output_len": output_len}) + "\n")
    return path


def bench_point(base: str, c: int, dataset: Path, output_len: int,
                work: Path) -> dict[str, Any]:
    """One closed-loop point by ``infer-lab bench``: its summary's figures."""
    out = work / f"bench_c{c}.json"
    cmd = [sys.executable, "-m", "infer_lab.cli", "bench", "--base-url", base, "--model", MODEL,
           "--endpoint", "completions", "--concurrency", str(c),
           "--num-requests", str(max(8, c)), "--num-warmups", str(min(c, 8)),
           "--dataset", "file", "--dataset-path", str(dataset), "--output-len",
           str(output_len), "--ignore-eos", "--no-progress", "--timeout", "1800",
           "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    s = json.loads(out.read_text())["points"][0]["runs"][0]["summary"]
    return {"num_requests": s["num_requests"], "failed": s["failed"],
            "output_tok_s": s["output_throughput"], "itl_p50_ms": s["itl"]["p50"] * 1e3,
            "tpot_p50_ms": s["tpot"]["p50"] * 1e3, "ttft_p50_ms": s["ttft"]["p50"] * 1e3,
            "output_len_mismatch": s["output_len_mismatch"]}


def summary(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (method, concurrency): each figure's median over rounds with its range, and the
    ratio of the round's throughput to no speculation's in the same round."""
    base = {(r["round"], r["concurrency"]): r["output_tok_s"] for r in raw
            if r["method"] == "none"}
    rows = []
    for method in dict.fromkeys(r["method"] for r in raw):
        for c in dict.fromkeys(r["concurrency"] for r in raw):
            runs = [r for r in raw if r["method"] == method and r["concurrency"] == c]
            if not runs:  # not measured yet (the JSON is written as the sweep goes)
                continue
            row: dict[str, Any] = {"method": method, "concurrency": c, "rounds": len(runs),
                                   "failed": sum(r["failed"] for r in runs)}
            for key in KEYS:
                s = spread([r[key] for r in runs])
                row.update({key: s["median"], f"{key}_lo": s["lo"], f"{key}_hi": s["hi"]})
            ratios = [r["output_tok_s"] / base[r["round"], c] for r in runs
                      if (r["round"], c) in base]
            s = spread(ratios) if ratios else {"median": None, "lo": None, "hi": None}
            row.update(ratio=s["median"], ratio_lo=s["lo"], ratio_hi=s["hi"])
            ci = median_ci(ratios) if ratios else (math.nan, math.nan)  # rounds: the unit
            row["ratio_ci95"] = None if math.isnan(ci[0]) else list(ci)
            row["load_average"] = [min(r["load_average"] for r in runs),
                                   max(r["load_average"] for r in runs)]
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--k", type=int, default=2, help="EAGLE chain length (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per server")
    ap.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)  # tests: the bundled one
    ap.add_argument("--head", default=HEAD, help=argparse.SUPPRESS)
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="the EAGLE server's speculation is off in steps with this many "
                    "sequences or more (speculative_config's disable_by_batch_size); "
                    "results go to eagle_serve_dbs<N>.json")
    ap.add_argument("--quantization", choices=["gguf"], default=None,
                    help="gguf: both servers keep the file's blocks (`infer-lab serve`'s CPU "
                    "default) instead of fp32; results go to eagle_serve_gguf.json")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from benchmarks.serve_sweep import exit_on_sigterm, served
    from infer_lab.model.loader import open_checkpoint, resolve_model_path

    exit_on_sigterm()
    spec: dict[str, Any] = {"method": "eagle", "model": args.head,
                            "num_speculative_tokens": args.k}
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    suffix = "" if args.quantization is None else f"_{args.quantization}"
    if args.disable_by_batch_size is not None:
        suffix += f"_dbs{args.disable_by_batch_size}"
    path = Path(args.out or RESULTS) / f"eagle_serve{suffix}.json"
    weights = "fp32" if args.quantization is None else "the file's blocks kept"
    path.parent.mkdir(parents=True, exist_ok=True)
    raw: list[dict[str, Any]] = []
    payload: dict[str, Any] = {
        "benchmark": "eagle_serve", "provenance": provenance("cpu"), "model": f"{args.model} "
        f"({weights})", "speculative_config": spec, "threads": args.threads,
        "concurrency": args.concurrency, "output_len": args.output_len, "rounds": args.rounds,
        "prompts": HELD_OUT, "raw": raw,
        "command": "python -m benchmarks.eagle_serve " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "note": "infer-lab serve x2 (no speculation / EAGLE) as child processes on the same "
                "machine as the client (infer-lab bench, closed loop, streamed, greedy, "
                "ignore_eos); prefix caching off; max(8, C) requests per point after "
                "min(C, 8) warm-ups; ITL per streamed chunk; ratio = output tok/s over no "
                "speculation's in the same round; values: median over rounds, _lo/_hi the "
                "smallest and largest; load_average: 1-minute, when each run ended"}
    weights_args = (["--dtype", "fp32"] if args.quantization is None
                    else ["--quantization", args.quantization])
    common = ["--model", args.model, *weights_args, "--threads", str(args.threads),
              "--no-prefix-caching"]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        tok = open_checkpoint(resolve_model_path(args.model)).tokenizer()  # not the weights
        dataset = write_dataset(tok, work / "prompts.jsonl", args.output_len)
        bases = {"none": stack.enter_context(served(common, timeout=600)),
                 f"eagle k={args.k}": stack.enter_context(served(
                     [*common, "--speculative-config", json.dumps(spec)], timeout=600))}
        for rnd in range(args.rounds):
            for c in args.concurrency:
                order = list(bases) if rnd % 2 == 0 else list(bases)[::-1]
                for name in order:
                    point = bench_point(bases[name], c, dataset, args.output_len, work)
                    raw.append({"round": rnd, "method": name, "concurrency": c, **point,
                                "load_average": round(os.getloadavg()[0], 2)})
                    print_table(raw[-1:], list(raw[-1]))
                    payload["rows"] = summary(raw)
                    path.write_text(json.dumps(payload, indent=2) + "\n")  # as measured
    print_table(payload["rows"], ["method", "concurrency", "output_tok_s", "ratio", "ratio_lo",
                                  "ratio_hi", "itl_p50_ms", "tpot_p50_ms", "load_average"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
