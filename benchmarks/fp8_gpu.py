"""FP8 matmuls on a GPU (device_check.sh's ``fp8`` step): ``torch._scaled_mm`` against bf16.

Chapter 8b predicts FP8's prefill speed from the datasheet (twice the 16-bit rate on Hopper);
this measures it. For the linear layers of SmolLM2-135M, Llama-3.2-1B and Llama-3-8B (fused
q/k/v, o, fused gate/up, down, LM head) at 1, 16, 256 and 4096 rows of activations (decode to
prefill), it times:

- bf16 ``torch.mm(x, w.T)``;
- ``torch._scaled_mm`` with E4M3 weights *and* activations, bf16 output, default (not fast)
  accumulation, at the scale granularities torch has on sm_90: per tensor (a scalar float32
  scale each; cuBLAS) and per row, ``"channel"`` here (activations ``[M, 1]`` per token, weights
  ``[1, N]`` per output channel; torch's rowwise path, which takes bf16 output only before
  cuBLAS 12.9). Per-block scales (DeepSeek-V3's 128x128) need cuBLAS 12.9's blockwise path and a
  scale layout this script does not set up: not timed.

The FP8 operands are the package's own encoder's (:func:`infer_lab.model.quant.fp8.quantize_fp8`)
codes viewed as ``torch.float8_e4m3fn``, quantized before timing (the activation's quantization
is not in the time; a real layer pays it). Each row checks:

- ``codes_match_torch``: torch's own cast of ``x / scale`` to ``float8_e4m3fn`` gives the
  encoder's codes, bit for bit, for both operands;
- ``rel_err``: ``max|out - ref| / max|ref|`` where ``ref`` is the float32 product of the
  dequantized operands, at most ``TOL`` (1e-2: the bf16 output alone rounds each value by up
  to 2^-9 of itself; torch's own test allows 7e-2).

Operands are random normal (the weight times ``K**-0.5``), drawn on the device. Timing: CUDA
events around each call (so at 1 row a call's launch is in its time, as in a decode step),
``--warmup`` calls first, the median of ``--repeats``; TFLOP/s from ``2 M N K`` and
``speedup`` = bf16 time / FP8 time; per model and row count, the geometric mean of the speedups
over its layers. Rows are written to
``fp8_gpu.json`` as each model finishes (commit it under ``benchmarks/results/gpu/``). The exit
status is 1 if any check fails (an unsupported granularity is recorded, not a failure).

``--dry-run`` runs the same code on the CPU (torch 2.13's ``_scaled_mm`` has a CPU kernel for
both granularities; where a torch has none, only the quantize/reference path runs and the JSON
says so) at SmolLM2's layer shapes and 1 and 16 rows, in seconds; the CPU times are wall-clock
(``perf_counter``) and say nothing about a GPU.

    python -m benchmarks.fp8_gpu [--models smollm2-135m llama-3.2-1b llama-3-8b]
        [--rows 1 16 256 4096] [--repeats 20] [--warmup 3] [--out DIR] [--dry-run]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import RESULTS, print_table, provenance, write_results
from infer_lab.model.quant.fp8 import FP8Tensor, quantize_fp8

FMT = "fp8_e4m3"
GRANULARITIES = ("tensor", "channel")
TOL = 1e-2
ROWS = (1, 16, 256, 4096)
DRY_ROWS = (1, 16)

# (hidden, intermediate, attention heads, KV heads, head_dim, vocab) as published:
# SmolLM2-135M's GGUF metadata, Llama-3.2-1B's and Llama-3-8B's config.json.
MODELS: dict[str, tuple[int, int, int, int, int, int]] = {
    "smollm2-135m": (576, 1536, 9, 3, 64, 49152),
    "llama-3.2-1b": (2048, 8192, 32, 8, 64, 128256),
    "llama-3-8b": (4096, 14336, 32, 8, 128, 128256),
}


def linear_shapes(model: str, lm_head: bool = True) -> list[tuple[str, int, int]]:
    """``(layer, N, K)`` of a Llama-style model's matmuls, ``w`` being ``[N, K]``."""
    h, inter, heads, kv, hd, vocab = MODELS[model]
    shapes = [("qkv", (heads + 2 * kv) * hd, h), ("o", h, heads * hd),
              ("gate_up", 2 * inter, h), ("down", h, inter)]
    return shapes + [("lm_head", vocab, h)] if lm_head else shapes


