"""What tensor parallelism costs on the wire: all-reduce sizes, measured times, priced links.

A tensor-parallel layer (Chapter 10) ends its attention and its MLP with one all-reduce of the
hidden state each: ``2 * layers`` all-reduces of ``tokens * hidden_size * dtype_bytes`` bytes per
forward. A ring all-reduce over ``n`` ranks sends ``2 (n - 1) / n`` times the buffer from each rank,
so the time on a link of bandwidth ``B`` is at least that many bytes over ``B``, plus a fixed
latency per call that dominates small decode batches.

:func:`time_all_reduce` measures it with real processes: ``torchrun`` (PyTorch's launcher) starts
``world_size`` copies of this module, which time ``torch.distributed.all_reduce`` over gloo (CPU)
or NCCL (GPU) and report from rank 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A link between accelerators, by its datasheet bandwidth per direction."""

    name: str
    gbs: float  # GB/s (10^9 bytes) each way, per GPU
    latency_us: float  # a typical small-message all-reduce latency: an assumption, stated


# Datasheet per-direction bandwidths; latencies are round figures for a small all-reduce.
LINKS: dict[str, Link] = {link.name: link for link in [
    Link("PCIe 4.0 x16", 32, 15),
    Link("PCIe 5.0 x16", 64, 12),
    Link("NVLink 3 (A100)", 300, 8),
    Link("NVLink 4 (H100/H200)", 450, 6),
]}


def allreduce_bytes_per_token(hidden_size: int, num_layers: int, dtype_bytes: int = 2) -> int:
    """Bytes of hidden state all-reduced per token in one forward (two all-reduces a layer)."""
    return 2 * num_layers * hidden_size * dtype_bytes


def ring_bytes_sent(buffer_bytes: int, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``buffer_bytes``."""
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    return 2 * (world_size - 1) / world_size * buffer_bytes


def link_time_s(buffer_bytes: int, world_size: int, link: Link) -> float:
    """Lower bound of one all-reduce on ``link``: latency plus ring bytes over bandwidth."""
    if world_size == 1:
        return 0.0
    return link.latency_us * 1e-6 + ring_bytes_sent(buffer_bytes, world_size) / (link.gbs * 1e9)


def time_all_reduce(world_size: int, sizes: Sequence[int], repeats: int = 20,
                    backend: str = "gloo", timeout: float = 300.0) -> list[dict[str, float]]:
    """Median seconds of ``all_reduce`` of float32 buffers of ``sizes`` elements, via torchrun.

    Returns one row per size: ``{"numel", "bytes", "median_s", "min_s"}`` as rank 0 saw them.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world_size}", "-m", "infer_lab.measure.collectives",
           "--backend", backend, "--repeats", str(repeats), "--sizes", *map(str, sizes)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"torchrun failed ({out.returncode}): {out.stderr[-2000:]}")
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1])["rows"]


def _worker(sizes: Sequence[int], repeats: int, backend: str) -> None:
    import os

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(backend)
    rank = dist.get_rank()
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
              if backend == "nccl" else torch.device("cpu"))
    rows = []
    for n in sizes:
        x = torch.ones(n, device=device)
        dist.all_reduce(x)  # warm-up (and a check below that it really summed)
        if abs(float(x[0]) - dist.get_world_size()) > 1e-6:
            raise RuntimeError("all_reduce did not sum")
        times = []
        for _ in range(repeats):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        times.sort()
        rows.append({"numel": n, "bytes": n * 4, "median_s": times[len(times) // 2],
                     "min_s": times[0]})
    if rank == 0:
        print(json.dumps({"world_size": dist.get_world_size(), "backend": backend,
                          "rows": rows}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", required=True)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--backend", default="gloo")
    a = p.parse_args()
    _worker(a.sizes, a.repeats, a.backend)
