"""Continuous vs static batching, ours vs transformers, the engine's CPU cost, nano-vllm offline.

All on the bundled model, in one run (ratios, not absolute times, are what a shared machine can
quote):

1. The long-tail mix (128 requests, offline: all at t = 0), continuous vs static batching
   at the same maximum batch: output tokens/s and p99 end-to-end latency, and their ratios.
2. The same mix through ``transformers`` ``generate``, batched (``max_batch`` per call, left
   padding, its own KV cache, each batch run to its longest output): the throughput ratio.
3. Scheduler + runner CPU cost per step with 256 running sequences, the model forward replaced by
   a no-op (and the whole step, sampling and bookkeeping included, beside it).
4. The nano-vllm offline workload, scaled down for a CPU (stated in the output): output tokens/s.

    python -m benchmarks.batching [--max-batch 32] [--threads 1] [--nano-n 32] [--out DIR]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import infer_lab as il
from benchmarks._common import print_table, provenance, write_results
from infer_lab.measure.workloads import long_tail_mix, nano_vllm_offline
from infer_lab.model.loader import BUNDLED_MODEL_DIR


def token_prompts(reqs, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, r.prompt_len).tolist() for r in reqs]


def run_engine(model, tok, prompts, reqs, **kw) -> dict:
    llm = il.LLM(model, tokenizer=tok, **kw)
    params = [il.SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True,
                                detokenize=False) for r in reqs]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    e2e = np.array([o.metrics.finish_time - start for o in outs])
    ttft = np.array([o.metrics.first_token_time - start for o in outs])
    return dict(wall_s=wall, output_tokens=tokens, tokens_per_s=tokens / wall,
                e2e_p50_s=float(np.percentile(e2e, 50)), e2e_p99_s=float(np.percentile(e2e, 99)),
                ttft_p50_s=float(np.percentile(ttft, 50)),
                ttft_p99_s=float(np.percentile(ttft, 99)),
                steps=llm.engine.num_steps, preemptions=llm.engine.get_stats().num_preemptions)


@torch.inference_mode()
def run_transformers(prompts, reqs, max_batch: int, pad_id: int) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL_DIR, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = pad_id
    start = time.perf_counter()
    useful = 0
    for i in range(0, len(prompts), max_batch):
        batch, wants = prompts[i : i + max_batch], [r.output_len for r in reqs[i : i + max_batch]]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(wants),
                    do_sample=False)
        useful += sum(wants)  # each request's own tokens; the rest of its row is waste
    wall = time.perf_counter() - start
    return dict(wall_s=wall, output_tokens=useful, tokens_per_s=useful / wall)


def cpu_cost_per_step(model, tok, num_seqs: int = 256, steps: int = 200) -> dict:
    """Scheduler + runner time per decode step of ``num_seqs`` sequences, forward a no-op: the
    time ``step()`` spends in ``schedule`` and ``execute_model``, and the whole step."""
    vocab = model.config.vocab_size
    engine = il.engine.LLMEngine(model, tok, max_num_seqs=num_seqs, max_num_batched_tokens=8192,
                                 num_kv_blocks=num_seqs * 40, enable_prefix_caching=False)
    logits = torch.zeros(num_seqs, vocab)  # allocated once: the no-op must cost nothing
    engine.runner.forward = lambda ids, pos, ctx: logits[: len(ctx.logits_indices)]
    rng = np.random.default_rng(0)
    for i in range(num_seqs):
        engine.add_request(str(i), rng.integers(3, vocab, 32 + i % 64).tolist(),
                           il.SamplingParams(max_tokens=500, temperature=0, ignore_eos=True,
                                             detokenize=False))
    engine.step()  # all prefills
    spent: list[float] = []

    def timed(part):  # the time a part of step() takes, added to this step's entry
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return part(*args, **kwargs)
            finally:
                spent[-1] += time.perf_counter() - t
        return run

    engine.scheduler.schedule = timed(engine.scheduler.schedule)
    engine.executor.execute_model = timed(engine.executor.execute_model)
    whole = []
    for _ in range(steps):
        spent.append(0.0)
        t0 = time.perf_counter()
        engine.step()
        whole.append(time.perf_counter() - t0)
    sched_runner = spent
    running = engine.get_stats().num_running
    for rid in list(engine.requests):
        engine.abort(rid)
    return dict(num_seqs=running, scheduler_runner_us=float(np.median(sched_runner)) * 1e6,
                full_step_us=float(np.median(whole)) * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--nano-n", type=int, default=32)
    ap.add_argument("--nano-scale", type=float, default=0.125)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = il.load(device=device)
    vocab = model.config.vocab_size
    reqs = long_tail_mix()
    prompts = token_prompts(reqs, vocab)
    results: dict = {**provenance(device), "model": "bundled tiny-kjv",
                     "workload": "long-tail mix, 128 requests, seed 0, offline (all at t=0)",
                     "max_batch": args.max_batch}
    cont = run_engine(model, tok, prompts, reqs, max_num_seqs=args.max_batch)
    static = run_engine(model, tok, prompts, reqs, max_num_seqs=args.max_batch, policy="static")
    results["continuous"], results["static"] = cont, static
    results["throughput_ratio_continuous_vs_static"] = cont["tokens_per_s"] / static["tokens_per_s"]
    results["p99_e2e_ratio_static_vs_continuous"] = static["e2e_p99_s"] / cont["e2e_p99_s"]
    rows = [dict(system=f"ours, {k}", **{c: v[c] for c in ("wall_s", "tokens_per_s")},
                 e2e_p99_s=v["e2e_p99_s"]) for k, v in (("continuous", cont), ("static", static))]
    if not args.skip_hf and device == "cpu":
        hf = run_transformers(prompts, reqs, args.max_batch, tok.pad_token_id or 0)
        results["transformers_generate"] = hf
        results["throughput_ratio_ours_vs_transformers"] = cont["tokens_per_s"] / hf["tokens_per_s"]
        rows.append(dict(system="transformers generate", wall_s=hf["wall_s"],
                         tokens_per_s=hf["tokens_per_s"], e2e_p99_s=float("nan")))
    results["cpu_cost"] = cpu_cost_per_step(model, tok)
    nano = nano_vllm_offline(args.nano_n, lo=int(100 * args.nano_scale),
                             hi=int(1024 * args.nano_scale))
    results["nano_vllm_offline"] = {
        "scaled": f"{args.nano_n} requests, lengths uniform in {int(100 * args.nano_scale)}-"
                  f"{int(1024 * args.nano_scale)} (nano-vllm's own: 256 requests, 100-1024)",
        "gpu": device == "cuda",
        **run_engine(model, tok, token_prompts(nano, vocab), nano, max_num_seqs=64),
    }
    if device != "cuda":
        results["note"] = "no GPU in this run: CPU figures only (ratios, not absolute times)"
    print_table(rows, ["system", "wall_s", "tokens_per_s", "e2e_p99_s"])
    print(f"continuous / static throughput: {results['throughput_ratio_continuous_vs_static']:.2f}x"
          f"  (target >= 2x); static / continuous p99 E2E: "
          f"{results['p99_e2e_ratio_static_vs_continuous']:.2f}x")
    if "throughput_ratio_ours_vs_transformers" in results:
        print(f"ours / transformers generate: "
              f"{results['throughput_ratio_ours_vs_transformers']:.2f}x (target >= 3x)")
    c = results["cpu_cost"]
    print(f"CPU cost per step, {c['num_seqs']} sequences, no-op forward: scheduler + runner "
          f"{c['scheduler_runner_us']:.0f} µs (target < 500), "
          f"whole step {c['full_step_us']:.0f} µs")
    n = results["nano_vllm_offline"]
    print(f"nano-vllm offline ({n['scaled']}): {n['tokens_per_s']:.0f} output tokens/s")
    if "note" in results:
        print(results["note"])
    print("wrote", write_results("batching", results, args.out))


if __name__ == "__main__":
    main()
