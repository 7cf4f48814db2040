"""Quantization, measured (Chapter 8): bytes, quality and decode speed per weight format.

For the bundled model (tiny-kjv) and SmolLM2-135M-Instruct, in fp32, bf16, int8, int4 (groups of
32) and, for SmolLM2, ``gguf`` (the file's own Q4_1/Q8_0 blocks):

- weight bytes, every parameter and buffer counted (the RoPE table excepted);
- perplexity of a stated held-out text with a sliding window (``--window``, stride half of it):
  the KJV passage of :data:`infer_lab.measure.quality.KJV_PASSAGE` for the bundled model, the
  first ``--ppl-tokens`` tokens of this repository's ``book/architecture.md`` (written after
  SmolLM2 was trained) for SmolLM2;
- greedy agreement with the fp32 model over ``--agree-tokens`` tokens (teacher-forced top-1):
  a smoke check, not a verdict (two prompts' few tokens see too little of a format). Chapter 8
  judges the formats by KL divergence from fp32 over held-out text: live on the bundled model,
  and for SmolLM2 from ``benchmarks/cpu_paths.py`` (``peers.json``) and
  ``benchmarks/quant_formats.py``;
- decode tokens/s at batch 1 and 32: ``--steps`` decode steps through the paged cache after a
  ``--context``-token prefill per sequence, median step time;
- ratios against fp32.

Then the KV cache: tokens that fit in the same memory at 16 bits, int8 (+ scales) and fp8.

And ``quantization_kernels.json``: the CPU matmul paths at SmolLM2's shapes (q/k/v, o, gate/up,
down, LM head) for 1 and 32 rows: dense fp32 and bf16, ``_weight_int8pack_mm`` and
``_weight_int4pack_mm_for_cpu`` each with fp32 and with bf16 activations, the grouped int8 of
Q8_0, and dequantize-then-matmul. Medians of interleaved repeats with the fastest and slowest
repeat, the clock and the load average; one torch thread unless ``--threads``; ``--only
kernels`` writes this file alone.

``--only speed`` (``quantization_speed.json``) measures decode speed alone, better than the main
run's one pass: ``--rounds`` interleaved rounds (every format timed once per round, ratios to fp32
within a round, median and range over rounds); ``--clock cpu`` times by this process's CPU time,
which on a shared machine leaves out the time a one-thread run waits for a core.

    python -m benchmarks.quantization [--models tiny-kjv smollm2-135m-instruct] [--threads 1]
    python -m benchmarks.quantization --only speed --models smollm2-135m-instruct --clock cpu
    python -m benchmarks.quantization --only kernels --kernel-repeats 9 --clock cpu
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import infer_lab as il
from benchmarks._common import print_table, provenance, write_results
from infer_lab.cache import build_paged_batch
from infer_lab.cache.kv_quant import kv_storage_bytes
from infer_lab.cache.paged import PagedAttentionContext, PagedKVCache
from infer_lab.kernels import quant as qk
from infer_lab.measure.quality import KJV_PASSAGE, greedy_agreement, perplexity
from infer_lab.model.quantize import (
    QuantizedLinear,
    model_weight_bytes,
    quantize_int4,
    quantize_int8,
    quantize_model,
)
from infer_lab.model.random import llama_config

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = "smollm2-135m-instruct"


def median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


# ---------------------------------------------------------------------------- kernels
def kernel_paths(repeats: int, clock: Callable[[], float] = time.perf_counter) -> list[dict]:
    """Each CPU matmul path at SmolLM2's shapes, interleaved repeat by repeat (by ``clock``):
    the median time of each, its fastest and slowest repeat, the speedup of the medians, and
    every repeat's time in order (``us_each``: repeat i of two paths ran back to back)."""
    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
              "lm_head": (49152, 576)}
    rows_out = []
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, generator=gen) * 0.02
        wb = w.bfloat16()
        q8, s8 = quantize_int8(w)
        s8b = s8.bfloat16()
        int4 = QuantizedLinear.from_linear(_linear(w), "int4", 32)
        qk.int4_cpu_pack(int4, torch.float32), qk.int4_cpu_pack(int4, torch.bfloat16)
        # Q8_0-like: int8 codes with a scale per group of 32, group-major
        groups = k // 32
        q8g = QuantizedLinear("int8g", {
            "qweight": q8.view(n, groups, 32).permute(1, 0, 2).contiguous(),
            "scale": s8[:, None].expand(n, groups).half().contiguous()}, k, n, None, 32)
        p4, sc4, mn4 = quantize_int4(w, 32)
        for m in (1, 32):
            x = torch.randn(m, k, generator=gen)
            xb = x.bfloat16()
            paths: dict[str, Callable[[], object]] = {
                "fp32 dense": lambda x=x, w=w: F.linear(x, w),
                "bf16 dense": lambda xb=xb, wb=wb: F.linear(xb, wb),
                "int8pack fp32 act": lambda x=x, q=q8, s=s8:
                    torch.ops.aten._weight_int8pack_mm(x, q, s),
                "int8pack bf16 act": lambda x=x, q=q8, s=s8b:
                    torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q, s).float(),
                "int4pack fp32 act (g32)": lambda x=x, layer=int4:
                    qk.int4_linear_cpu(x, layer, torch.float32),
                "int4pack bf16 act (g32)": lambda x=x, layer=int4:
                    qk.int4_linear_cpu(x, layer, torch.bfloat16),
                "int8 g32 (Q8_0) per-group calls": lambda x=x, layer=q8g:
                    qk.int8g_linear_cpu(x, layer),
                "int4 dequantize+matmul": lambda x=x, layer=int4: qk.quant_linear_ref(x, layer),
            }
            times: dict[str, list[float]] = {p: [] for p in paths}
            for fn in paths.values():
                fn()
            for _ in range(repeats):
                for p, fn in paths.items():
                    t0 = clock()
                    fn()
                    times[p].append(clock() - t0)
            base = statistics.median(times["fp32 dense"])
            for p, ts in times.items():
                t = statistics.median(ts)
                rows_out.append(dict(layer=name, n=n, k=k, rows=m, path=p, us=t * 1e6,
                                     us_lo=min(ts) * 1e6, us_hi=max(ts) * 1e6,
                                     repeats=repeats, speedup_vs_fp32=base / t,
                                     us_each=[round(x * 1e6, 1) for x in ts]))
            print(f"  kernels {name} x {m} rows (load average {os.getloadavg()[0]:.2f})",
                  flush=True)
        del p4, sc4, mn4
    return rows_out


