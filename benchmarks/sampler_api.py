"""What min_p, logit_bias and min_tokens cost the rows that do not use them.

The sampler edits a row's logits only for the rows that ask (penalties, logit bias, min_tokens)
and renormalizes only the rows with ``min_p``. So a batch where one row asks should cost about
what the plain batch costs plus that one row's work. This script times one sampler call on a
batch of 64 rows over a 49,152-token vocabulary (SmolLM2's), sampled at temperature 1: none of
the settings, then one row with each, then every row with each, interleaved over rounds, and
prints the medians side by side.

    python -m benchmarks.sampler_api [--rounds 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks._common import print_table, provenance, write_results
from infer_lab.engine import Sampler, SamplingParams

ROWS, VOCAB = 64, 49152
SETTINGS = {
    "none": {},
    "min_p": {"min_p": 0.05},
    "logit_bias": {"logit_bias": {i: 5.0 for i in range(0, 2000, 20)}},  # 100 entries
    "min_tokens": {"min_tokens": 8},
    "penalties": {"presence_penalty": 0.5},
}


def batch(setting: dict, rows_with: int) -> list[SamplingParams]:
    plain = SamplingParams(temperature=1.0, max_tokens=16)
    special = SamplingParams(temperature=1.0, max_tokens=16, **setting)
    special.bind(frozenset({0, 1}), VOCAB)
    return [special] * rows_with + [plain] * (ROWS - rows_with)


def time_call(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams],
              history: list[list[int]]) -> float:
    start = time.perf_counter()
    sampler(logits, params, [None] * ROWS, history, history)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: no thread-pool waits on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    logits = torch.randn(ROWS, VOCAB)
    history = [list(range(i, i + 4)) for i in range(ROWS)]
    sampler = Sampler(torch.Generator().manual_seed(0))
    cases = {(name, k): batch(s, k) for name, s in SETTINGS.items()
             for k in ((0,) if name == "none" else (1, ROWS))}
    times: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
    for params in cases.values():  # warm-up
        time_call(sampler, logits, params, history)
    for _ in range(args.rounds):
        for case, params in cases.items():
            times[case].append(time_call(sampler, logits, params, history))
    base = statistics.median(times[("none", 0)])
    rows = [{"setting": name, "rows_using_it": k, "ms": statistics.median(t) * 1e3,
             "vs_none": statistics.median(t) / base} for (name, k), t in times.items()]
    print_table(rows, ["setting", "rows_using_it", "ms", "vs_none"])
    path = write_results("sampler_api", {
        "command": f"python -m benchmarks.sampler_api --rounds {args.rounds} "
                   f"--threads {args.threads}",
        "provenance": {**provenance("cpu"), "load_average": os.getloadavg()},
        "rows": ROWS, "vocab": VOCAB, "rounds": args.rounds, "results": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
