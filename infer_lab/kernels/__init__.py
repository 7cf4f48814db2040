"""Small fused ops used by the model, and the paged-attention kernels of Chapter 4.

Each op is a function that takes tensors and returns tensors; the model calls these names and never
a specific implementation. Each dispatches on the tensor's device — Triton on CUDA, the torch
reference (:mod:`infer_lab.kernels.reference`) elsewhere — unless a backend is forced per call
(``backend="triton"``/``"torch"``), for a block (``with use_backend("triton"):``) or for the
process (:func:`set_backend`, the ``INFER_LAB_KERNELS`` environment variable). Forcing Triton
without a GPU runs its interpreter: exact, and about a thousand times slower.

Triton is imported only when a Triton kernel first runs (:mod:`infer_lab.kernels.dispatch`), and
every name here on first use (:mod:`infer_lab.lazy`): the ops live in :mod:`infer_lab.kernels.ops`.
"""

from infer_lab.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    ".dispatch": (
        "BACKENDS", "get_backend", "interpreting", "resolve_backend", "set_backend",
        "triton_available", "triton_module", "use_backend",
    ),
    ".ops": ("apply_rope", "paged_attention_triton", "rms_norm", "silu_and_mul", "store_kv"),
})
