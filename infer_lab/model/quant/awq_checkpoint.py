"""An AWQ checkpoint's tensors (AutoAWQ's GEMM layout, ``"version": "gemm"``) and Int4Groups.

AWQ's per-channel scales are folded into the ops before each linear when the checkpoint is
written (:func:`~infer_lab.model.quant.awq.fold_input_scales`), so what is left per linear of
``K`` inputs and ``N`` outputs is plain int4 in groups of ``group_size`` consecutive inputs, packed
along the *outputs* (GPTQ packs along the inputs):

- ``qweight`` int32 ``[K, N / 8]``: nibble ``i`` (bits ``4i..4i+3``) of ``qweight[k, c]`` holds
  input ``k`` of output ``8c + AWQ_ORDER[i]``, with ``AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``
  (the interleaving AutoAWQ's CUDA kernel unpacks fastest);
- ``qzeros`` int32 ``[G, N / 8]``: the zero points, packed the same way, stored as they are (no
  offset, so a zero point of 0 is fine);
- ``scales`` fp16 ``[G, N]``; no ``g_idx`` (groups are always consecutive).

and ``w[n, k] = scales[k // g, n] * (q - zero[k // g, n])``. The other AWQ layouts (GEMV,
Marlin, exllama) are refused by :mod:`~infer_lab.model.quant.prequantized`.
"""

from __future__ import annotations

import torch

from infer_lab.model.quant import FormatError
from infer_lab.model.quant.gptq import Int4Groups
from infer_lab.model.quant.gptq_checkpoint import check_packed, pack8, unpack8

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _to_awq_order(codes: torch.Tensor) -> torch.Tensor:
    """``[R, N]`` values rearranged so that position ``8c + i`` holds output ``8c + ORDER[i]``."""
    r, n = codes.shape
    return codes.reshape(r, n // 8, 8)[..., list(AWQ_ORDER)].reshape(r, n)


def _from_awq_order(values: torch.Tensor) -> torch.Tensor:
    r, n = values.shape
    out = torch.empty_like(values).reshape(r, n // 8, 8)
    out[..., list(AWQ_ORDER)] = values.reshape(r, n // 8, 8)
    return out.reshape(r, n)


def pack_awq(t: Int4Groups, name: str = "weight") -> dict[str, torch.Tensor]:
    """The GEMM checkpoint tensors of ``t`` (``qweight``, ``qzeros``, ``scales``); its groups
    must be consecutive and of one size, since the format has no ``g_idx``."""
    n, k = t.qweight.shape
    groups = t.scales.shape[1]
    if n % 8 or k % groups or not torch.equal(t.g_idx, torch.arange(k) // (k // groups)):
        raise FormatError(f"{name}: AWQ's GEMM layout takes {n} outputs in 8s and consecutive "
                          "groups of one size (it has no g_idx)")
    return {"qweight": pack8(_to_awq_order(t.qweight.t()), 1),
            "qzeros": pack8(_to_awq_order(t.zeros.t()), 1),
            "scales": t.scales.t().contiguous().half()}


def unpack_awq(tensors: dict[str, torch.Tensor], group_size: int,
               name: str = "weight") -> Int4Groups:
    """:class:`Int4Groups` of a GEMM checkpoint's three tensors, every shape checked;
    ``group_size`` -1 means one group per row, as in ``quantization_config``."""
    missing = {"qweight", "qzeros", "scales"} - set(tensors)
    if missing:
        raise FormatError(f"{name}: AWQ tensors missing: {sorted(missing)}")
    check_packed(tensors, name, "AWQ")
    qw, qz, sc = (tensors[k] for k in ("qweight", "qzeros", "scales"))
    k, n = qw.shape[0], qw.shape[1] * 8
    g = k if group_size == -1 else group_size
    if k % g or sc.shape != (k // g, n) or qz.shape != (k // g, n // 8):
        raise FormatError(f"{name}: AWQ shapes do not agree with group_size {group_size}: "
                          f"qweight {tuple(qw.shape)} ({k} inputs, {n} outputs), "
                          f"qzeros {tuple(qz.shape)}, scales {tuple(sc.shape)}")
    if not torch.isfinite(sc.float()).all() or (sc.float() <= 0).any():
        raise FormatError(f"{name}: AWQ scales must be finite and positive")
    codes = _from_awq_order(unpack8(qw, 1))  # [K, N]
    zeros = _from_awq_order(unpack8(qz, 1))  # [G, N]
    return Int4Groups(codes.t().to(torch.uint8).contiguous(), sc.t().contiguous(),
                      zeros.t().to(torch.uint8).contiguous(), torch.arange(k) // g)
