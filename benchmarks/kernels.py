"""Achieved bandwidth of each Triton kernel against eager torch and the measured copy bandwidth.

Every kernel here is memory-bound except prefill attention, so the figure of merit is GB/s (bytes
that must be read and written at least once, divided by the time) as a fraction of a plain
device-to-device copy, the practical ceiling; prefill attention is reported in TFLOP/s. Each row
also gives the speed-up over eager torch doing the same job (the references in
``infer_lab.kernels.reference``; for paged attention a gather of the pages followed by PyTorch's
``scaled_dot_product_attention``). SDPA over contiguous K/V, with no paging at all, is shown as a
reference ceiling.

Shapes follow Llama-3-8B: 32 query heads, 8 KV heads, head_dim 128, hidden 4096, intermediate
14336, bf16, pages of 16 tokens. On a GPU timing uses ``triton.testing.do_bench``. Without a GPU
it runs a *CPU smoke test* instead: toy sizes through Triton's interpreter, to prove the script
runs; those numbers say nothing about performance.

    python -m benchmarks.kernels [--cpu-smoke] [--out DIR]

On a GPU it writes ``results/gpu/kernels.json`` (device results are committed under
``benchmarks/results/gpu/``, where Chapter 4 reads them); the CPU smoke test writes
``results/kernels_cpu_smoke.json``. ``--out DIR`` writes to DIR instead (device_check.sh's $OUT).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks._common import RESULTS, print_table, provenance, write_results
from infer_lab import kernels
from infer_lab.cache import build_paged_batch
from infer_lab.kernels.reference import rms_norm_ref, rope_ref, silu_and_mul_ref, store_kv_ref
from infer_lab.measure import measure_copy_bandwidth, time_fn

HQ, HKV, D, HIDDEN, INTER, BLOCK = 32, 8, 128, 4096, 14336, 16
TARGETS = {"rms_norm": 0.80, "silu_and_mul": 0.80, "decode": 0.70}  # of copy bandwidth


def bench(fn: Callable[[], Any], gpu: bool) -> float:
    """Seconds per call: do_bench's median on a GPU, a plain median of 2 runs on CPU."""
    if gpu:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    return time_fn(fn, repeats=2, warmup=1)


def make_paged(batch: int, context: int, dtype: torch.dtype, device: str, heads: tuple[int, ...],
               q_len: int = 1):
    """A cache holding ``batch`` sequences of ``context`` tokens in shuffled pages."""
    hq, hkv, d = heads
    per_seq = math.ceil(context / BLOCK)
    blocks = batch * per_seq
    kc = torch.randn(blocks, BLOCK, hkv, d, dtype=dtype, device=device)
    vc = torch.randn_like(kc)
    order = torch.randperm(blocks).tolist()
    spec = [([0] * q_len, context - q_len, order[b * per_seq:(b + 1) * per_seq])
            for b in range(batch)]
    pb = build_paged_batch(spec, BLOCK, blocks, device)
    q = torch.randn(pb.num_tokens, hq, d, dtype=dtype, device=device)
    return q, kc, vc, pb


def eager_paged_decode(q, kc, vc, pb, context):
    """What eager torch does without a paged kernel: gather the pages, then SDPA."""
    k = kc[pb.block_tables].flatten(1, 2)[:, :context].transpose(1, 2)  # [B, Hkv, ctx, D]
    v = vc[pb.block_tables].flatten(1, 2)[:, :context].transpose(1, 2)
    return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)


def eager_paged_prefill(q, kc, vc, pb, seq):
    b = pb.num_seqs
    k = kc[pb.block_tables].flatten(1, 2)[:, :seq].transpose(1, 2)
    v = vc[pb.block_tables].flatten(1, 2)[:, :seq].transpose(1, 2)
    qb = q.view(b, seq, *q.shape[1:]).transpose(1, 2)
    return F.scaled_dot_product_attention(qb, k, v, is_causal=True, enable_gqa=True)


