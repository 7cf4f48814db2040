"""The roofline: this machine's measured ceilings, and a plot to place measured points on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer_lab.measure.timing import time_fn


@dataclass(frozen=True)
class Ceilings:
    """Measured peak rates of one device: what no memory-bound or compute-bound step can beat."""

    device: str
    bandwidth: float  # bytes/s, from a large copy (read + write counted)
    flops: float  # FLOP/s, from a large matmul

    @property
    def ridge_point(self) -> float:
        return self.flops / self.bandwidth


def measure_copy_bandwidth(
    device: torch.device | str = "cpu", nbytes: int = 256 * 2**20, repeats: int = 5
) -> float:
    """Bytes/s of a large tensor copy (each byte read once and written once)."""
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), repeats=repeats, device=device)
    return 2 * n * 4 / seconds


def measure_matmul_flops(
    device: torch.device | str = "cpu",
    n: int = 1024,
    dtype: torch.dtype = torch.float32,
    repeats: int = 5,
) -> float:
    """FLOP/s of an ``n × n`` matmul (2·n³ FLOPs)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    seconds = time_fn(lambda: a @ b, repeats=repeats, device=device)
    return 2 * n**3 / seconds


def measure_ceilings(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                     copy_bytes: int = 256 * 2**20, matmul_n: int = 1024) -> Ceilings:
    """Both ceilings of ``device``, for a roofline."""
    return Ceilings(
        str(device),
        measure_copy_bandwidth(device, copy_bytes),
        measure_matmul_flops(device, matmul_n, dtype),
    )


def plot_roofline(ax, bandwidth: float, flops: float, label: str = "", color: str = "k",
                  intensities: tuple[float, float] = (0.1, 1e4)) -> None:
    """Draw ``min(flops, intensity · bandwidth)`` on log-log axes (FLOPs/byte → FLOP/s)."""
    import numpy as np

    x = np.logspace(np.log10(intensities[0]), np.log10(intensities[1]), 200)
    ax.loglog(x, np.minimum(flops, x * bandwidth), color=color, label=label)
    ax.set_xlabel("arithmetic intensity (FLOPs / byte)")
    ax.set_ylabel("attainable FLOP/s")
