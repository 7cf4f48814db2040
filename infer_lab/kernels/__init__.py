"""Small fused ops used by the model.

Each op is a function that takes tensors and returns tensors; the model calls these names and never
a specific implementation, so Chapter 4 can add faster kernels without touching the model.
"""

from infer_lab.kernels.reference import rms_norm_ref as rms_norm
from infer_lab.kernels.reference import rope_ref as apply_rope
from infer_lab.kernels.reference import silu_and_mul_ref as silu_and_mul

__all__ = ["apply_rope", "rms_norm", "silu_and_mul"]