def run(gpu: bool, dtype: torch.dtype) -> tuple[list[dict[str, Any]], float]:
    dev = "cuda" if gpu else "cpu"
    mod = kernels.triton_module("triton_attention")
    size = dtype.itemsize
    copy_bw = measure_copy_bandwidth(dev, 2**30 if gpu else 2**22)
    rows: list[dict[str, Any]] = []

    def add(kernel: str, shape: str, nbytes: float, ours: Callable, eager: Callable | None,
            flops: float = 0.0, ceiling: Callable | None = None) -> None:
        t = bench(ours, gpu)
        t_eager = bench(eager, gpu) if eager else float("nan")
        t_ceil = bench(ceiling, gpu) if ceiling else float("nan")
        row = {"kernel": kernel, "shape": shape, "us": t * 1e6, "GB/s": nbytes / t / 1e9,
               "of_copy": nbytes / t / copy_bw, "eager_us": t_eager * 1e6,
               "speedup": t_eager / t, "sdpa_contig_us": t_ceil * 1e6}
        if flops:
            row["TFLOP/s"] = flops / t / 1e12
        target = TARGETS.get(kernel.split("(")[0])
        row["target"] = f">={target:.0%}" if target else ""
        rows.append(row)

    heads = (HQ, HKV, D) if gpu else (4, 2, 16)  # toy head shapes for the CPU smoke test
    hq, hkv, d = heads
    for tokens in ([512, 4096, 16384] if gpu else [3]):
        hidden = HIDDEN if gpu else 64
        inter = INTER if gpu else 96
        x, r = (torch.randn(tokens, hidden, dtype=dtype, device=dev) for _ in range(2))
        w = torch.randn(hidden, dtype=dtype, device=dev)
        add("rms_norm", f"{tokens}x{hidden} +res", (4 * tokens * hidden + hidden) * size,
            lambda x=x, r=r, w=w: kernels.rms_norm(x, w, 1e-5, r, backend="triton"),
            lambda x=x, r=r, w=w: rms_norm_ref(x, w, 1e-5, r))
        g = torch.randn(tokens, 2 * inter, dtype=dtype, device=dev)
        add("silu_and_mul", f"{tokens}x{2 * inter}", 3 * tokens * inter * size,
            lambda g=g: kernels.silu_and_mul(g, backend="triton"),
            lambda g=g: silu_and_mul_ref(g))
        q = torch.randn(tokens, hq, d, dtype=dtype, device=dev)
        k = torch.randn(tokens, hkv, d, dtype=dtype, device=dev)
        pos = torch.randint(0, 8192, (tokens,), device=dev)
        inv = 1.0 / 500000 ** (torch.arange(0, d, 2, device=dev) / d)
        add("rope", f"{tokens} tok", 2 * tokens * (hq + hkv) * d * size + 8 * tokens,
            lambda q=q, k=k, pos=pos, inv=inv: kernels.apply_rope(q, k, pos, inv,
                                                                    backend="triton"),
            lambda q=q, k=k, pos=pos, inv=inv: rope_ref(q, k, pos, inv))
        kc = torch.zeros(math.ceil(tokens / BLOCK) + 1, BLOCK, hkv, d, dtype=dtype, device=dev)
        vc = torch.zeros_like(kc)
        slots = torch.randperm(kc.shape[0] * BLOCK, device=dev)[:tokens]
        add("store_kv", f"{tokens} tok", 4 * tokens * hkv * d * size + 8 * tokens,
            lambda k=k, kc=kc, vc=vc, s=slots: kernels.store_kv(k, k, kc, vc, s,
                                                                backend="triton"),
            lambda k=k, kc=kc, vc=vc, s=slots: store_kv_ref(k, k, kc, vc, s))

    decode_shapes = ([(1, 8192), (4, 8192), (16, 2048), (16, 8192), (64, 8192), (16, 32768)]
                     if gpu else [(2, 40)])
    for batch, context in decode_shapes:
        q, kc, vc, pb = make_paged(batch, context, dtype, dev, heads)
        nbytes = 2 * batch * context * hkv * d * size + 2 * q.numel() * size
        k_contig = torch.randn(batch, hkv, context, d, dtype=dtype, device=dev)
        ceiling = (lambda q=q, k=k_contig: F.scaled_dot_product_attention(
            q[:, :, None], k, k, enable_gqa=True))
        for name, splits in (("decode(one-pass)", 1), ("decode(split-k)", None if gpu else 3)):
            add(name, f"B={batch} ctx={context}", nbytes,
                lambda q=q, kc=kc, vc=vc, pb=pb, splits=splits: mod.paged_decode_attention_triton(
                    q, kc, vc, pb.block_tables, pb.context_lens, num_splits=splits),
                lambda q=q, kc=kc, vc=vc, pb=pb, n=context: eager_paged_decode(q, kc, vc, pb, n),
                ceiling=ceiling)
        del q, kc, vc, pb, k_contig

    for batch, seq in ([(1, 4096), (4, 2048), (16, 1024)] if gpu else [(2, 24)]):
        q, kc, vc, pb = make_paged(batch, seq, dtype, dev, heads, q_len=seq)
        flops = 4 * batch * hq * d * seq * (seq + 1) / 2  # QK^T and PV over the causal half
        nbytes = 2 * batch * seq * (hq + hkv) * d * size
        qc = q.view(batch, seq, hq, d).transpose(1, 2)
        kcont = torch.randn(batch, hkv, seq, d, dtype=dtype, device=dev)
        add("prefill", f"B={batch} seq={seq}", nbytes,
            lambda q=q, kc=kc, vc=vc, pb=pb, n=seq: mod.paged_prefill_attention_triton(
                q, kc, vc, pb.block_tables, pb.context_lens, pb.cu_seqlens_q, max_query_len=n),
            lambda q=q, kc=kc, vc=vc, pb=pb, n=seq: eager_paged_prefill(q, kc, vc, pb, n),
            flops=flops,
            ceiling=lambda qc=qc, k=kcont: F.scaled_dot_product_attention(
                qc, k, k, is_causal=True, enable_gqa=True))
        del q, kc, vc, pb
    return rows, copy_bw


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """Which of the issue's targets the measured rows meet (GPU only)."""
    out = []
    for r in rows:
        name = r["kernel"].split("(")[0]
        ctx = r["shape"].split("ctx=")[-1] if "ctx=" in r["shape"] else ""
        batch = int(r["shape"].split("B=")[1].split()[0]) if "B=" in r["shape"] else 0
        if name == "decode" and not (int(ctx) >= 8192 and batch >= 16):
            continue
        if name in TARGETS:
            ok = r["of_copy"] >= TARGETS[name] and r["speedup"] > 1
            out.append(f"{'MET ' if ok else 'MISS'} {r['kernel']} {r['shape']}: "
                       f"{r['of_copy']:.0%} of copy (target {TARGETS[name]:.0%}), "
                       f"{r['speedup']:.2f}x eager")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="toy sizes through the interpreter (automatic without a GPU)")
    ap.add_argument("--out", type=Path, default=None,
                    help="directory for the JSON (default: results/gpu/ on a GPU, results/ on CPU)")
    args = ap.parse_args(argv)
    if not kernels.triton_available():
        raise SystemExit("Triton is not installed: nothing to benchmark")
    gpu = torch.cuda.is_available() and not args.cpu_smoke
    if not gpu:
        print("CPU smoke test: no GPU (or --cpu-smoke), so toy sizes through Triton's interpreter;"
              " the numbers below only prove that the script runs.")
    if not gpu and torch.cuda.is_available():
        raise SystemExit("--cpu-smoke needs a machine without CUDA (the kernels are compiled "
                         "for the GPU here); run it with CUDA_VISIBLE_DEVICES=")
    dtype = torch.bfloat16 if gpu else torch.float32
    torch.manual_seed(0)
    with torch.inference_mode():
        rows, copy_bw = run(gpu, dtype)
    print(f"copy bandwidth (the ceiling): {copy_bw / 1e9:.0f} GB/s; dtype {dtype}")
    cols = ["kernel", "shape", "us", "GB/s", "of_copy", "eager_us", "speedup", "sdpa_contig_us",
            "target"]
    print_table([{**r, "target": r.get("target", "")} for r in rows], cols)
    for r in rows:
        if "TFLOP/s" in r:
            print(f"prefill {r['shape']}: {r['TFLOP/s']:.1f} TFLOP/s")
    checks = verdicts(rows) if gpu else []
    for line in checks:
        print(line)
    payload = {**provenance("cuda" if gpu else "cpu"), "mode": "gpu" if gpu else "cpu-smoke",
               "dtype": str(dtype), "copy_bandwidth": copy_bw, "rows": rows, "targets": checks}
    out = args.out or (RESULTS / "gpu" if gpu else RESULTS)
    print("wrote", write_results("kernels" if gpu else "kernels_cpu_smoke", payload, out))


if __name__ == "__main__":
    main()