def _linear(w: torch.Tensor) -> torch.nn.Linear:
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    return lin


def gpu_kernels() -> list[dict]:
    """The Triton W8A16 / W4A16 kernels on CUDA at Llama-3-8B's MLP shapes: GB/s on the bytes
    each reads (codes, scales, activations, output), against the device's copy bandwidth.
    Target on an H200: the W4A16 GEMV at 70 % of copy bandwidth or more."""
    from infer_lab.kernels import triton_module
    from infer_lab.measure.roofline import measure_copy_bandwidth
    from infer_lab.measure.timing import time_fn

    tq = triton_module("triton_quant")
    copy_bw = measure_copy_bandwidth("cuda")
    rows = []
    for n, k in ((14336, 4096), (4096, 14336), (28672, 4096)):
        lin = torch.nn.Linear(k, n, bias=False, device="cuda")
        for fmt in ("int8", "int4"):
            layer = QuantizedLinear.from_linear(lin, fmt, 128 if fmt == "int4" else 32)
            for m in (1, 16, 256):
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                if fmt == "int8":
                    fn = lambda x=x, ly=layer: tq.w8_linear(x, ly.qweight, ly.scale)  # noqa: E731
                else:
                    fn = lambda x=x, ly=layer: tq.w4_linear(  # noqa: E731
                        x, ly.qweight, ly.scale, ly.minimum, ly.group_size)
                seconds = time_fn(fn, repeats=20, device="cuda")
                nbytes = layer.weight_bytes + x.numel() * 2 + m * n * 2
                rows.append(dict(fmt=fmt, n=n, k=k, rows=m, us=seconds * 1e6,
                                 gb_s=nbytes / seconds / 1e9,
                                 of_copy=nbytes / seconds / copy_bw,
                                 tflops=2 * m * n * k / seconds / 1e12))
    return rows


# ---------------------------------------------------------------------------- decode


@torch.inference_mode()
def decode_tokens_per_s(model: torch.nn.Module, batch: int, context: int, steps: int,
                        clock: Callable[[], float] = time.perf_counter) -> float:
    """Decode throughput of ``batch`` sequences (``context``-token prompts) through the paged
    cache: the median step time over ``steps`` steps (by ``clock``), as tokens per second."""
    cfg, bs = model.config, 16
    per_seq = -(-(context + steps + 2) // bs)
    cache = PagedKVCache(cfg, batch * per_seq, bs, model.device, model.dtype)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, cfg.vocab_size, (batch, context), generator=gen).tolist()
    pb = build_paged_batch([(p, 0, t) for p, t in zip(prompts, tables, strict=True)], bs,
                           cache.num_blocks, model.device)
    nxt = model(pb.input_ids, pb.positions, PagedAttentionContext(cache, pb)).argmax(-1).tolist()
    times = []
    for step in range(steps + 1):
        db = build_paged_batch([([t], context + step, tab) for t, tab in zip(nxt, tables,
                                                                            strict=True)],
                               bs, cache.num_blocks, model.device)
        t0 = clock()
        nxt = model(db.input_ids, db.positions, PagedAttentionContext(cache, db)).argmax(-1)
        nxt = nxt.tolist()
        if step:  # the first step warms up
            times.append(clock() - t0)
    return batch / statistics.median(times)


