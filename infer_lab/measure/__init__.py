"""Measurement: FLOP and byte counts, hardware ceilings, workloads, timing, cost.

The load generator of Chapter 7 lives here too and speaks only HTTP, so it can measure any
OpenAI-compatible server. ``measure`` imports nothing of the engine or the server. Every name is
imported on first use (:mod:`infer_lab.lazy`).
"""

from infer_lab.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    ".flops": ("arithmetic_intensity", "matmul_params", "step_bytes", "step_flops"),
    ".hardware": ("GPUS", "Hardware"),
    ".roofline": (
        "Ceilings", "measure_ceilings", "measure_copy_bandwidth", "measure_matmul_flops",
        "plot_roofline",
    ),
    ".timing": ("time_fn",),
    ".workloads": ("LONG_TAIL", "RequestSpec", "long_tail_mix", "nano_vllm_offline"),
})
