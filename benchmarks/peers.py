"""Offline throughput on the real model: infer_lab against transformers, same weights, same thread.

The workload is named and fixed: 32 requests, prompt token ids of uniform random length in
[16, 256], 64 output tokens each with EOS ignored, seed 0, one CPU thread. Both engines hold
SmolLM2-135M-Instruct dequantized from the same GGUF file into fp32 (ours through ``il.load``,
transformers through ``from_pretrained(dir, gguf_file=...)``).

1. Throughput (output tokens/s): ``LLM.generate`` (continuous batching, paged KV cache) against
   transformers' ``generate_batch`` (its continuous batching) and its padded ``generate`` (all 32
   left-padded into one batch), and the ratios.
2. Batch-1 decode tokens/s against the bandwidth bound: a decode step must read every weight once,
   so it cannot beat (copy bandwidth) / (weight bytes per token); the copy bandwidth is measured
   here with ``Tensor.copy_`` on a 512 MiB buffer at the same thread count (bytes read + written,
   as STREAM counts them). Transformers' batch-1 decode beside it.

With ``--repeats`` above 1 the measurements are interleaved and the best kept: on a shared machine
the best run is the one least disturbed by other work. The copy bandwidth is measured before and
after, the best kept.

    python -m benchmarks.peers [--threads 1] [--repeats 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

import infer_lab as il
from benchmarks._common import RESULTS, print_table, provenance, write_results
from infer_lab.model import registry

NAME = "smollm2-135m-instruct"
WORKLOAD = dict(requests=32, prompt_len_min=16, prompt_len_max=256, output_len=64, seed=0,
                ignore_eos=True)


def workload_prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(WORKLOAD["seed"])
    lens = rng.integers(WORKLOAD["prompt_len_min"], WORKLOAD["prompt_len_max"] + 1,
                        WORKLOAD["requests"])
    return [rng.integers(17, vocab, n).tolist() for n in lens]  # past the special tokens


def copy_bandwidth(repeats: int = 5) -> float:
    """Best bytes/s of a 512 MiB copy (read + write), at the current thread count."""
    a = torch.ones(64 * 2**20, dtype=torch.float64)
    b = torch.empty_like(a)
    b.copy_(a)
    best = min(_timed(lambda: b.copy_(a)) for _ in range(repeats))
    return 2 * a.numel() * a.element_size() / best


def _timed(fn) -> float:  # noqa: ANN001
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def ours_throughput(model, tok, prompts) -> float:
    llm = il.LLM(model, tokenizer=tok, max_num_seqs=len(prompts), enable_prefix_caching=False)
    params = il.SamplingParams(max_tokens=WORKLOAD["output_len"], temperature=0.0,
                               ignore_eos=True, detokenize=False)
    wall = _timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    return len(prompts) * WORKLOAD["output_len"] / wall


def ours_batch1_decode(model, tok, prompt: list[int], tokens: int) -> float:
    llm = il.LLM(model, tokenizer=tok, max_num_seqs=1)
    params = il.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                               detokenize=False)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return (tokens - 1) / (out.metrics.finish_time - out.metrics.first_token_time)


def _gen_config(hf, **extra):  # noqa: ANN001
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=WORKLOAD["output_len"], do_sample=False,
                            eos_token_id=None, pad_token_id=hf.config.pad_token_id or 0, **extra)


@torch.inference_mode()
def hf_generate_batch(hf, prompts) -> float:  # noqa: ANN001
    cfg = _gen_config(hf)
    start = time.perf_counter()
    out = hf.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False)
    wall = time.perf_counter() - start
    made = [len(o.generated_tokens) for o in out.values()]
    assert len(made) == len(prompts) and min(made) == WORKLOAD["output_len"], made
    return sum(made) / wall


@torch.inference_mode()
def hf_padded_generate(hf, prompts) -> float:  # noqa: ANN001
    pad = hf.config.pad_token_id or 0
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=_gen_config(hf))
    wall = time.perf_counter() - start
    assert out.shape[1] == width + WORKLOAD["output_len"]
    return len(prompts) * WORKLOAD["output_len"] / wall


@torch.inference_mode()
def hf_batch1_decode(hf, prompt: list[int], tokens: int) -> float:  # noqa: ANN001
    """Decode tokens/s after the first token: time(tokens) - time(1), over tokens - 1."""
    ids = torch.tensor([prompt])
    cfg1 = _gen_config(hf, min_new_tokens=1)
    cfg1.max_new_tokens = 1
    first = _timed(lambda: hf.generate(input_ids=ids, generation_config=cfg1))
    cfg = _gen_config(hf)
    cfg.max_new_tokens = tokens
    total = _timed(lambda: hf.generate(input_ids=ids, generation_config=cfg))
    return (tokens - 1) / (total - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    path = registry.fetch(NAME)
    model, tok = il.load(NAME, device="cpu", dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    prompts = workload_prompts(model.config.vocab_size)
    decode_prompt = prompts[0][:32]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # per token a decode step reads every matrix once; of the (tied) embedding, one row as input
    # and all of it as the output head, so it counts once.
    runs: dict[str, list[float]] = {k: [] for k in (
        "ours", "hf_generate_batch", "hf_padded_generate", "ours_b1", "hf_b1", "copy_bw")}
    steps = {
        "copy_bw": copy_bandwidth,
        "ours": lambda: ours_throughput(model, tok, prompts),
        "hf_generate_batch": lambda: hf_generate_batch(hf, prompts),
        "hf_padded_generate": lambda: hf_padded_generate(hf, prompts),
        "ours_b1": lambda: ours_batch1_decode(model, tok, decode_prompt, args.decode_tokens),
        "hf_b1": lambda: hf_batch1_decode(hf, decode_prompt, args.decode_tokens),
    }
    for rep in range(args.repeats):
        for key, fn in [*steps.items(), ("copy_bw", copy_bandwidth)]:
            start = time.perf_counter()
            runs[key].append(fn())
            took = time.perf_counter() - start
            print(f"  run {rep + 1}: {key} = {runs[key][-1]:.4g} ({took:.0f} s)", file=sys.stderr,
                  flush=True)
    best = {k: max(v) for k, v in runs.items()}
    bound = best["copy_bw"] / weight_bytes
    rows = [
        dict(what="infer_lab LLM.generate", tok_s=best["ours"], ratio=1.0),
        dict(what="transformers generate_batch", tok_s=best["hf_generate_batch"],
             ratio=best["ours"] / best["hf_generate_batch"]),
        dict(what="transformers padded generate", tok_s=best["hf_padded_generate"],
             ratio=best["ours"] / best["hf_padded_generate"]),
        dict(what="infer_lab batch-1 decode", tok_s=best["ours_b1"],
             ratio=best["ours_b1"] / bound),
        dict(what="transformers batch-1 decode", tok_s=best["hf_b1"],
             ratio=best["hf_b1"] / bound),
        dict(what="bandwidth bound (batch 1)", tok_s=bound, ratio=1.0),
    ]
    print(f"workload: {WORKLOAD}; {args.threads} thread(s); best of {args.repeats}")
    print(f"copy bandwidth {best['copy_bw'] / 1e9:.2f} GB/s; weights {weight_bytes / 1e6:.0f} MB "
          f"per decode step (fp32)")
    print("ratio: ours / peer for throughput rows; tok/s / bound for the decode rows")
    print_table(rows, ["what", "tok_s", "ratio"])
    payload = dict(
        provenance("cpu"), model=NAME, dtype="float32", workload=WORKLOAD, threads=args.threads,
        repeats=args.repeats, runs=runs, weight_bytes=weight_bytes,
        copy_bandwidth_gb_s=best["copy_bw"] / 1e9, bandwidth_bound_tok_s=bound,
        throughput_tok_s=dict(ours=best["ours"], hf_generate_batch=best["hf_generate_batch"],
                              hf_padded_generate=best["hf_padded_generate"]),
        ratio_vs_generate_batch=best["ours"] / best["hf_generate_batch"],
        ratio_vs_padded_generate=best["ours"] / best["hf_padded_generate"],
        batch1_decode_tok_s=dict(ours=best["ours_b1"], hf=best["hf_b1"]),
        batch1_fraction_of_bound=dict(ours=best["ours_b1"] / bound, hf=best["hf_b1"] / bound),
        targets=dict(vs_generate_batch=2.0, vs_padded_generate=1.5, batch1_fraction_of_bound=0.6),
    )
    keep = {}  # the sections other scripts write (peers_server: server; cpu_paths: cpu_paths)
    old = (Path(args.out) if args.out else RESULTS) / "peers.json"
    if old.is_file():
        keep = {k: v for k, v in json.loads(old.read_text()).items()
                if k in ("server", "cpu_paths")}
    print(f"wrote {write_results('peers', payload | keep, args.out)}")


if __name__ == "__main__":
    main()
