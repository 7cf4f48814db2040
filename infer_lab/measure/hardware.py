"""Datasheet ceilings of the GPUs a reader is likely to have, for the roofline.

Dense (no sparsity) tensor-core throughput for 16-bit inputs, and peak memory bandwidth, as the
vendor's datasheets state them (SXM parts where there is a choice). Real kernels reach less:
measure the copy bandwidth of your own device (Chapter 1) before judging a kernel against it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_gb: float
    bandwidth_gbs: float  # peak memory bandwidth, GB/s (10^9 bytes)
    tflops_16bit: float  # dense fp16/bf16 tensor-core TFLOP/s
    tflops_fp32: float  # non-tensor fp32 TFLOP/s
    bf16: bool = True

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte above which a kernel is compute-bound on this device (16-bit)."""
        return self.tflops_16bit * 1e12 / (self.bandwidth_gbs * 1e9)


GPUS: dict[str, Hardware] = {
    g.name: g
    for g in [
        Hardware("T4", 16, 320, 65, 8.1, bf16=False),
        Hardware("L4", 24, 300, 121, 30.3),
        Hardware("A100-80GB", 80, 2039, 312, 19.5),
        Hardware("H100-SXM", 80, 3350, 989, 67),
        Hardware("H200-SXM", 141, 4800, 989, 67),
    ]
}
