"""One-row products of GGUF layers kept as int8 codes with a scale per group (Q8_0, Q5_K, Q6_K),
against the bf16 copy the CPU path makes of them and against fp32: which should decode take?

``infer_lab.kernels.quant`` computes such a layer on a CPU either with the int8 kernel once per
group (``int8g_linear_cpu``: reads the codes once, but one call and one fp32 addition of the
whole output per group) or with a bf16 copy of the dequantized weight (``dense_linear_cpu``,
made the first time the layer sees more than one row, so any layer that has been through a
prefill already holds it). The per-group calls pay a fixed cost per group, so the answer
depends on how many groups a row has (in features / group size), not only on the bytes.
Q4_K layers (int4 codes, the int4 kernel) are timed beside them.

Each row cycles through enough copies of one random matrix that even their smallest form (the
kept codes, scales and minimums) is three times the last-level cache (as a model's layers,
each read once a step; the working set of each form is recorded), one thread, and takes the
median over repeats of the CPU time per product, the variants timed in turn within each
repeat. K-quants need rows that are multiples of 256 values, which SmolLM2's 576 is not
(llama.cpp falls back to other types for such tensors), so the shapes are a 1B-class
model's; SmolLM2's tied head (49,152 x 576, Q8_0) is the first row.

    python -m benchmarks.kquant_cpu [--threads 1] [--out kquant_cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from benchmarks._common import provenance, write_results
from infer_lab.kernels import quant as kq
from infer_lab.model.quant.kquants import quantize_q4_k, quantize_q5_k, quantize_q6_k
from infer_lab.model.quantize import QuantizedLinear, gguf_block_tensors

ROWS = [("Q8_0", 49152, 576), ("Q8_0", 2048, 2048), ("Q8_0", 2048, 5632),
        ("Q6_K", 2048, 2048), ("Q6_K", 5632, 2048), ("Q6_K", 2048, 5632),
        ("Q5_K", 2048, 2048), ("Q5_K", 5632, 2048), ("Q5_K", 2048, 5632),
        ("Q4_K", 2048, 2048), ("Q4_K", 5632, 2048), ("Q4_K", 2048, 5632)]
ENCODERS = {"Q6_K": quantize_q6_k, "Q5_K": quantize_q5_k, "Q4_K": quantize_q4_k}
CYCLE_BYTES = 96 << 20  # bytes of the *smallest* form cycled: three times this machine's 32 MB L3


def blocks_layer(qtype: str, n: int, k: int, g: torch.Generator) -> QuantizedLinear:
    """A layer of ``qtype`` blocks of a random ``[n, k]`` matrix, re-laid as the loader does."""
    w = torch.randn(n, k, generator=g) * 0.02
    if qtype == "Q8_0":
        data = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    else:
        data = np.asarray(ENCODERS[qtype](w))
    fmt, tensors = gguf_block_tensors(data, qtype, n, k)
    rows, groups = tensors["scale"].shape
    return QuantizedLinear(fmt, tensors, k, rows, None, k // groups)


def stored_bytes(layer: QuantizedLinear) -> int:
    """The bytes a product of the kept layer reads: its codes, scales and minimums."""
    return sum(t.numel() * t.element_size() for t in layer.buffers())


def per_product_ms(variants: dict[str, tuple[Callable[[object], object], list]],
                   repeats: int, products: int = 32) -> dict[str, list[float]]:
    """Median over repeats of the CPU time of one product, per variant: each repeat times
    every variant in turn (so a drift of the machine falls on all of them alike), each
    sample at least ``products`` products cycling through the variant's items."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for fn, items in variants.values():  # warm: the first call of a path builds its packing
        for item in items:
            fn(item)
    for _ in range(repeats):
        for name, (fn, items) in variants.items():
            passes = -(-products // len(items))
            start = time.process_time()
            for _ in range(passes):
                for item in items:
                    fn(item)
            samples[name].append((time.process_time() - start) / (passes * len(items)) * 1e3)
    return samples


@torch.inference_mode()
def measure(qtype: str, n: int, k: int, repeats: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(n * 7 + k)
    first = blocks_layer(qtype, n, k, g)
    # enough copies that even the smallest form (the kept codes) comes from memory
    copies = max(2, -(-CYCLE_BYTES // stored_bytes(first)))
    # the copies share nothing: each its own codes, bf16 copy and fp32 weight
    layers = [first] + [blocks_layer(qtype, n, k, g) for _ in range(copies - 1)]
    x = torch.randn(1, k, generator=g)
    dense = [layer.dequantize(torch.float32) for layer in layers]
    for layer in layers:
        kq.dense_linear_cpu(x, layer)  # makes the bf16 copy, as a prefill would
    variants: dict[str, tuple[Callable[[object], object], list]] = {
        "kept_ms": (lambda ly: kq.quant_linear(x, ly), layers),
        "bf16_copy_ms": (lambda ly: kq.dense_linear_cpu(x, ly), layers),
        "fp32_ms": (lambda w: F.linear(x, w), dense),
    }
    if first.fmt == "int8g":
        variants["group_calls_ms"] = (lambda ly: kq.int8g_linear_cpu(x, ly), layers)
    samples = per_product_ms(variants, repeats)
    ws = {"kept": copies * stored_bytes(first), "bf16_copy": copies * 2 * n * k,
          "fp32": copies * 4 * n * k}
    return {"type": qtype, "shape": [n, k], "fmt": first.fmt, "group": first.group_size,
            "groups_per_row": k // first.group_size, "copies_cycled": copies,
            "working_set_mib": {v: round(b / 2**20, 1) for v, b in ws.items()},
            **{name: statistics.median(v) for name, v in samples.items()},
            "samples_ms": {name: [round(x, 4) for x in v] for name, v in samples.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="kquant_cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = list(os.getloadavg())
    rows = []
    print(f"{'type':5} {'shape':>12} {'groups':>6} {'kept':>7} {'calls':>7} {'bf16':>7} "
          f"{'fp32':>7}  (ms per one-row product, CPU time)")
    for qtype, n, k in ROWS:
        r = measure(qtype, n, k, args.repeats)
        rows.append(r)
        calls = f"{r['group_calls_ms']:7.3f}" if "group_calls_ms" in r else "      -"
        print(f"{qtype:5} {n:>6}x{k:<5} {r['groups_per_row']:>6} {r['kept_ms']:7.3f} {calls} "
              f"{r['bf16_copy_ms']:7.3f} {r['fp32_ms']:7.3f}", flush=True)
    write_results(args.out, {
        **provenance("cpu"), "threads": args.threads, "repeats": args.repeats,
        "load_average_before": load_before, "load_average_after": list(os.getloadavg()),
        "command": f"python -m benchmarks.kquant_cpu --threads {args.threads}",
        "rule": f"one row: per-group int8 calls while in_features / group <= "
                f"{kq.INT8G_GROUP_CALLS_MAX_GROUPS}, else the bf16 copy",
        "rows": rows})


if __name__ == "__main__":
    main()
