"""MKL's ``sgemm`` (``F.linear``) against oneDNN's inner product (``kernels.linear``) on a CPU.

A CPU decode step is its matmuls (``benchmarks/cpu_step.py``), and at decode's few rows the
library behind ``F.linear`` matters more than anything the engine does around it. For each of
SmolLM2-135M's matrix kinds this runs the product over all 30 layers' matrices of that kind in
turn (so the weights come from memory, not the caches, as in a real step) at 1, 2, 3, 4, 8, 16,
64 and 256 rows (a decode step, a speculative verification, a batch of decodes, a prefill
chunk), in fp32 (the exact path) and bf16, by both libraries, and reports the median time per
matrix, the weight bytes read per second, and oneDNN's speedup. Beside it, a read-only ``sum``
of a 256 MiB buffer says what memory gives one thread. Medians of ``--repeats`` passes; the
smallest and largest pass are in the JSON.

    python -m benchmarks.cpu_linear [--threads 1] [--repeats 9] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import infer_lab as il
from benchmarks._common import print_table, provenance, write_results
from infer_lab.kernels.linear import linear, onednn_takes

ROWS = (1, 2, 3, 4, 8, 16, 64, 256)


def pass_seconds(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return sorted(out)


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = il.load("smollm2-135m-instruct", device="cpu", dtype=torch.float32)
    kinds = {name: [layer.get_submodule(name).weight for layer in model.layers]
             for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                          "mlp.down_proj")}
    kinds["lm_head (tied embedding)"] = [model.embed_tokens.weight]
    load_before = os.getloadavg()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, weights in kinds.items():
            ws = [w.to(dtype) for w in weights]
            nbytes = sum(w.numel() * w.element_size() for w in ws)
            for m in args.rows:
                x = torch.randn(m, ws[0].shape[1], dtype=dtype)
                assert onednn_takes(x, ws[0], None), "oneDNN's inner product is not available"
                got = {}
                for lib, f in (("mkl", F.linear), ("onednn", linear)):
                    got[lib] = pass_seconds(lambda f=f, x=x, ws=ws: [f(x, w) for w in ws],
                                            args.repeats)
                med = {lib: s[len(s) // 2] / len(ws) for lib, s in got.items()}
                rows.append({
                    "dtype": str(dtype).removeprefix("torch."), "matrix": name,
                    "shape": list(ws[0].shape), "rows": m,
                    "F.linear_us": round(med["mkl"] * 1e6, 1),
                    "onednn_us": round(med["onednn"] * 1e6, 1),
                    "F.linear_GBps": round(nbytes / len(ws) / med["mkl"] / 1e9, 2),
                    "onednn_GBps": round(nbytes / len(ws) / med["onednn"] / 1e9, 2),
                    "speedup": round(med["mkl"] / med["onednn"], 2),
                    "passes_us": {lib: [round(s[0] / len(ws) * 1e6, 1),
                                        round(s[-1] / len(ws) * 1e6, 1)]
                                  for lib, s in got.items()},
                })
                print_table(rows[-1:], ["dtype", "matrix", "rows", "F.linear_us", "onednn_us",
                                        "F.linear_GBps", "onednn_GBps", "speedup"])
    src = torch.randn(2**26)
    read = src.numel() * 4 / pass_seconds(src.sum, args.repeats)[args.repeats // 2] / 1e9
    print(f"memory, one 256 MiB buffer: sum (read only) {read:.2f} GB/s")
    prov = provenance("cpu")
    prov["load_average"] = [load_before[0], os.getloadavg()[0]]
    write_results("cpu_linear", {
        "benchmark": "cpu_linear", "provenance": prov, "model": "smollm2-135m-instruct",
        "threads": args.threads, "repeats": args.repeats, "read_GBps": round(read, 2),
        "rows": rows, "command": "python -m benchmarks.cpu_linear "
        f"--threads {args.threads} --repeats {args.repeats}",
        "note": "time per matrix = median pass over all 30 layers' matrices of a kind / 30 "
                "(one pass for the LM head); passes_us: the fastest and slowest pass; GB/s: "
                "weight bytes / time per matrix"}, args.out)


if __name__ == "__main__":
    main()
