"""``linear(x, W, b)``: ``x @ W.T + b``, float32 through oneDNN's inner product on a CPU.

``F.linear`` sends a float32 product on a CPU to MKL's ``sgemm``. On the machine this project
measures on (an AMD EPYC; ``benchmarks/cpu_linear.py``, which a reader runs on their own) that
is slow where decoding lives, at a handful of rows: a decode step has one row per sequence, a
speculative verification k + 1, and there three rows cost ``sgemm`` 2.3x one row against 1.4x
for oneDNN's inner product, which was faster at every row count measured, one to 256. Whether
another processor's MKL does better was not measured. oneDNN takes the plain weight as it is
(no packed copy of the weights).

Only float32 takes the inner product. ``F.linear`` already sends a bf16 product on a CPU
with bf16 support to oneDNN (``aten::mm``), and the inner product, called from here, was the
slower of the two: a forward's bf16 products ran 3-9% slower through it (0.91-0.97x
``F.linear``'s speed, medians of passes whose ranges overlap) at seven of the eight row counts
measured, one to 256 (``benchmarks/results/cpu_linear.json``, commit d95cdc7, one thread), so
bf16 stays with ``F.linear``, the simpler route.

The fast path is for inference only: a product that needs a gradient (training an EAGLE head,
Chapter 9) goes to ``F.linear``, since oneDNN's op has no backward; so do empty or 0-d inputs,
mixed dtypes, a strided weight, every dtype but float32, every device but the CPU, and
everything when ``torch.backends.mkldnn`` is switched off. The two paths agree to float32's
rounding, not to the bit (they sum in different orders; ``tests/test_kernels_linear.py``
checks 1e-5 relative). torch's FLOP counter is told what oneDNN's op costs
(:func:`_linear_flops`), so a count of a forward stays whole.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils import flop_counter

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Does :func:`linear` send this product to oneDNN's inner product? Only float32: bf16
    already reaches oneDNN through ``F.linear``'s ``aten::mm``, and the inner product ran 3-9%
    slower than that (``benchmarks/results/cpu_linear.json``)."""
    return (_ONEDNN and x.device.type == "cpu" and weight.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == x.dtype and weight.dim() == 2
            and x.dim() >= 1 and x.shape[-1] == weight.shape[1] and x.numel() > 0
            and weight.is_contiguous() and (bias is None or bias.dtype == x.dtype)
            and torch._C._get_mkldnn_enabled()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad))))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``F.linear``, by oneDNN where :func:`onednn_takes` says so."""
    if onednn_takes(x, weight, bias):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _linear_flops(x_shape: list[int], *args: object, out_shape: list[int] | None = None,
                  **kwargs: object) -> int:
    """2 FLOPs per multiply-add, as torch counts ``aten.mm``: outputs x inputs x 2 (from the
    output's shape, right for the op's fused ``.binary`` overload too)."""
    assert out_shape is not None
    return 2 * math.prod(out_shape) * x_shape[-1]


if _ONEDNN and torch.ops.mkldnn._linear_pointwise not in flop_counter.flop_registry:
    flop_counter.register_flop_formula(torch.ops.mkldnn._linear_pointwise)(_linear_flops)
