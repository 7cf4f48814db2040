"""A GPTQ checkpoint's tensors (the layout transformers and vLLM read) and the engine's int4.

A 4-bit GPTQ checkpoint (``quantization_config``: ``quant_method "gptq"``, ``bits 4``,
``checkpoint_format "gptq"``) stores per linear layer of ``K`` inputs and ``N`` outputs:

- ``qweight`` int32 ``[K / 8, N]``: input ``8r + j`` of output ``n`` in bits ``4j..4j+3`` of
  ``qweight[r, n]``;
- ``qzeros`` int32 ``[G, N / 8]``: the zero point of group ``g``, output ``8c + j``, in bits
  ``4j..4j+3`` of ``qzeros[g, c]``, stored *minus one* (AutoGPTQ's v1 convention; readers add 1
  back, so a zero point of 0 cannot be stored and is refused; gptqmodel's ``gptq_v2`` format
  stores the zero itself);
- ``scales`` fp16 ``[G, N]`` and ``g_idx`` int32 ``[K]``, each input's group;

and ``w[n, k] = scales[g_idx[k], n] * (q - zero[g_idx[k], n])``. :func:`pack_gptq` and
:func:`unpack_gptq` convert between that and :class:`~infer_lab.model.quant.gptq.Int4Groups`;
:func:`to_quantized_linear` hands a layer whose groups are consecutive (no act-order) to the
engine's int4 kernels as a :class:`~infer_lab.model.quantize.QuantizedLinear`, with
``minimum = -zero * scale`` kept in fp32 (the engine stores a minimum, GPTQ a zero point):
with an fp16 (or bf16) scale and a 4-bit zero both ``q * scale`` and ``zero * scale`` are exact
in fp32, so the engine's ``q * scale + minimum`` is GPTQ's ``(q - zero) * scale`` bit for bit
(an fp16 minimum would round it). :mod:`~infer_lab.model.quant.prequantized` reads a whole
checkpoint directory through ``il.load``.
"""

from __future__ import annotations

import torch

from infer_lab.model.quant import FormatError
from infer_lab.model.quant.gptq import Int4Groups
from infer_lab.model.quantize import QuantizedLinear

SHIFTS = torch.arange(8) * 4


def pack8(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Pack 4-bit values 8 to an int32 along ``dim`` (value ``j`` of 8 in bits ``4j``)."""
    c = codes.long().movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], -1, 8)
    word = (c << SHIFTS).sum(-1)
    word = torch.where(word >= 2**31, word - 2**32, word)  # as int32 stores it
    return word.to(torch.int32).movedim(-1, dim).contiguous()


def unpack8(words: torch.Tensor, dim: int) -> torch.Tensor:
    """The 4-bit values of int32 ``words``, 8 per word along ``dim`` (the inverse of pack8)."""
    w = words.long().movedim(dim, -1) & 0xFFFFFFFF
    c = (w[..., None] >> SHIFTS) & 15
    return c.reshape(*c.shape[:-2], -1).movedim(-1, dim)


def pack_gptq(t: Int4Groups, name: str = "weight", zero_offset: int = 1
              ) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of ``t`` (``qweight``, ``qzeros``, ``scales``, ``g_idx``);
    ``zero_offset`` as for :func:`unpack_gptq`."""
    n, k = t.qweight.shape
    if k % 8 or n % 8:
        raise FormatError(f"{name}: GPTQ packs 8 values per int32: {n} x {k} is not a multiple")
    if zero_offset and (t.zeros == 0).any():
        raise FormatError(f"{name}: a zero point of 0 cannot be stored in GPTQ's v1 layout "
                          "(it stores zero - 1)")
    return {"qweight": pack8(t.qweight.t(), 0), "qzeros": pack8(t.zeros.t() - zero_offset, 1),
            "scales": t.scales.t().contiguous().half(), "g_idx": t.g_idx.to(torch.int32)}


def check_packed(tensors: dict[str, torch.Tensor], name: str, method: str) -> None:
    """``qweight``/``qzeros`` 2-D int32 and ``scales`` 2-D floating point, or a FormatError."""
    for key in ("qweight", "qzeros", "scales"):
        t = tensors[key]
        if t.dim() != 2:
            raise FormatError(f"{name}.{key}: {method} stores a 2-D tensor here, got shape "
                              f"{tuple(t.shape)}")
        words = key != "scales"
        if not (t.dtype == torch.int32 if words else t.is_floating_point()):
            raise FormatError(f"{name}.{key}: {method} stores "
                              f"{'int32 words' if words else 'floating-point scales'}, got "
                              f"{t.dtype}")


def unpack_gptq(tensors: dict[str, torch.Tensor], name: str = "weight",
                zero_offset: int = 1) -> Int4Groups:
    """:class:`Int4Groups` of a checkpoint's four tensors, every shape and index checked.
    ``zero_offset``: 1 for the ``gptq`` (v1) format, which stores zero - 1; 0 for ``gptq_v2``."""
    missing = {"qweight", "qzeros", "scales", "g_idx"} - set(tensors)
    if missing:
        raise FormatError(f"{name}: GPTQ tensors missing: {sorted(missing)}")
    check_packed(tensors, name, "GPTQ")
    qw, qz, sc, g_idx = (tensors[k] for k in ("qweight", "qzeros", "scales", "g_idx"))
    k, n = qw.shape[0] * 8, qw.shape[1]
    groups = sc.shape[0]
    if sc.shape != (groups, n) or qz.shape != (groups, n // 8) or g_idx.shape != (k,):
        raise FormatError(f"{name}: GPTQ shapes do not agree: qweight {tuple(qw.shape)}, "
                          f"qzeros {tuple(qz.shape)}, scales {tuple(sc.shape)}, "
                          f"g_idx {tuple(g_idx.shape)}")
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise FormatError(f"{name}: g_idx holds groups {int(g_idx.min())}..{int(g_idx.max())} "
                          f"but the checkpoint has {groups} groups of scales")
    if not torch.isfinite(sc.float()).all() or (sc.float() <= 0).any():
        raise FormatError(f"{name}: GPTQ scales must be finite and positive")
    zeros = unpack8(qz, 1) + zero_offset  # v1's stored 15 reads as 16, as AutoGPTQ reads it
    return Int4Groups(unpack8(qw, 0).t().to(torch.uint8).contiguous(), sc.t().contiguous(),
                      zeros.t().to(torch.uint8).contiguous(), g_idx.long())


def to_quantized_linear(t: Int4Groups, bias: torch.Tensor | None = None,
                        name: str = "weight") -> QuantizedLinear:
    """The engine's int4 layer for ``t``; its groups must be consecutive and of one size."""
    n, k = t.qweight.shape
    groups = t.scales.shape[1]
    g = k // groups
    if k % groups or g % 2 or not torch.equal(t.g_idx, torch.arange(k) // g):
        raise FormatError(
            f"{name}: g_idx is not {groups} consecutive groups of one even size (an act-order "
            "checkpoint, or a ragged last group); the engine's int4 kernels take "
            "consecutive groups: dequantize it instead")
    q = t.qweight.long()
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    minimum = -(t.zeros.float() * t.scales.float())  # exact in fp32 (module docstring)
    tensors = {"qweight": packed, "scale": t.scales, "minimum": minimum}
    return QuantizedLinear("int4", tensors, k, n, bias, g)
