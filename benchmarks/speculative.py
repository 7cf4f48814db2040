"""Speculative decoding on SmolLM2-135M-Instruct: acceptance, batch-1 speedup, throughput.

Per method and k: acceptance rate, mean accepted length (tokens per verification), batch-1
decode tokens/s against the same engine without speculation (greedy output checked identical),
on a copy-heavy task (rewrite a given paragraph) and on free generation; then throughput with
and without speculation at concurrency 1, 8 and 32 (all requests added at once; generated tokens
over wall time), including ``disable_by_batch_size``. ``--rounds`` independent rounds (5), each
measuring a setting and its baseline back to back; per point the median ratio over rounds and its
smallest and largest value (the spread a shared machine adds). ``--clock cpu`` times the offline
parts by the process's CPU time instead of the wall clock: on a machine other jobs share, a
one-thread run's CPU time leaves out the time it waited for a core. Ratios are what to read.

``--server`` adds (``--only server``: runs only) the sweep through the server: ``infer-lab
serve`` as a child process with and without ``ngram`` k = 4, driven by the load generator of
``infer-lab bench`` (closed loop at concurrency 1, 4, 16, 64; streamed, greedy, ``ignore_eos``;
``--server-rounds`` rounds of max(16, 2 C) requests per point) on a copy-heavy prompt set (each
request asks to rewrite its own paragraph, shuffled from a pool of sentences, so no two prompts
share more than the chat template). Per row: output tokens/s, TTFT, ITL and TPOT p50 (ITL per
streamed chunk: a step that keeps several tokens sends them in one chunk), and the ratio to no
speculation, each the median over rounds with its range; no p99: a point's few dozen requests
put no sample beyond it (Chapter 7's rule). Each round's rows are written to the JSON as soon as
they are measured. ``bench`` itself sends random prompts, which have nothing to copy, so the
sweep calls its closed loop and statistics with these prompts instead.

``--gpu`` (device_check.sh's ``speculative`` step) measures at GPU sizes instead: a random-weight
Llama-3.2-1B-shaped model in bf16 (the checkpoint of ``benchmarks.engine_gpu``), batch-1 decode
tokens/s without speculation (CUDA graphs, as the engine runs it), with ``ngram`` k = 4 and with
``early_exit`` (4 of 16 layers, k = 2), acceptance and whether greedy output stayed the same;
then offline throughput at batch 8 and 32 with and without ``ngram``. Random weights say
nothing about how often a real draft is right: the acceptance rows say what these weights did
(a random model's greedy output soon repeats itself, which prompt lookup then finds); the step
costs are what to read. ``--device cpu --tiny`` runs the same code on tiny shapes.

    python -m benchmarks.speculative [--threads 1] [--max-tokens 64] [--rounds 5]
        [--clock wall|cpu] [--out DIR]
    python -m benchmarks.speculative --only server [--server-concurrency 1 4 16 64]
        [--server-rounds 3]
    python -m benchmarks.speculative --gpu [--device cpu --tiny] [--save-dir DIR] [--out DIR]

Drafts: prompt lookup (``ngram``); ``early_exit`` with the first 24 of 30 layers; ``draft_model``
with a truncated *copy* of the target (its first 12 layers): no smaller model with SmolLM2's
tokenizer is available offline, so the draft-model rows measure the machinery, not a good draft.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import infer_lab as il
from benchmarks._common import RESULTS, print_table, provenance, write_results
from infer_lab.engine import LLMEngine, SamplingParams

PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every "
    "night its keeper climbed the spiral stairs, trimmed the wick and wound the clockwork that "
    "turned the great lens, so that ships passing the rocks below could find their way home. "
    "When the keeper grew old, the village built an electric lamp, and the stairs fell silent."
)
COPY_TASK = ("Rewrite the following paragraph exactly, word for word, with no changes:\n\n"
             + PARAGRAPH)
FREE_TASK = "Write a short story about a robot who learns to paint."
# The server sweep's copy-heavy prompts: each request gets its own shuffle of these sentences.
SENTENCES = [
    "The old lighthouse stood at the edge of the cliff.",
    "Every night its keeper climbed the spiral stairs.",
    "He trimmed the wick and wound the clockwork.",
    "The great lens turned slowly above the sea.",
    "Ships passing the rocks below could find their way home.",
    "In winter the wind shook the windows of the tower.",
    "The village sent bread and oil up the hill each week.",
    "A gull nested every spring on the iron railing.",
    "The keeper wrote the weather in a leather book.",
    "One stormy night a fishing boat lost its mast.",
    "The light guided it safely into the harbour.",
    "Years later the village built an electric lamp.",
    "The stairs fell silent and the book was closed.",
    "Children still climb the hill to see the old tower.",
]
SERVER_SPEC = {"method": "ngram", "num_speculative_tokens": 4}


def chat(tok, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}],
                                   add_generation_prompt=True, tokenize=True)


def truncated_copy(model, num_layers: int):
    draft = copy.deepcopy(model)
    draft.layers = draft.layers[:num_layers]
    draft.config = dataclasses.replace(model.config, num_hidden_layers=num_layers)
    return draft


def run(model, tok, prompts: list[list[int]], max_tokens: int, spec: dict | None) -> dict:
    engine = LLMEngine(model, tok, speculative_config=spec, num_kv_blocks=1024,
                       max_num_seqs=64)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs: dict[str, list[int]] = {}
    start, start_cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    st = engine.get_stats()
    return {"wall_s": wall, "cpu_s": cpu, "tokens": sum(map(len, outs.values())),
            "outputs": [outs[str(i)] for i in range(len(prompts))], "steps": st.num_steps,
            "acceptance_rate": st.spec_acceptance_rate,
            "mean_accepted_length": st.spec_mean_accepted_length,
            "num_drafts": st.spec_num_drafts, "draft_tokens": st.spec_num_draft_tokens,
            "accepted_tokens": st.spec_num_accepted_tokens}


def spread(values: list[float]) -> dict[str, Any]:
    """Median, smallest and largest of one quantity over independent rounds, and the values."""
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "lo": ordered[0], "hi": ordered[-1],
            "values": values}


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def copy_prompts(tok, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` distinct copy tasks (chat-templated ids): rewrite a paragraph of 5 sentences."""
    rng = random.Random(seed)
    return [chat(tok, "Rewrite the following paragraph exactly, word for word:\n\n"
                 + " ".join(rng.sample(SENTENCES, 5))) for _ in range(n)]