def speed(name: str, args: argparse.Namespace) -> dict:
    """Decode tokens/s of every format at batch 1 and 32, in ``args.rounds`` interleaved rounds
    (each round times every format once, so a change in a shared machine's load falls on all
    of them), as ratios to fp32 within the round. ``args.clock``: ``wall`` (perf_counter), or
    ``cpu`` (this process's CPU time: on a machine other jobs share, a one-thread run's CPU time
    leaves out the time it waited for a core)."""
    fp32, _ = il.load(None if name == "tiny-kjv" else name, device="cpu", dtype=torch.float32)
    models = dict(formats_for(name, fp32, gguf=name != "tiny-kjv"))
    tok_s: dict[tuple[str, int], list[float]] = {}
    load = [round(os.getloadavg()[0], 2)]
    for rnd in range(args.rounds):
        for batch in (1, 32):
            for fmt, model in models.items():
                t = decode_tokens_per_s(model, batch, args.context, args.steps,
                                        CLOCKS[args.clock])
                tok_s.setdefault((fmt, batch), []).append(t)
        load.append(round(os.getloadavg()[0], 2))
        print(f"  {name} speed round {rnd + 1}/{args.rounds} (load average {load[-1]})",
              flush=True)
    rows = []
    for (fmt, batch), values in tok_s.items():
        ratios = sorted(v / b for v, b in zip(values, tok_s["fp32", batch], strict=True))
        rows.append(dict(model=name, format=fmt, batch=batch,
                         tok_s=statistics.median(values), ratio=statistics.median(ratios),
                         ratio_lo=ratios[0], ratio_hi=ratios[-1], ratios=ratios))
    return dict(model=name, rows=rows, load_average=load)


# ---------------------------------------------------------------------------- models
def formats_for(name: str, fp32: torch.nn.Module, gguf: bool):
    """(format, model) pairs, each a fresh copy of the fp32 model (GGUF: loaded from the file)."""
    yield "fp32", fp32
    yield "bf16", copy.deepcopy(fp32).to(torch.bfloat16)
    yield "int8", quantize_model(copy.deepcopy(fp32), "int8")
    yield "int4", quantize_model(copy.deepcopy(fp32), "int4", 32)
    if gguf:
        yield "gguf", il.load(name, "cpu", torch.float32, quantization="gguf")[0]


def bench_model(name: str, args: argparse.Namespace) -> dict:
    fp32, tok = il.load(None if name == "tiny-kjv" else name, device="cpu", dtype=torch.float32)
    if name == "tiny-kjv":
        text, text_name = KJV_PASSAGE, "KJV Psalm 23 + Ecclesiastes 3:1-8"
    else:
        text = (ROOT / "book" / "architecture.md").read_text()
        text_name = "book/architecture.md of this repository (written after SmolLM2's training)"
    ids = tok.encode(text)[: args.ppl_tokens]
    prompts = [ids[:16], ids[100:116]]
    rows = []
    for fmt, model in formats_for(name, fp32, gguf=name != "tiny-kjv"):
        t0 = time.perf_counter()
        ppl = perplexity(model, ids, window=args.window)
        agree = (greedy_agreement(fp32, model, prompts, n=args.agree_tokens) if fmt != "fp32"
                 else None)
        row = dict(
            model=name, format=fmt, weight_bytes=model_weight_bytes(model),
            perplexity=ppl.perplexity, ppl_tokens=ppl.tokens,
            greedy_agreement=1.0 if agree is None else agree.teacher_forced,
            first_divergence=[args.agree_tokens] * 2 if agree is None else agree.first_divergence,
            tok_s_b1=decode_tokens_per_s(model, 1, args.context, args.steps),
            tok_s_b32=decode_tokens_per_s(model, 32, args.context, args.steps),
        )
        print(f"  {name} {fmt}: {time.perf_counter() - t0:.0f} s", flush=True)
        rows.append(row)
        if fmt != "fp32":
            del model
    base = rows[0]
    for r in rows:
        r["bytes_vs_fp32"] = r["weight_bytes"] / base["weight_bytes"]
        r["ppl_vs_fp32"] = r["perplexity"] / base["perplexity"]
        r["b1_vs_fp32"] = r["tok_s_b1"] / base["tok_s_b1"]
        r["b32_vs_fp32"] = r["tok_s_b32"] / base["tok_s_b32"]
    return dict(model=name, text=text_name, window=args.window, stride=args.window // 2,
                rows=rows)