def scaled_mm_args(q: FP8Tensor, operand: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder's codes as float8_e4m3fn and their scale in ``_scaled_mm``'s layout.

    ``operand`` is ``"a"`` (activations ``[M, K]``, row scales ``[M, 1]``) or ``"b"`` (the
    weight ``[N, K]`` passed transposed, column-major ``[K, N]``, column scales ``[1, N]``).
    """
    codes = q.codes.view(torch.float8_e4m3fn)
    scale = q.scale.float()
    if q.granularity == "channel":
        scale = scale[:, None] if operand == "a" else scale[None, :]
    return (codes if operand == "a" else codes.t()), scale.contiguous()


def codes_match_torch(t: torch.Tensor, q: FP8Tensor) -> bool:
    """Whether torch's cast of ``t / scale`` to float8_e4m3fn gives the encoder's codes."""
    scale = q.scale.float() if q.granularity == "tensor" else q.scale.float()[:, None]
    cast = (t.float() / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    return bool(torch.equal(cast, q.codes))


def has_scaled_mm(device: torch.device) -> bool:
    """Whether this torch runs ``_scaled_mm`` on ``device`` (CPU kernels are recent)."""
    a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def time_ms(fn: Callable[[], torch.Tensor], device: torch.device, warmup: int,
            repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` calls: CUDA events on a GPU, else
    ``perf_counter``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def fp8_check(x: torch.Tensor, w: torch.Tensor, qx: FP8Tensor, qw: FP8Tensor,
              run: bool) -> tuple[dict[str, Any], Callable[[], torch.Tensor] | None]:
    """One granularity's checks (and, when ``run``, its ``_scaled_mm`` call for timing)."""
    ref = qx.dequantize("activation") @ qw.dequantize("weight").t()
    row: dict[str, Any] = {"codes_match_torch": codes_match_torch(x, qx)
                           and codes_match_torch(w, qw)}
    if not run:
        return row, None
    a, sa = scaled_mm_args(qx, "a")
    b, sb = scaled_mm_args(qw, "b")

    def call() -> torch.Tensor:
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    try:
        out = call().float()
    except (RuntimeError, NotImplementedError) as e:
        return {**row, "error": f"{type(e).__name__}: {e}"[:300]}, None
    row["rel_err"] = float((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
    return row, call


def measure_shape(model: str, layer: str, n: int, k: int, rows: tuple[int, ...],
                  args: argparse.Namespace, gen: torch.Generator) -> list[dict[str, Any]]:
    """Every row count of one ``[N, K]`` weight: bf16 and each FP8 granularity."""
    dev = args.device
    w = torch.randn(n, k, generator=gen, device=dev) * k ** -0.5
    qws = {g: quantize_fp8(w, FMT, g, name=f"{model}.{layer}") for g in GRANULARITIES}
    w16 = w.bfloat16()
    out = []
    for m in rows:
        x = torch.randn(m, k, generator=gen, device=dev)
        x16 = x.bfloat16()
        t16 = time_ms(partial(torch.mm, x16, w16.t()), dev, args.warmup, args.repeats)
        flop = 2 * m * n * k
        row: dict[str, Any] = {"model": model, "layer": layer, "m": m, "n": n, "k": k,
                               "bf16_ms": t16, "bf16_tflops": flop / t16 / 1e9}
        for g in GRANULARITIES:
            qx = quantize_fp8(x, FMT, g, name="activation")
            check, call = fp8_check(x, w, qx, qws[g], args.scaled_mm)
            row.update({f"{key}_{g}": v for key, v in check.items()})
            if call is not None:
                t8 = time_ms(call, dev, args.warmup, args.repeats)
                row.update({f"fp8_{g}_ms": t8, f"fp8_{g}_tflops": flop / t8 / 1e9,
                            f"speedup_{g}": t16 / t8})
        out.append(row)
    return out


def row_ok(row: dict[str, Any]) -> bool:
    """A row's checks all pass (an unsupported granularity's error is not a failure)."""
    return all(row[f"codes_match_torch_{g}"]
               and row.get(f"rel_err_{g}", 0.0) <= TOL for g in GRANULARITIES)


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per model and row count, the geometric mean over layers of each granularity's speedup."""
    out: dict[str, Any] = {}
    for r in rows:
        for g in GRANULARITIES:
            if f"speedup_{g}" in r:
                out.setdefault(r["model"], {}).setdefault(str(r["m"]), {}).setdefault(
                    g, []).append(r[f"speedup_{g}"])
    return {mod: {m: {g: math.exp(statistics.fmean(map(math.log, v))) for g, v in gs.items()}
                  for m, gs in ms.items()} for mod, ms in out.items()}


def payload(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    mode = ("gpu" if args.device.type == "cuda" else
            "cpu_dry_run" if args.scaled_mm else "cpu_reference_only")
    return {
        "provenance": provenance(str(args.device)),
        "mode": mode,
        "scaled_mm_ran": args.scaled_mm,
        "note": ("" if args.scaled_mm else "this torch has no _scaled_mm on this device: only "
                 "the quantize and reference path ran, nothing is timed in FP8"),
        "settings": {"format": FMT, "granularities": list(GRANULARITIES),
                     "out_dtype": "bfloat16", "use_fast_accum": False, "tolerance": TOL,
                     "rows": list(args.rows), "models": args.models, "lm_head": args.lm_head,
                     "repeats": args.repeats, "warmup": args.warmup,
                     "timer": "cuda events" if args.device.type == "cuda" else "perf_counter",
                     "activation_quantization_timed": False},
        "load_average_1min": [args.load_before, os.getloadavg()[0]],
        "rows": rows,
        "summary_speedup_geomean": summary(rows),
        "all_checks_pass": all(row_ok(r) for r in rows),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=None)
    p.add_argument("--rows", nargs="+", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--dry-run", action="store_true",
                   help="on the CPU, SmolLM2's layers (no LM head), rows 1 and 16")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    args.device = torch.device("cpu" if dry else "cuda")
    args.models = args.models or (["smollm2-135m"] if dry else list(MODELS))
    args.rows = tuple(args.rows or (DRY_ROWS if dry else ROWS))
    args.repeats = args.repeats or (2 if dry else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if dry else 3)
    args.lm_head = not dry
    args.out = args.out or (Path(tempfile.gettempdir()) / "infer_lab_fp8_dry_run" if dry
                            else RESULTS / "gpu")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.load_before = os.getloadavg()[0]
    args.scaled_mm = has_scaled_mm(args.device)
    if not args.scaled_mm:
        print(f"torch {torch.__version__} has no _scaled_mm on {args.device}: "
              "the quantize/reference path only")
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference in full float32
    gen = torch.Generator(device=args.device).manual_seed(0)
    rows: list[dict[str, Any]] = []
    for model in args.models:
        for layer, n, k in linear_shapes(model, args.lm_head):
            rows += measure_shape(model, layer, n, k, args.rows, args, gen)
            if args.device.type == "cuda":
                torch.cuda.empty_cache()
        path = write_results("fp8_gpu", payload(args, rows), args.out)
    cols = ["model", "layer", "m", "n", "k", "bf16_tflops"] + [
        c for g in GRANULARITIES for c in (f"fp8_{g}_tflops", f"speedup_{g}", f"rel_err_{g}")
        if all(c in r for r in rows)]
    print_table(rows, cols)
    for r in rows:
        for g in GRANULARITIES:
            if f"error_{g}" in r:
                print(f"{r['model']} {r['layer']} m={r['m']} {g}: {r[f'error_{g}']}")
    ok = all(row_ok(r) for r in rows)
    print("wrote", path, "| checks:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