def server_sweep(tok, concurrencies: list[int], max_tokens: int, threads: int, rounds: int,
                 path: Path, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Closed loop through ``infer-lab serve`` with and without ngram, in ``rounds`` rounds.

    Both servers run at once (child processes, ``threads`` torch threads each, one idle while
    the other is measured). A round measures every concurrency on both servers back to back (in
    alternating order from round to round), so a change in the shared machine's load falls on a
    pair rather than between the two halves of the sweep; the ratio of a round is its two
    throughputs' ratio. Requests per point and round: max(16, 2 C), so the batch stays near C
    for most of the run; warm-up: C requests (not counted). Each round's rows go to the JSON as
    measured (``server_rounds``); ``server_sweep`` holds, per point, the median over rounds of
    each quantity with its smallest and largest value.
    """
    import contextlib

    from benchmarks.serve_sweep import exit_on_sigterm, served
    from infer_lab.measure.loadgen import Endpoint, run_closed_loop, run_sync
    from infer_lab.measure.stats import summarize
    from infer_lab.measure.workloads import RequestSpec

    exit_on_sigterm()
    path.parent.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the child's torch reads it at start-up
    raw = payload.setdefault("server_rounds", [])
    raw.clear()
    with contextlib.ExitStack() as stack:
        endpoints = {}
        for name, spec in (("none", None), ("ngram k=4", SERVER_SPEC)):
            extra = ["--model", "smollm2-135m-instruct", "--dtype", "float32"]
            if spec is not None:
                extra += ["--speculative-config", json.dumps(spec)]
            base = stack.enter_context(served(extra, timeout=600))
            endpoints[name] = Endpoint(base_url=base, model="smollm2-135m-instruct",
                                       ignore_eos=True, timeout=1800)
        for rnd in range(rounds):
            for c in concurrencies:
                order = list(endpoints) if rnd % 2 == 0 else list(endpoints)[::-1]
                for name in order:
                    n = max(16, 2 * c)
                    prompts = copy_prompts(tok, c + n, seed=1000 * rnd + c)  # warm-up first
                    specs = [RequestSpec(len(p), max_tokens, 0.0, p) for p in prompts]
                    run_sync(run_closed_loop(endpoints[name], specs[:c], c))
                    result = run_sync(run_closed_loop(endpoints[name], specs[c:], c))
                    summary = summarize(result.results, result.duration)
                    raw.append({
                        "round": rnd, "method": name, "concurrency": c, "num_requests": n,
                        "failed": summary.failed, "output_tok_s": summary.output_throughput,
                        "ttft_p50_ms": summary.ttft.p50 * 1e3,
                        "itl_p50_ms": summary.itl.p50 * 1e3,
                        "tpot_p50_ms": summary.tpot.p50 * 1e3,
                        "load_average": load_average(),
                    })
                    print_table(raw[-1:], list(raw[-1]))
                    payload["server_sweep"] = sweep_summary(raw)
                    path.write_text(json.dumps(payload, indent=2) + "\n")  # as measured
    return payload["server_sweep"]


def sweep_summary(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (method, concurrency): each quantity's median over rounds, with its range, and the
    ratio of the round's throughput to no speculation's in the same round."""
    base = {(r["round"], r["concurrency"]): r["output_tok_s"] for r in raw
            if r["method"] == "none"}
    rows = []
    for method in dict.fromkeys(r["method"] for r in raw):
        for c in dict.fromkeys(r["concurrency"] for r in raw):
            runs = [r for r in raw if r["method"] == method and r["concurrency"] == c]
            if not runs:
                continue
            row: dict[str, Any] = {"method": method, "concurrency": c, "rounds": len(runs),
                                   "num_requests": sum(r["num_requests"] for r in runs),
                                   "failed": sum(r["failed"] for r in runs)}
            for key in ("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "tpot_p50_ms"):
                s = spread([r[key] for r in runs])
                row.update({key: s["median"], f"{key}_lo": s["lo"], f"{key}_hi": s["hi"]})
            ratios = [r["output_tok_s"] / base[r["round"], c] for r in runs
                      if (r["round"], c) in base]
            if ratios:
                s = spread(ratios)
                row.update(ratio=s["median"], ratio_lo=s["lo"], ratio_hi=s["hi"])
            else:
                row.update(ratio=None, ratio_lo=None, ratio_hi=None)
            row["load_average"] = [min(r["load_average"] for r in runs),
                                   max(r["load_average"] for r in runs)]
            rows.append(row)
    return rows


def gpu_check(device: str, tiny: bool, save_dir: Path, out: Path | None,
              max_tokens: int) -> Path:
    """Speculation at GPU sizes (or tiny ones on CPU); rows written to the JSON as measured."""
    import numpy as np

    from benchmarks.engine_gpu import LLAMA_32_1B, SMOKE, IdsOnly, save_random_checkpoint
    from infer_lab.model.loader import load_model

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA GPU; --device cpu --tiny runs the plumbing on CPU")
    dtype = torch.bfloat16
    shape = SMOKE if tiny else LLAMA_32_1B
    out = out or (Path("/tmp/infer_lab_smoke") if tiny else RESULTS / "gpu")
    model = load_model(save_random_checkpoint(shape, save_dir, dtype), device=device,
                       dtype=dtype)
    layers = shape["num_hidden_layers"]
    specs: dict[str, dict[str, Any] | None] = {
        "none": None,
        "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4},
        f"early_exit {max(1, layers // 4)}/{layers} k=2": {
            "method": "early_exit", "num_layers": max(1, layers // 4),
            "num_speculative_tokens": 2},
    }
    rng = np.random.default_rng(0)
    half = rng.integers(3, shape["vocab_size"], 48).tolist()
    prompt = half + half  # something to copy, should the model copy it
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows: list[dict[str, Any]] = []
    payload = {"benchmark": "speculative_gpu", **provenance(device), "dtype": str(dtype),
               "model": "tiny smoke shape" if tiny else "random-weight Llama-3.2-1B shape",
               "shape": shape, "max_tokens": max_tokens, "rows": rows,
               "note": "greedy, ignore_eos; random weights: acceptance is these weights', not a "
                       "trained model's; ratio = tok/s over no speculation's at that batch"}

    def timed(prompts: list[list[int]], spec: dict[str, Any] | None) -> dict[str, Any]:
        # A fixed pool (the default fills the GPU, and a draft's cache needs room beside it);
        # max_num_seqs = the batch, so CUDA graphs are captured for those sizes only.
        engine = LLMEngine(model, IdsOnly(), speculative_config=spec,
                           max_num_seqs=len(prompts), num_kv_blocks=1024,
                           enable_prefix_caching=False)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        engine.add_request("warm", prompts[0], SamplingParams(max_tokens=8, temperature=0,
                                                              ignore_eos=True))
        while engine.has_unfinished_requests():  # warm-up (CUDA graphs are captured before)
            engine.step()
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        outs: dict[str, list[int]] = {}
        sync()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0].token_ids
        sync()
        wall = time.perf_counter() - start
        st = engine.get_stats()
        del engine
        return {"wall_s": wall, "tok_s": sum(map(len, outs.values())) / wall,
                "outputs": [outs[str(i)] for i in range(len(prompts))],
                "acceptance_rate": st.spec_acceptance_rate,
                "mean_accepted_length": st.spec_mean_accepted_length}

    for batch in (1, 8, 32):
        prompts = [prompt] + [rng.integers(3, shape["vocab_size"], 96).tolist()
                              for _ in range(batch - 1)]
        base = None
        for name, spec in specs.items():
            if batch > 1 and name.startswith("early_exit"):
                continue
            r = timed(prompts, spec)
            base = base or r
            rows.append({"batch": batch, "method": name, "tok_s": r["tok_s"],
                         "ratio": r["tok_s"] / base["tok_s"],
                         "acceptance_rate": r["acceptance_rate"],
                         "mean_accepted_length": r["mean_accepted_length"],
                         "identical": r["outputs"] == base["outputs"]})
            print(rows[-1], flush=True)
            path = write_results("speculative", payload, out)  # as measured
    print_table(rows, ["batch", "method", "tok_s", "ratio", "acceptance_rate", "identical"])
    print(f"wrote {path}")
    return path


def server_meta(payload: dict[str, Any], args: argparse.Namespace) -> None:
    """The server sweep's provenance (one entry of the list, replacing an older one) and note."""
    runs = [r for r in payload.get("provenance", []) if r.get("part") != "server_sweep"]
    payload["provenance"] = runs + [{**provenance("cpu"), "part": "server_sweep"}]
    payload["server_max_tokens"] = args.server_max_tokens
    payload["server_note"] = (
        "infer-lab serve (SmolLM2 fp32, default engine settings) as a child process on "
        "the same 2-core machine as the client, which other engineers' jobs shared; "
        f"server threads {args.threads}; output tokens {args.server_max_tokens} "
        f"(ignore_eos, greedy, streamed); {args.server_rounds} rounds of max(16, 2C) "
        "requests per point; ratio = output tokens/s over no speculation's in the same round; "
        "each value is the median over rounds, _lo and _hi the smallest and largest")


def batch1(model, tok, prompts: dict[str, list[int]], specs: dict[str, dict[str, Any]],
           max_tokens: int, rounds: int, clock: str = "wall_s") -> list[dict[str, Any]]:
    """Each method against no speculation, one request at a time, over ``rounds`` rounds.

    A round runs, per task, the baseline and then every method back to back, so that a change in
    a shared machine's load falls on a round's pair rather than between them; the speedup of a
    round is the baseline's time over the method's, by ``clock`` (``wall_s``, or ``cpu_s``: this
    process's CPU time, which leaves out the time a one-thread run waits for a shared core).
    Greedy acceptance is the same in every round (the tokens are), so the counters come from the
    last round."""
    speedups: dict[tuple[str, str], list[float]] = {}
    last: dict[tuple[str, str], dict[str, Any]] = {}
    for rnd in range(rounds):
        for task, prompt in prompts.items():
            base = run(model, tok, [prompt], max_tokens, None)
            for name, spec in specs.items():
                r = run(model, tok, [prompt], max_tokens, spec)
                speedups.setdefault((task, name), []).append(base[clock] / r[clock])
                last[task, name] = {**r, "identical": r["outputs"] == base["outputs"],
                                    "base_tok_s": base["tokens"] / base[clock]}
        print(f"batch1 round {rnd + 1}/{rounds} done (load average {load_average()})",
              flush=True)
    rows = []
    for (task, name), r in last.items():
        s = spread(speedups[task, name])
        rows.append({
            "task": task, "method": name, "acceptance_rate": r["acceptance_rate"] or 0.0,
            "mean_accepted_length": r["mean_accepted_length"] or 1.0,
            "num_drafts": r["num_drafts"], "draft_tokens": r["draft_tokens"],
            "accepted_tokens": r["accepted_tokens"],
            "tok_s": r["tokens"] / r[clock], "base_tok_s": r["base_tok_s"],
            "speedup": s["median"], "speedup_lo": s["lo"], "speedup_hi": s["hi"],
            "speedups": s["values"], "identical": r["identical"],
        })
    return rows


def concurrency(model, tok, prompts: dict[str, list[int]], spec: dict[str, Any],
                max_tokens: int, rounds: int, clock: str = "wall_s") -> list[dict[str, Any]]:
    """Throughput with and without speculation, half copy and half free prompts all added at
    once, at 1, 8 and 32 sequences; each round measures the three settings back to back."""
    settings = {"none": None, "ngram k=4": spec,
                "ngram k=4 disable_by_batch_size=8": {**spec, "disable_by_batch_size": 8}}
    ratios: dict[tuple[int, str], list[float]] = {}
    tok_s: dict[tuple[int, str], list[float]] = {}
    last: dict[tuple[int, str], dict[str, Any]] = {}
    for rnd in range(rounds):
        for n in (1, 8, 32):
            batch = [prompts["copy"] if i % 2 == 0 else prompts["free"] for i in range(n)]
            base = None
            for name, s in settings.items():
                r = run(model, tok, batch, max_tokens, s)
                base = base or r
                ratios.setdefault((n, name), []).append(base[clock] / r[clock])
                tok_s.setdefault((n, name), []).append(r["tokens"] / r[clock])
                last[n, name] = {**r, "identical": r["outputs"] == base["outputs"]}
        print(f"concurrency round {rnd + 1}/{rounds} done (load average {load_average()})",
              flush=True)
    rows = []
    for (n, name), r in last.items():
        s = spread(ratios[n, name])
        rows.append({"concurrency": n, "method": name,
                     "tok_s": statistics.median(tok_s[n, name]),
                     "ratio": s["median"], "ratio_lo": s["lo"], "ratio_hi": s["hi"],
                     "ratios": s["values"], "identical": r["identical"],
                     "acceptance_rate": r["acceptance_rate"] or 0.0})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5,
                    help="independent rounds of the offline measurements (median and range)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="offline: time by wall clock, or by this process's CPU time (on a "
                         "shared machine it leaves out the waits for a core)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--server", action="store_true", help="also run the server sweep")
    ap.add_argument("--only", choices=("server",), default=None,
                    help="run only the server sweep, keeping the JSON's other sections")
    ap.add_argument("--server-concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--server-max-tokens", type=int, default=32)
    ap.add_argument("--server-rounds", type=int, default=3,
                    help="independent rounds of the server sweep (median and range)")
    ap.add_argument("--gpu", action="store_true",
                    help="GPU sizes (device_check.sh): random Llama-3.2-1B shape in bf16")
    ap.add_argument("--device", default="cuda", help="with --gpu: cuda, or cpu with --tiny")
    ap.add_argument("--tiny", action="store_true", help="with --gpu: tiny shapes (a smoke run)")
    ap.add_argument("--save-dir", type=Path, default=Path("/tmp/infer_lab_llama32_1b"),
                    help="with --gpu: where the random checkpoint is (made if absent)")
    args = ap.parse_args(argv)
    if args.gpu:
        gpu_check(args.device, args.tiny, args.save_dir, args.out and Path(args.out),
                  args.max_tokens)
        return
    torch.set_num_threads(args.threads)
    if args.only == "server":
        path = Path(args.out or RESULTS) / "speculative.json"
        payload = json.loads(path.read_text()) if path.exists() else {}
        tok = il.load("smollm2-135m-instruct", device="cpu", dtype=torch.float32)[1]
        server_meta(payload, args)
        server_sweep(tok, args.server_concurrency, args.server_max_tokens, args.threads,
                     args.server_rounds, path, payload)
        print(f"wrote {path}")
        return
    model, tok = il.load("smollm2-135m-instruct", device="cpu", dtype=torch.float32)
    specs: dict[str, dict[str, Any]] = {
        "ngram k=2": {"method": "ngram", "num_speculative_tokens": 2},
        "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4},
        "ngram k=8": {"method": "ngram", "num_speculative_tokens": 8},
        "early_exit 24/30 k=2": {"method": "early_exit", "num_layers": 24,
                                 "num_speculative_tokens": 2},
        "draft_model copy 12/30 k=2": {"method": "draft_model",
                                       "model": truncated_copy(model, 12),
                                       "num_speculative_tokens": 2},
    }
    prompts = {"copy": chat(tok, COPY_TASK), "free": chat(tok, FREE_TASK)}
    run(model, tok, [prompts["free"]], 8, None)  # warm-up
    load_start = load_average()
    clock = f"{args.clock}_s"
    rows = batch1(model, tok, prompts, specs, args.max_tokens, args.rounds, clock)
    print_table(rows, ["task", "method", "acceptance_rate", "mean_accepted_length", "speedup",
                       "speedup_lo", "speedup_hi", "identical"])
    conc = concurrency(model, tok, prompts, specs["ngram k=4"], args.max_tokens, args.rounds,
                       clock)
    print_table(conc, ["concurrency", "method", "tok_s", "ratio", "ratio_lo", "ratio_hi",
                       "identical", "acceptance_rate"])
    payload = {
        "provenance": [{**provenance("cpu"), "part": "batch1 + concurrency",
                        "load_average": [load_start, load_average()]}],
        "model": "smollm2-135m-instruct (fp32)",
        "max_tokens": args.max_tokens, "rounds": args.rounds, "clock": args.clock,
        "batch1": rows,
        "concurrency": conc,
        "note": f"greedy, ignore_eos; speedup (ratio) = baseline time / speculative time by "
                f"the {args.clock} clock, median over rounds with the smallest and largest "
                "(_lo, _hi); each round measures a setting and its baseline back to back; "
                "tok_s = generated tokens per second of that clock",
    }
    path = write_results("speculative", payload, args.out)
    if args.server:
        del model
        server_meta(payload, args)
        server_sweep(tok, args.server_concurrency, args.server_max_tokens, args.threads,
                     args.server_rounds, path, payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