def kv_capacity() -> list[dict]:
    """Tokens per GiB of KV cache at 16 bits, int8 (+ fp16 scales) and fp8."""
    models = {
        "tiny-kjv": il.load(device="cpu")[0].config,
        "SmolLM2-135M": llama_config(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                     num_hidden_layers=30, num_attention_heads=9,
                                     num_key_value_heads=3),
        "Llama-3-8B": llama_config(hidden_size=4096, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8),
    }
    rows = []
    for name, cfg in models.items():
        b16 = kv_storage_bytes(cfg, "auto", 2)
        for kv in ("auto", "int8", "fp8_e4m3"):
            b = kv_storage_bytes(cfg, kv, 2)
            rows.append(dict(model=name, kv_cache_dtype="bf16" if kv == "auto" else kv,
                             bytes_per_token=b, tokens_per_gib=int(2**30 // b),
                             tokens_vs_16bit=b16 / b))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny-kjv", SMOLLM2])
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--ppl-tokens", type=int, default=256)
    p.add_argument("--agree-tokens", type=int, default=8)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--kernel-repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--only", choices=("speed", "kernels"), default=None,
                   help="speed: only decode speed in interleaved rounds, with a profile of one "
                        "step per format (quantization_speed.json); kernels: only the CPU "
                        "matmul paths (quantization_kernels.json)")
    p.add_argument("--rounds", type=int, default=5, help="with --only speed")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                   help="with --only speed or kernels: wall time, or this process's CPU time")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--gpu-kernels", action="store_true",
                   help="only the Triton kernels on CUDA (benchmarks/device_check.sh)")
    args = p.parse_args()
    if args.gpu_kernels:
        rows = gpu_kernels()
        print_table(rows, ["fmt", "n", "k", "rows", "us", "gb_s", "of_copy", "tflops"])
        write_results("quantization_gpu", dict(provenance=provenance("cuda"), rows=rows),
                      args.out)
        return
    torch.set_num_threads(args.threads)
    prov = provenance("cpu")
    if args.only == "speed":
        settings = {k: v for k, v in vars(args).items() if k in ("context", "steps", "rounds",
                                                                  "threads", "clock")}
        runs = []
        for m in args.models:  # written after each model, so a slow second one loses nothing
            runs.append(speed(m, args))
            path = write_results("quantization_speed", dict(provenance=prov, settings=settings,
                                                            models=runs), args.out)
        for r in runs:
            if r["rows"]:
                print_table(r["rows"], ["model", "format", "batch", "tok_s", "ratio",
                                        "ratio_lo", "ratio_hi"])
        print(f"wrote {path}")
        return
    if args.only == "kernels" or not args.skip_kernels:
        load = [round(os.getloadavg()[0], 2)]
        krows = kernel_paths(args.kernel_repeats, CLOCKS[args.clock])
        load.append(round(os.getloadavg()[0], 2))
        print_table(krows, ["layer", "rows", "path", "us", "us_lo", "us_hi", "speedup_vs_fp32"])
        settings = dict(repeats=args.kernel_repeats, threads=args.threads, clock=args.clock,
                        load_average=load)
        path = write_results("quantization_kernels", dict(provenance=prov, settings=settings,
                                                          rows=krows), args.out)
        if args.only == "kernels":
            print(f"wrote {path}")
            return
    kv = kv_capacity()
    results = []
    for m in args.models:  # written after each model, so a slow second model loses nothing
        results.append(bench_model(m, args))
        path = write_results("quantization", dict(provenance=prov, settings=vars(args) | {
            "out": None}, models=results, kv_cache=kv), args.out)
    for r in results:
        print(f"\n{r['model']}: perplexity of {r['text']}, window {r['window']}")
        print_table(r["rows"], ["format", "weight_bytes", "bytes_vs_fp32", "perplexity",
                                "ppl_vs_fp32", "greedy_agreement", "tok_s_b1", "b1_vs_fp32",
                                "tok_s_b32", "b32_vs_fp32"])
    print()
    print_table(kv, ["model", "kv_cache_dtype", "bytes_per_token", "tokens_per_gib",
                     "tokens_vs_16bit"])
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
