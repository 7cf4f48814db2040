"""Checkpoints quantized before they were shipped: GPTQ and AWQ int4 into the engine's int4.

Most quantized checkpoints on the hub are Hugging Face directories whose ``config.json`` carries
a ``quantization_config`` (what transformers and vLLM read), e.g.
``{"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false, "sym": true}`` or
``{"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm"}``,
and whose every layer linear ``X`` is stored as ``X.qweight``, ``X.qzeros``, ``X.scales`` (and
for GPTQ ``X.g_idx``) instead of ``X.weight``. :func:`load_prequantized` reads such a directory:
the dense tensors (embedding, norms, biases) fill the model as usual, and each linear's packed
tensors are unpacked (:mod:`.gptq_checkpoint`, :mod:`.awq_checkpoint`), the pieces of a fused
projection (q/k/v, gate/up) joined, and handed to the engine's int4 kernels as a
:class:`~infer_lab.model.quantize.QuantizedLinear` without rounding anything again.

A GPTQ layer whose last group is short (``K`` not a multiple of ``group_size``) or whose groups
are not consecutive inputs (act-order, ``desc_act: true``) loads too, exactly
(:func:`~infer_lab.model.quant.gptq_checkpoint.to_quantized_linear` says how).

What is refused, by name: bits other than 4, an AWQ layout other than GEMM or without zero
points, a missing or mis-shaped tensor, a ``g_idx`` out of range or whose groups do not hold
``group_size`` inputs each (but a shorter last one), an act-order ``g_idx`` under
``desc_act: false``, and the pieces of a fused projection (q/k/v, gate/up) with different
``g_idx``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infer_lab.device import default_device, resolve_dtype
from infer_lab.model.checkpoint import Checkpoint, Weight, allocate, fill, plan_fill
from infer_lab.model.quant import FormatError
from infer_lab.model.quant.awq_checkpoint import unpack_awq
from infer_lab.model.quant.gptq import Int4Groups
from infer_lab.model.quant.gptq_checkpoint import group_counts, to_quantized_linear, unpack_gptq
from infer_lab.model.transformer import Transformer

METHODS = ("gptq", "awq")
PACKED = ("qweight", "qzeros", "scales", "g_idx")
UNPACKED = " (unpacked)"  # how a packed linear is named where the fill plan reports its shape


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's ``quantization_config``, as far as loading it needs."""

    method: str  # "gptq" or "awq"
    group_size: int  # -1: one group per row
    desc_act: bool = False
    sym: bool = False
    zero_offset: int = 0  # GPTQ's v1 format stores zero - 1
    lm_head: bool = False  # the LM head quantized too (gptqmodel's and vLLM's ``lm_head``)

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> QuantConfig:
        def bad(field: str, why: str) -> FormatError:
            return FormatError(f"{where}: quantization_config.{field} {why}")

        if not isinstance(raw, dict):
            raise bad("", f"must be an object, got {type(raw).__name__}")
        method = raw.get("quant_method")
        if method not in METHODS:
            raise bad("quant_method", f"is {method!r}; infer_lab reads {METHODS}")
        bits = raw.get("bits", raw.get("w_bit"))
        if bits != 4:
            raise bad("bits", f"is {bits!r}; infer_lab reads 4-bit {method.upper()} only")
        group = raw.get("group_size", raw.get("q_group_size"))
        if isinstance(group, bool) or not isinstance(group, int) or not (group == -1 or
                                                                        group > 0):
            raise bad("group_size", f"is {group!r}, not a positive integer or -1")
        flags = {f: raw.get(f, False) for f in ("desc_act", "sym", "lm_head")}
        for f, v in flags.items():
            if not isinstance(v, bool):
                raise bad(f, f"is {v!r}, not true or false")
        if method == "awq":
            return cls._awq(raw, group, bad)
        fmt = raw.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise bad("checkpoint_format", f"is {fmt!r}; infer_lab reads gptq and gptq_v2")
        return cls("gptq", group, flags["desc_act"], flags["sym"], int(fmt == "gptq"),
                   flags["lm_head"])

    @classmethod
    def _awq(cls, raw: dict, group: int, bad: Any) -> QuantConfig:
        version = str(raw.get("version", "gemm")).lower()
        if version != "gemm":
            raise bad("version", f"is {version!r}; infer_lab reads AWQ's GEMM layout")
        if raw.get("zero_point", True) is not True:
            raise bad("zero_point", "is not true; infer_lab reads AWQ with zero points")
        return cls("awq", group)

    def unpack(self, tensors: dict[str, torch.Tensor], name: str) -> Int4Groups:
        """One linear's (or one piece's) tensors as :class:`Int4Groups`."""
        if self.method == "awq":
            return unpack_awq(tensors, self.group_size, name)
        if "g_idx" not in tensors and not self.desc_act and "qweight" in tensors:
            k = tensors["qweight"].shape[0] * 8  # without act-order g_idx may be left out
            g = k if self.group_size == -1 else self.group_size
            tensors = {**tensors, "g_idx": torch.arange(k) // g}
        t = unpack_gptq(tensors, name, self.zero_offset)
        k, groups = t.qweight.shape[1], t.scales.shape[1]
        g = k if self.group_size == -1 else self.group_size
        if groups != -(-k // g):
            raise FormatError(f"{name}: GPTQ shapes do not agree with group_size "
                              f"{self.group_size}: {groups} groups of scales for {k} inputs")
        if self.sym and not bool((t.zeros == 8).all()):
            raise FormatError(f"{name}.qzeros: quantization_config.sym is true but the zero "
                              "points are not all 8")
        group_counts(t.g_idx, groups, name, min(g, k))  # one of GPTQ's two layouts
        if not self.desc_act and not t.sorted_groups:
            raise FormatError(f"{name}.g_idx: its groups are not consecutive inputs (act-order) "
                              "but quantization_config.desc_act is false, and vLLM ignores "
                              "g_idx then: set desc_act true if g_idx is meant")
        return t

    def layer_group_size(self, in_features: int) -> int:
        """The group size the config gives a layer of ``in_features`` inputs."""
        return in_features if self.group_size == -1 else min(self.group_size, in_features)


def read_quant_config(path: Path) -> QuantConfig | None:
    """The ``quantization_config`` of the checkpoint directory ``path``; None if it has none."""
    config = path / "config.json"
    if not config.is_file():
        return None
    try:
        raw = json.loads(config.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # the config reader gives the error for that
    if not isinstance(raw, dict) or raw.get("quantization_config") is None:
        return None
    return QuantConfig.from_dict(raw["quantization_config"], str(config))


def _packed_pieces(weights: list[Weight]) -> dict[tuple[str, int | None], dict[str, Weight]]:
    """The packed tensors by (our module, piece of a fused one or None)."""
    pieces: dict[tuple[str, int | None], dict[str, Weight]] = {}
    for w in weights:
        module, _, kind = (w.param or "").rpartition(".")
        if kind in PACKED:
            pieces.setdefault((module, w.part), {})[kind] = w
    return pieces


def _checkpoint_name(piece: dict[str, Weight]) -> str:
    """The checkpoint's name of a piece's linear (``model.layers.0.self_attn.q_proj``)."""
    return next(iter(piece.values())).name.rpartition(".")[0]


def _stand_in(piece: dict[str, Weight], module: str, part: int | None,
              t: Int4Groups) -> Weight:
    """The dense weight this piece stands for, so that the fill plan checks its shape against
    the config and counts the parameter as covered (it is never read)."""
    name = _checkpoint_name(piece)

    def never() -> torch.Tensor:
        raise AssertionError(f"{name}: a packed weight is never read dense")

    where = next(iter(piece.values())).where
    return Weight(f"{name}{UNPACKED}", f"{module}.weight", part, tuple(t.qweight.shape), never,
                  where)


@torch.no_grad()
def load_prequantized(checkpoint: Checkpoint, qc: QuantConfig,
                      device: torch.device | str | None = None,
                      dtype: torch.dtype | str | None = None) -> Transformer:
    """The model of a GPTQ or AWQ checkpoint, its layer linears in the engine's int4."""
    cfg = checkpoint.config()
    weights = list(checkpoint.weights())
    pieces = _packed_pieces(weights)
    _check_head(("lm_head", None) in pieces, qc, cfg.tie_word_embeddings)
    groups: dict[str, list[tuple[int, Int4Groups]]] = {}
    stand_ins = []
    for (module, part), piece in pieces.items():
        t = qc.unpack({k: w.read() for k, w in piece.items()}, _checkpoint_name(piece))
        groups.setdefault(module, []).append((part or 0, t))
        stand_ins.append(_stand_in(piece, module, part, t))
    dense = [w for w in weights if (w.param or "").rpartition(".")[2] not in PACKED]
    copies = plan_fill(cfg, dense + stand_ins, checkpoint.errors)  # shapes vs the config
    copies = [c for c in copies if not c.weight.name.endswith(UNPACKED)]
    device = torch.device(device) if device is not None else default_device()
    model = allocate(cfg, device, resolve_dtype(dtype, device), checkpoint.errors)
    fill(model, copies)
    for module, parts in groups.items():
        _set_int4_layer(model, module, [t for _, t in sorted(parts, key=lambda p: p[0])], qc)
    model.quantization = f"{qc.method}-int4-g{qc.group_size}"
    return model.eval().requires_grad_(False)


def _check_head(packed: bool, qc: QuantConfig, tied: bool) -> None:
    """A packed LM head only where ``quantization_config.lm_head`` says so (vLLM reads the
    flag, not the tensors), and never in a model whose head is its embedding."""
    if packed != qc.lm_head:
        raise FormatError(f"lm_head: quantization_config.lm_head is {str(qc.lm_head).lower()} "
                          f"but the checkpoint's lm_head is {'' if packed else 'not '}packed "
                          "(qweight/qzeros/scales)")
    if packed and tied:
        raise FormatError("lm_head: packed, but config.json ties the head to the embedding "
                          "(tie_word_embeddings), which is stored dense: one matrix cannot be "
                          "both")


def _set_int4_layer(model: nn.Module, module: str, parts: list[Int4Groups],
                    qc: QuantConfig) -> None:
    """Module ``module`` becomes the engine's int4 layer of its pieces joined along the rows."""
    if any(not torch.equal(p.g_idx, parts[0].g_idx) for p in parts):
        raise FormatError(f"{module}: its pieces (q/k/v or gate/up) have different g_idx")
    t = Int4Groups(*(torch.cat([getattr(p, f) for p in parts]) for f in
                     ("qweight", "scales", "zeros")), parts[0].g_idx)
    old = model.get_submodule(module)
    bias = None if getattr(old, "bias", None) is None else old.bias.detach().clone()
    group = qc.layer_group_size(t.qweight.shape[1])
    layer = to_quantized_linear(t, bias, module, group).to(old.weight.device)
    parent, _, attr = module.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, layer)
