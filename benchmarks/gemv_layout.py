"""Is SmolLM2's slow batch-1 decode the weights' layout? One thread, fp32, on the loaded model.

``benchmarks.peers`` finds batch-1 decode at ~17% of the bandwidth bound, nearly all of it in
``aten::mm``. A weight that is transposed or strided would send MKL down a slow path, so this
compares, for each of the model's matrices at batch 1:

- ``F.linear(x, W)`` on the weight as ``il.load`` leaves it ([out, in], row-major);
- the same on a fresh ``torch.randn(W.shape)`` (the layout MKL is given when nothing is wrong);
- ``x @ Wt`` with ``Wt = W.t().contiguous()`` stored [in, out] (the other GEMV orientation).

Each row runs the product over all 30 layers' matrices of one kind in turn, so the weights come
from memory, not from the caches (a single matrix timed in a loop would stay cached and look
fast). Bandwidth is weight bytes ÷ median seconds; beside it, a read-only ``sum`` and a copy of a
256 MiB buffer (read + written) say what the memory gives one thread.

    python -m benchmarks.gemv_layout [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import infer_lab as il
from benchmarks.cpu_linear import matrices_by_kind


def median_seconds(fn: Callable[[], object], repeats: int = 9) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[repeats // 2]


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = il.load("smollm2-135m-instruct", device="cpu", dtype=torch.float32)
    kinds = matrices_by_kind(model)
    print(f"{'matrices':26} {'shape':>12} {'contig':>6} {'F.linear':>9} {'fresh':>7} "
          f"{'[in,out]':>9}  (GB/s)")
    for name, weights in kinds.items():
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        x = torch.randn(1, weights[0].shape[1])
        fresh = [torch.randn(w.shape) for w in weights]
        stored_t = [w.t().contiguous() for w in weights]
        rates = [nbytes / median_seconds(lambda ws=ws, f=f, x=x: [f(x, w) for w in ws]) / 1e9
                 for ws, f in ((weights, F.linear), (fresh, F.linear),
                               (stored_t, torch.matmul))]
        contiguous = all(w.is_contiguous() for w in weights)
        print(f"{name:26} {str(tuple(weights[0].shape)):>12} {contiguous!s:>6} "
              f"{rates[0]:9.2f} {rates[1]:7.2f} {rates[2]:9.2f}")
    src = torch.randn(2**26)
    dst = torch.empty_like(src)
    read = src.numel() * 4 / median_seconds(src.sum) / 1e9
    copy = 2 * src.numel() * 4 / median_seconds(lambda: dst.copy_(src)) / 1e9
    print(f"memory, one 256 MiB buffer: sum (read only) {read:.2f} GB/s, "
          f"copy (read + write) {copy:.2f} GB/s")


if __name__ == "__main__":
    main()
