"""AWQ: scale up the input channels that carry large activations before rounding to int4.

A weight column that multiplies a large activation matters more to the output than one that
multiplies a small one, but round-to-nearest gives every column of a group the same absolute
step. AWQ (Lin et al., 2024) multiplies column ``k`` by ``s_k = mean|x_k|^alpha`` before
quantizing and divides the activation by it (folded into the previous RMSNorm or linear, so
the product is unchanged and nothing is added at run time): ``y = (x / s) Q(W diag(s))^T``.
The salient columns are then rounded on a finer relative grid. ``alpha`` is searched on a grid
in [0, 1] per layer, minimizing the layer's output error on calibration activations; ``alpha=0``
is plain RTN, so the search never does worse than RTN *on the calibration data*.

Here the effective weight ``Q(W diag(s)) diag(1/s)`` is returned (what the folded model
computes); the int4 grid and groups are :func:`~infer_lab.model.quant.gptq.rtn_int4`'s.
The original's weight-clipping search is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer_lab.model.quant import FormatError
from infer_lab.model.quant.fp8 import check_finite
from infer_lab.model.quant.gptq import Int4Groups, rtn_int4

ALPHAS = tuple(i / 20 for i in range(21))


@dataclass
class AWQResult:
    """The int4 weight of ``W diag(scales)`` and the per-input-channel ``scales`` it divides by."""

    int4: Int4Groups
    scales: torch.Tensor
    alpha: float

    @property
    def bits_per_weight(self) -> float:
        return self.int4.bits_per_weight  # the scales fold into the previous layer: no bytes

    def dequantize(self, name: str = "weight") -> torch.Tensor:
        return self.int4.dequantize(name) / self.scales[None, :]


@torch.no_grad()
def awq_int4(w: torch.Tensor, x_mean_abs: torch.Tensor, x_sample: torch.Tensor,
             group_size: int = 128, alphas: tuple[float, ...] = ALPHAS,
             name: str = "weight") -> AWQResult:
    """AWQ of ``w [N, K]`` from its inputs' mean magnitude per channel ``[K]`` and a sample of
    inputs ``[T, K]`` on which the output error is measured."""
    k = w.shape[1]
    if x_mean_abs.shape != (k,) or x_sample.dim() != 2 or x_sample.shape[1] != k:
        raise FormatError(f"{name}: activation statistics {tuple(x_mean_abs.shape)} / "
                          f"{tuple(x_sample.shape)} do not match {k} inputs")
    check_finite(x_mean_abs, f"{name} activations")
    w = w.detach().float()
    x = x_sample.float()
    ref = x @ w.t()
    best: AWQResult | None = None
    best_err = float("inf")
    stat = x_mean_abs.float().clamp(min=1e-8)
    for alpha in alphas:
        s = stat.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centred around 1, as the original does
        q = rtn_int4(w * s[None, :], group_size, name)
        out = x @ (q.dequantize() / s[None, :]).t()
        err = float((out - ref).pow(2).mean())
        if err < best_err:
            best_err, best = err, AWQResult(q, s, alpha)
    assert best is not None
    return best
