"""GPTQ: int4 weights whose rounding errors are compensated by the columns not yet rounded.

Round-to-nearest (RTN) rounds each weight on its own. GPTQ (Frantar et al., 2023) minimizes
instead the error of the layer's *output* on calibration inputs ``X``, ``||X W^T - X Q^T||^2``,
whose curvature is the Hessian ``H = 2 X^T X / n`` (one ``K x K`` matrix per layer, from the
activations alone). It rounds one input column at a time and spreads that column's error over
the columns to its right in proportion to ``H^-1``: the Optimal Brain Surgeon update, done for
all rows at once, in blocks of 128 columns with the rest updated lazily.

- groups: every ``group_size`` columns (in processing order) get a scale and zero computed from
  their weights *as updated so far*; ``g_idx[k]`` records column ``k``'s group;
- act-order: columns in order of decreasing ``H_kk`` (the inputs with the largest activations
  first, while there are most columns left to absorb their error); groups then follow that
  order, so ``g_idx`` is not monotonic (what a GPTQ checkpoint's ``g_idx`` tensor stores);
- damping: ``percdamp`` of the mean diagonal added to ``H`` so that its Cholesky exists.

The int4 grid is GPTQ's asymmetric one, ``w ≈ (q - z) * s`` with ``q`` in 0..15, an fp16
scale and a 4-bit zero per group (the group's range widened to include 0, as AutoGPTQ's
quantizer does); :func:`rtn_int4` is the same grid without error feedback, the baseline at
equal bits. A group that does not divide the row leaves a shorter last group (``g_idx`` says
which); GPTQ checkpoints do this for 576-wide layers at group 128.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer_lab.model.quant import FormatError
from infer_lab.model.quant.fp8 import check_finite

MAXQ = 15


@dataclass
class Int4Groups:
    """int4 codes ``[N, K]`` (0..15), fp16 scales and int zeros ``[N, G]``, ``g_idx [K]``."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor

    @property
    def bits_per_weight(self) -> float:
        """4 bits, plus an fp16 scale and a 4-bit zero per group (and the int32 ``g_idx`` per
        input column when it is not the identity grouping)."""
        n, k = self.qweight.shape
        groups = self.scales.numel() * (16 + 4)
        gidx = 0 if self.sorted_groups else 32 * k
        return 4 + (groups + gidx) / (n * k)

    @property
    def sorted_groups(self) -> bool:
        return bool((self.g_idx[1:] >= self.g_idx[:-1]).all())

    def dequantize(self, name: str = "weight") -> torch.Tensor:
        n, k = self.qweight.shape
        if self.g_idx.shape != (k,) or int(self.g_idx.max()) >= self.scales.shape[1] or \
                int(self.g_idx.min()) < 0:
            raise FormatError(f"{name}: g_idx (shape {tuple(self.g_idx.shape)}, groups "
                              f"{int(self.g_idx.min())}..{int(self.g_idx.max())}) does not match "
                              f"{k} columns and {self.scales.shape[1]} groups")
        s = self.scales.float()[:, self.g_idx]
        z = self.zeros.float()[:, self.g_idx]
        return (self.qweight.float() - z) * s


def group_params(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 scale and integer zero of each row of ``w [N, g]`` (range widened to include 0)."""
    lo = w.amin(1).clamp(max=0.0)
    hi = w.amax(1).clamp(min=0.0)
    scale = ((hi - lo) / MAXQ).half().float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(0, MAXQ)
    return scale, zero


def _quant(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(w / scale) + zero, 0, MAXQ)


def _check(w: torch.Tensor, group_size: int, name: str) -> None:
    if w.dim() != 2:
        raise FormatError(f"{name}: int4 quantization takes a 2-D weight, got {tuple(w.shape)}")
    if group_size <= 0:
        raise FormatError(f"{name}: group_size must be positive, got {group_size}")
    check_finite(w, name)


def rtn_int4(w: torch.Tensor, group_size: int = 128, name: str = "weight") -> Int4Groups:
    """Round-to-nearest on GPTQ's grid: groups of consecutive columns, no error feedback."""
    _check(w, group_size, name)
    n, k = w.shape
    g_idx = torch.arange(k) // group_size
    groups = int(g_idx[-1]) + 1
    w = w.detach().float()
    q = torch.empty(n, k)
    scales, zeros = torch.empty(n, groups), torch.empty(n, groups)
    for g in range(groups):
        cols = slice(g * group_size, (g + 1) * group_size)
        s, z = group_params(w[:, cols])
        q[:, cols] = _quant(w[:, cols], s[:, None], z[:, None])
        scales[:, g], zeros[:, g] = s, z
    return Int4Groups(q.to(torch.uint8), scales.half(), zeros.to(torch.uint8), g_idx)


@torch.no_grad()
def gptq_int4(w: torch.Tensor, hessian: torch.Tensor, group_size: int = 128,
              act_order: bool = True, percdamp: float = 0.01, blocksize: int = 128,
              name: str = "weight") -> Int4Groups:
    """GPTQ of ``w [N, K]`` given ``hessian [K, K]`` (``2 X^T X / n`` of its inputs)."""
    _check(w, group_size, name)
    n, k = w.shape
    if hessian.shape != (k, k):
        raise FormatError(f"{name}: Hessian {tuple(hessian.shape)} does not match {k} inputs")
    check_finite(hessian, f"{name} Hessian")
    W = w.detach().double().clone()
    H = hessian.detach().double().clone()
    dead = torch.diag(H) == 0  # an input that was always 0: its weights do not matter
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(k)
    W, H = W[:, perm], H[perm][:, perm]
    H += percdamp * torch.mean(torch.diag(H)) * torch.eye(k, dtype=H.dtype)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.zeros_like(W)
    groups = (k + group_size - 1) // group_size
    scales, zeros = torch.zeros(n, groups), torch.zeros(n, groups)
    gid = torch.arange(k) // group_size  # in processing order
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:  # this group's grid from its weights as updated so far
                end = min(col + group_size, k)
                cur = torch.cat([W1[:, i:], W[:, i2:]], dim=1)[:, : end - col]
                s, z = group_params(cur.float())
                scales[:, col // group_size], zeros[:, col // group_size] = s, z
            g = col // group_size
            s, z = scales[:, g].double(), zeros[:, g].double()
            q = _quant(W1[:, i], s, z)
            Q[:, col] = q
            err = (W1[:, i] - (q - z) * s) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    inv = torch.argsort(perm)
    return Int4Groups(Q[:, inv].to(torch.uint8), scales.half(), zeros.to(torch.uint8), gid[inv])
