"""``linear(x, W, b)``: ``x @ W.T + b``, through oneDNN's inner product on a CPU.

``F.linear`` sends a float32 product on a CPU to MKL's ``sgemm``, which is slow exactly where
decoding lives: a handful of rows. A decode step has one row per sequence, a speculative
verification k + 1; at 2-3 rows ``sgemm`` costs 2-3x one row, and one row reads the weight well
below the memory bandwidth. oneDNN's inner product (what ``torch.compile``'s CPU backend calls)
reads the weight once at any row count, and at a prefill's hundreds of rows it is faster too;
``benchmarks/cpu_linear.py`` measures both on the reader's machine. It takes the plain weight as
it is: no packed copy, no extra memory.

The fast path is for inference only: a product that needs a gradient (training an EAGLE head,
Chapter 9) goes to ``F.linear``, since oneDNN's op has no backward; so do empty inputs, mixed
dtypes and every device but the CPU. Both paths give float32 to float32's accuracy; not the same
bits (a different summation order), as two BLAS libraries never do. torch's FLOP counter is
told what oneDNN's op costs (:func:`_linear_flops`), so a count of a forward stays whole.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

_FAST_DTYPES = (torch.float32, torch.bfloat16)
_onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Does :func:`linear` send this product to oneDNN?"""
    return (_onednn and x.device.type == "cpu" and weight.device.type == "cpu"
            and x.dtype in _FAST_DTYPES and weight.dtype == x.dtype
            and (bias is None or bias.dtype == x.dtype) and x.numel() > 0
            and x.shape[-1] == weight.shape[-1] and weight.dim() == 2
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad))))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``F.linear``, by oneDNN where :func:`onednn_takes` says so."""
    if onednn_takes(x, weight, bias):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


if _onednn:
    @register_flop_formula(torch.ops.mkldnn._linear_pointwise)
    def _linear_flops(x_shape: list[int], w_shape: list[int], *args: object,
                      out_shape: list[int] | None = None, **kwargs: object) -> int:
        """2 FLOPs per multiply-add, as torch counts ``aten.mm``: rows x in x out x 2."""
        return 2 * math.prod(x_shape[:-1]) * x_shape[-1] * w_shape[0]
