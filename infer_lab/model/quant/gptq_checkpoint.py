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
:func:`to_quantized_linear` hands a layer to the engine's int4 kernels as a
:class:`~infer_lab.model.quantize.QuantizedLinear`. Those take consecutive groups of one size
(32-256 on the CPU), and a checkpoint has two other cases: a short last group (SmolLM2's 576
inputs at group 128 are 4 x 128 + 64), stored as groups of 64 that repeat each group's scale and
zero; and act-order (``desc_act``), whose groups are not consecutive inputs, stored with the
columns sorted by group and the permutation kept, which the kernels apply to the activation's
columns before multiplying (as exllama and vLLM do). Neither rounds anything. The engine stores a
minimum where GPTQ stores a zero point, ``minimum = -zero * scale``, kept in fp32: with an fp16
(or bf16) scale and a 4-bit zero both ``q * scale`` and ``zero * scale`` are exact in fp32, so
the engine's ``q * scale + minimum`` is GPTQ's ``(q - zero) * scale`` bit for bit (an fp16
minimum would round it). :mod:`~infer_lab.model.quant.prequantized` reads a whole
checkpoint directory through ``il.load``.
"""

from __future__ import annotations

import math

import torch

from infer_lab.kernels.quant import CPU_INT4_GROUPS
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


def group_counts(g_idx: torch.Tensor, groups: int, name: str = "weight",
                 group_size: int | None = None) -> torch.Tensor:
    """How many inputs each of the ``groups`` groups holds, checked against the two layouts a
    GPTQ checkpoint has: every group ``group_size`` inputs (the first group's count if None) but
    the last, which holds the rest (``K`` need not be a multiple); in input order without
    act-order, in the order GPTQ processed the inputs with it. Anything else is a FormatError
    naming ``name``'s ``g_idx``."""
    where = f"{name}.g_idx"
    if g_idx.dim() != 1 or g_idx.numel() == 0 or groups < 1:
        raise FormatError(f"{where}: one group per input expected, got shape "
                          f"{tuple(g_idx.shape)} for {groups} groups")
    lo, hi = int(g_idx.min()), int(g_idx.max())
    if lo < 0 or hi >= groups:
        raise FormatError(f"{where}: holds groups {lo}..{hi} but there are {groups} groups of "
                          "scales")
    counts = torch.bincount(g_idx.long(), minlength=groups)
    g = int(counts[0]) if group_size is None else group_size
    if not (bool((counts[:-1] == g).all()) and 0 < int(counts[-1]) <= g):
        shown = counts.tolist() if groups <= 8 else f"{counts[:4].tolist()}... {int(counts[-1])}"
        raise FormatError(f"{where}: its groups hold {shown} inputs; GPTQ's groups hold "
                          f"{g} each but the last, which holds the rest (1..{g})")
    return counts


def sub_group_size(counts: torch.Tensor, name: str = "weight") -> int:
    """The group size the engine's int4 layer uses for groups of ``counts`` inputs: the largest
    of the kernels' sizes (256, 128, 64, 32) that divides every group, else the largest even
    size that does. A group of 128 is then 2 groups of 64 that repeat its scale and zero, which
    changes no weight (how a 576-wide layer's short last group of 64 fits)."""
    common = math.gcd(*(int(c) for c in counts.unique()))
    for size in sorted(CPU_INT4_GROUPS, reverse=True):
        if common % size == 0:
            return size
    if common % 2:
        raise FormatError(f"{name}.g_idx: groups of {sorted(set(counts.tolist()))} inputs have "
                          f"no even common size (the largest common divisor is {common}); the "
                          "engine's int4 packs two inputs per byte within a group")
    return common


def to_quantized_linear(t: Int4Groups, bias: torch.Tensor | None = None,
                        name: str = "weight", group_size: int | None = None) -> QuantizedLinear:
    """The engine's int4 layer for ``t``, every weight as the checkpoint defines it.

    The columns are sorted by group (stably; nothing moves without act-order) and the
    permutation is kept as the layer's ``input_perm``; each group becomes groups of
    :func:`sub_group_size` that share its scale and zero. ``group_size``: the config's (checked
    against ``g_idx``; None takes the first group's count)."""
    n, k = t.qweight.shape
    counts = group_counts(t.g_idx, t.scales.shape[1], name, group_size)
    sub = sub_group_size(counts, name)
    perm = torch.argsort(t.g_idx.long(), stable=True)
    repeat = counts // sub
    scales = t.scales.repeat_interleave(repeat, dim=1)
    zeros = t.zeros.repeat_interleave(repeat, dim=1)
    q = t.qweight[:, perm].long()
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    minimum = -(zeros.float() * scales.float())  # exact in fp32 (module docstring)
    tensors = {"qweight": packed, "scale": scales.contiguous(), "minimum": minimum}
    moved = not torch.equal(perm, torch.arange(k))
    return QuantizedLinear("int4", tensors, k, n, bias, sub, perm if moved else None)
