"""Measurement: FLOP and byte counts, hardware ceilings, workloads, timing, cost.

The load generator of Chapter 7 lives here too and speaks only HTTP, so it can measure any
OpenAI-compatible server. ``measure`` imports nothing of the engine or the server.
"""

from infer_lab.measure.flops import arithmetic_intensity, matmul_params, step_bytes, step_flops
from infer_lab.measure.hardware import GPUS, Hardware
from infer_lab.measure.roofline import (
    Ceilings,
    measure_ceilings,
    measure_copy_bandwidth,
    measure_matmul_flops,
    plot_roofline,
)
from infer_lab.measure.timing import time_fn
from infer_lab.measure.workloads import LONG_TAIL, RequestSpec, long_tail_mix, nano_vllm_offline

__all__ = [
    "GPUS", "LONG_TAIL", "Ceilings", "Hardware", "RequestSpec", "arithmetic_intensity",
    "long_tail_mix",
    "matmul_params", "measure_ceilings", "measure_copy_bandwidth", "measure_matmul_flops",
    "nano_vllm_offline", "plot_roofline", "step_bytes", "step_flops", "time_fn",
]
