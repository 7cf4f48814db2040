"""One decode step, eager against CUDA-graph replay, at a few batch sizes (Chapter 5).

    python -m benchmarks.cuda_graphs               # on a GPU: writes results/gpu/cuda_graphs.json
    python -m benchmarks.cuda_graphs --cpu-smoke   # the plumbing on CPU, eager only, to /tmp

For each batch size, an engine with ``use_cuda_graphs`` off and one with it on take the same
requests (random prompts of 32 tokens, greedy, ``ignore_eos``) past their prefill; then the median
wall time of ``engine.step()`` over decode-only steps is recorded, with the step's output tokens
checked equal between the two. A step is the whole engine step (scheduling, batch building, the
forward, sampling), which is what a user waits for; the graph only removes the launches of the
forward's kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import infer_lab as il
from benchmarks._common import RESULTS, print_table, provenance, write_results
from infer_lab.engine import LLMEngine


def decode_step_ms(model, tok, batch: int, graphs: bool, steps: int) -> tuple[float, list]:
    """Median ms of a decode-only engine step at ``batch`` sequences, and the tokens made."""
    # A fixed, small pool (32 + steps + 8 tokens a sequence): two engines in one process must
    # not each try to take 90 % of the GPU.
    blocks = batch * (-(-(32 + steps + 16) // 16)) + 8
    engine = LLMEngine(model, tok, max_num_seqs=max(batch, 1), use_cuda_graphs=graphs,
                       enable_prefix_caching=False, num_kv_blocks=blocks)
    rng = np.random.default_rng(0)
    for i in range(batch):
        prompt = rng.integers(3, model.config.vocab_size, 32).tolist()
        engine.add_request(str(i), prompt, il.SamplingParams(
            max_tokens=steps + 8, temperature=0, ignore_eos=True))
    engine.step()  # the prefill
    for _ in range(3):  # warm-up decode steps
        engine.step()
    times, tokens = [], []
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        outs = engine.step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
        tokens.append(sorted((o.request_id, o.outputs[0].token_ids[-1]) for o in outs))
    if graphs and not engine.runner.graphs:
        raise RuntimeError(f"CUDA graphs were not captured: {engine.runner.graph_error}")
    del engine
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a checkpoint (default: the bundled model)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--cpu-smoke", action="store_true", help="eager only, on CPU, 5 steps")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA graphs need a CUDA GPU; use --cpu-smoke to test the script on CPU")
    steps = 5 if args.cpu_smoke else args.steps
    model, tok = il.load(args.model, device=device)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        eager_ms, eager_tokens = decode_step_ms(model, tok, batch, False, steps)
        row = {"batch": batch, "eager_ms": eager_ms}
        if device == "cuda":
            graph_ms, graph_tokens = decode_step_ms(model, tok, batch, True, steps)
            row.update(graph_ms=graph_ms, eager_over_graph=eager_ms / graph_ms,
                       tokens_equal=graph_tokens == eager_tokens)
        rows.append(row)
    print_table(rows, list(rows[0]))
    payload = {"benchmark": "cuda_graphs", **provenance(device), "dtype": str(model.dtype),
               "model": args.model or "bundled tiny-kjv", "steps_per_point": steps,
               "what": "median wall ms of one decode-only engine.step(), eager vs CUDA graph",
               "points": rows}
    out = args.out or (Path("/tmp/infer_lab_smoke") if args.cpu_smoke else RESULTS / "gpu")
    print("wrote", write_results("cuda_graphs", payload, out))


if __name__ == "__main__":
    main()
