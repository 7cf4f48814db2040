"""EAGLE on free text: acceptance length and batch-1 speedup beside prompt lookup and early exit.

SmolLM2-135M-Instruct (fp32) answers held-out free-text prompts (``benchmarks.eagle_prompts``,
disjoint from the head's training prompts; the second is Chapter 9's free-text prompt) one at a
time, greedily, with ``ignore_eos``: without speculation, with ``ngram`` k = 4, ``early_exit``
(24 of 30 layers, k = 2, Chapter 9's rows) and the shipped EAGLE head as a chain of k = 2, 4, 6
and as a tree. ``--rounds`` rounds; a round runs, per prompt, the baseline and then every method
back to back, in an order that alternates from prompt to prompt and round to round, so a
change in the shared machine's load falls on a round's pair. Speedup = the baseline's time
over the method's by ``--clock`` (``cpu``: this process's CPU time, one thread; a loaded
machine's waits left out), per prompt and round; a row's speedup is the median over all of
them with the smallest and largest. Greedy output is checked identical to the baseline's.

Prompts are the independent unit (Chapter 7's rule: runs of one prompt share its text, and
rounds of one prompt share its tokens): each row also gives, per prompt, its tokens per
verification and its speedup (the median of its rounds), a 95 % percentile-bootstrap interval
of the mean accepted length that resamples whole prompts (the pooled ratio, accepted tokens over
drafts, recomputed per resample), and a distribution-free 95 % interval of the median speedup
over prompts (``measure.stats.median_ci``, order statistics of the per-prompt speedups).

Per row also: acceptance rate, mean accepted length (tokens per verification, the bonus token
included) and its distribution (the fraction of verifications that kept exactly 1, 2, ...
tokens); the draft's measured cost c (proposer time per draft over k, the configured depth,
over a baseline decode step's time, same clock; a draft cut short near max_tokens still counts
k) and Leviathan et al.'s expected speedup (1 - a^(k+1)) / ((1 - a)(k c + 1)) from the
measured per-token acceptance a, beside the measured one (for a tree, k is its depth and c its
whole proposal's cost over k). The formula prices a verification at one plain step; the
measured price, v (a step's time less its draft's, over a plain step's), is recorded too, and
with it the measured speedup is tokens per step / (v + k c) (all rounds pooled).

    python -m benchmarks.eagle [--rounds 1] [--max-tokens 32] [--prompts 16] [--threads 1]
        [--clock cpu|wall] [--quantization gguf] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

import infer_lab as il
from benchmarks._common import print_table, provenance, write_results
from benchmarks.eagle_prompts import HELD_OUT
from benchmarks.speculative import chat, spread
from infer_lab.engine import LLMEngine, SamplingParams
from infer_lab.measure.stats import median_ci

HEAD = "eagle-smollm2-135m-instruct"
TREE = "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 0, 0)]"
SPECS: dict[str, dict[str, Any]] = {
    "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4},
    "early_exit 24/30 k=2": {"method": "early_exit", "num_layers": 24,
                             "num_speculative_tokens": 2},
    **{f"eagle k={k}": {"method": "eagle", "model": HEAD, "num_speculative_tokens": k}
       for k in (2, 4, 6)},
    "eagle tree (6 nodes, depth 4)": {"method": "eagle", "model": HEAD,
                                      "num_speculative_tokens": 4,
                                      "speculative_token_tree": TREE},
}
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def run(model, tok, prompt: list[int], max_tokens: int, spec: dict | None,
        clock: str) -> dict[str, Any]:
    """One request through a fresh engine: its tokens, time, steps and draft counts."""
    now = CLOCKS[clock]
    engine = LLMEngine(model, tok, speculative_config=spec, num_kv_blocks=256, max_num_seqs=4)
    propose_s = [0.0]
    if engine.spec is not None:  # the draft's own cost, timed around the proposer
        inner = engine.spec.proposer.propose

        def timed(*a, **kw):
            t = now()
            try:
                return inner(*a, **kw)
            finally:
                propose_s[0] += now() - t
        engine.spec.proposer.propose = timed
    engine.add_request("0", prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                   ignore_eos=True, detokenize=False))
    engine.step()  # the prefill, not timed: decode is what speculation changes
    start = now()
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                tokens = o.outputs[0].token_ids
    seconds = now() - start
    st = engine.get_stats()
    counts = engine.spec.counts if engine.spec is not None else None
    return {"seconds": seconds, "tokens": tokens, "steps": st.num_steps - 1,
            "propose_s": propose_s[0], "num_drafts": counts.num_drafts if counts else 0,
            "draft_tokens": counts.num_draft_tokens if counts else 0,
            "accepted_tokens": counts.num_accepted_tokens if counts else 0,
            "per_pos": list(counts.num_accepted_tokens_per_pos) if counts else []}


def depth(spec: dict[str, Any]) -> int:
    return int(spec["num_speculative_tokens"])


def verify_cost(runs: list[dict], step_s: float) -> float:
    """v: what a step costs beyond its draft, in plain decode steps (the target's forward of
    the k + 1 or tree tokens, and the engine's work for them). Leviathan's formula takes v = 1;
    with it the measured speedup decomposes exactly: tokens per step / (v + k c)."""
    steps = sum(r["steps"] for r in runs)
    rest = sum(r["seconds"] - r["propose_s"] for r in runs)
    return rest / max(1, steps) / step_s


def leviathan(a: float, k: int, c: float) -> float:
    """Expected speedup of k guesses per step at per-token acceptance a and draft cost c."""
    tokens = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
    return tokens / (k * c + 1)


def pooled_length_ci(accepted: list[int], drafts: list[int], level: float = 0.95,
                     n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A percentile-bootstrap interval of 1 + accepted / drafts that resamples whole prompts.

    A prompt's verifications share its text (one hard passage rejects a run of them), so the
    prompts, not the verifications, are what is drawn with replacement."""
    acc, n = np.asarray(accepted, float), np.asarray(drafts, float)
    if len(acc) < 2:
        return (float("nan"), float("nan"))
    picks = np.random.default_rng(seed).integers(0, len(acc), (n_boot, len(acc)))
    lengths = 1 + acc[picks].sum(1) / np.maximum(n[picks].sum(1), 1)
    lo, hi = np.quantile(lengths, [(1 - level) / 2, (1 + level) / 2])
    return (float(lo), float(hi))


def per_prompt(runs: list[dict], bases: list[dict], n_prompts: int) -> list[dict[str, Any]]:
    """Per prompt (runs are in round-major order): drafts, tokens per verification, and the
    median speedup over its rounds."""
    out = []
    for i in range(n_prompts):
        mine = runs[i::n_prompts]
        drafts = sum(r["num_drafts"] for r in mine)
        accepted = sum(r["accepted_tokens"] for r in mine)
        out.append({"prompt": i, "num_drafts": drafts, "accepted_tokens": accepted,
                    "mean_accepted_length": 1 + accepted / drafts if drafts else None,
                    "speedup": statistics.median(b["seconds"] / r["seconds"] for r, b in
                                                 zip(mine, bases[i::n_prompts]))})
    return out


def summarize(name: str, spec: dict, runs: list[dict], bases: list[dict],
              n_prompts: int) -> dict[str, Any]:
    """One row: acceptance over every run, speedups per (prompt, round), the prediction,
    and per-prompt figures with intervals over prompts."""
    drafts = sum(r["num_drafts"] for r in runs)
    drafted = sum(r["draft_tokens"] for r in runs)
    accepted = sum(r["accepted_tokens"] for r in runs)
    k = depth(spec)
    width = max(len(r["per_pos"]) for r in runs)
    at_least = [sum(r["per_pos"][i] if i < len(r["per_pos"]) else 0 for r in runs)
                for i in range(width)] + [0]
    hist = [drafts - (at_least[0] if width else 0)] + [at_least[i] - at_least[i + 1]
                                                        for i in range(width)]
    # per-token acceptance as the chain formula reads it: a with sum a^i (i=1..k) = accepted
    # per draft; solved by bisection (a chain's acceptance rate undercounts: a rejection ends it)
    per_draft = accepted / drafts if drafts else 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(1, k + 1)) < per_draft else (lo, mid)
    alpha = lo
    step_s = sum(b["seconds"] for b in bases) / sum(b["steps"] for b in bases)
    draft_c = sum(r["propose_s"] for r in runs) / max(1, drafts) / k / step_s
    verify_v = verify_cost(runs, step_s)
    speedups = [b["seconds"] / r["seconds"] for r, b in zip(runs, bases)]
    s = spread(speedups)
    prompts = per_prompt(runs, bases, n_prompts)
    len_ci = pooled_length_ci([p["accepted_tokens"] for p in prompts],
                              [p["num_drafts"] for p in prompts])
    speed_ci = median_ci([p["speedup"] for p in prompts])
    return {"method": name, "k": k, "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1 + per_draft, "num_drafts": drafts,
            "mean_accepted_length_ci": list(len_ci),
            "prompt_speedup_median": statistics.median(p["speedup"] for p in prompts),
            "prompt_speedup_ci": list(speed_ci), "per_prompt": prompts,
            "accepted_length_hist": [h / drafts for h in hist] if drafts else [],
            "alpha": alpha, "draft_cost_c": draft_c,
            "predicted_speedup": leviathan(alpha, k, draft_c) if drafts else None,
            "verify_cost_v": verify_v,
            "speedup": s["median"], "speedup_lo": s["lo"], "speedup_hi": s["hi"],
            "speedups": s["values"],
            "identical": all(r["tokens"] == b["tokens"] for r, b in zip(runs, bases))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=len(HELD_OUT),
                    help="the first N held-out prompts (default: all)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=list(CLOCKS), default="cpu")
    ap.add_argument("--only", nargs="*", help="methods to run (default: all)")
    ap.add_argument("--quantization", choices=["gguf"], default=None,
                    help="gguf: the target keeps its file's blocks (what `infer-lab serve` runs "
                    "on a CPU by default); results go to eagle_gguf.json")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = il.load("smollm2-135m-instruct", device="cpu", dtype=torch.float32,
                         quantization=args.quantization)
    label = "fp32" if args.quantization is None else "the file's Q4_1/Q8_0 blocks kept"
    prompts = [chat(tok, p) for p in HELD_OUT[: args.prompts]]
    specs = {n: s for n, s in SPECS.items() if not args.only or n in args.only}
    runs: dict[str, list[dict]] = {n: [] for n in specs}
    bases: list[dict] = []
    loads = [os.getloadavg()[0]]
    for rnd in range(args.rounds):
        for i, p in enumerate(prompts):
            base = run(model, tok, p, args.max_tokens, None, args.clock)
            # the order reverses from prompt to prompt and from round to round
            order = list(specs) if (rnd + i) % 2 == 0 else list(specs)[::-1]
            for name in order:
                runs[name].append(run(model, tok, p, args.max_tokens, specs[name], args.clock))
            bases.append(base)
        loads.append(os.getloadavg()[0])
        print(f"round {rnd + 1}/{args.rounds} (load average {loads[-1]:.1f})", flush=True)
    n = len(bases)
    base_tok_s = sum(len(b["tokens"]) - 1 for b in bases) / sum(b["seconds"] for b in bases)
    rows = [summarize(name, specs[name], [runs[name][i] for i in range(n)], bases,
                      len(prompts)) for name in specs]
    print(f"baseline decode {base_tok_s:.1f} tok/s ({args.clock} clock)")
    for r in rows:
        r["len_ci"] = "[{:.2f}, {:.2f}]".format(*r["mean_accepted_length_ci"])
        r["speed_ci"] = "[{:.2f}, {:.2f}]".format(*r["prompt_speedup_ci"])
    print_table(rows, ["method", "mean_accepted_length", "len_ci", "acceptance_rate",
                       "draft_cost_c", "predicted_speedup", "speedup", "speed_ci",
                       "identical"])
    for r in rows:
        del r["len_ci"], r["speed_ci"]
    payload = {"benchmark": "eagle", "provenance": {**provenance("cpu"),
                                                    "load_average": [min(loads), max(loads)],
                                                    "load_average_per_round": loads},
               "model": f"smollm2-135m-instruct ({label})", "head": HEAD, "tree": TREE,
               "prompts": HELD_OUT[: args.prompts], "max_tokens": args.max_tokens,
               "rounds": args.rounds, "clock": args.clock, "base_tok_s": base_tok_s,
               "rows": rows,
               "command": "python -m benchmarks.eagle " + " ".join(
                   sys.argv[1:] if argv is None else argv),
               "note": "batch 1, greedy, ignore_eos, prefill not timed; speedup = baseline "
                       "decode time / method's, same prompt and round, median over prompts x "
                       "rounds (lo/hi: smallest/largest); per_prompt: each prompt's "
                       "tokens per verification and median speedup over rounds; "
                       "mean_accepted_length_ci: 95% bootstrap over prompts (pooled ratio); "
                       "prompt_speedup_ci: 95% order-statistic interval of the median of "
                       "per-prompt speedups (prompts are the independent unit); "
                       "draft_cost_c = proposer time per draft / k (the configured "
                       "depth: a tree's depth, not its nodes; a chain cut short still "
                       "counts k) / baseline step time; "
                       "predicted_speedup = Leviathan et al. from alpha (per-token "
                       "acceptance solving sum a^i = accepted per draft) and c"}
    name = "eagle" if args.quantization is None else f"eagle_{args.quantization}"
    path = write_results(name, payload, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
