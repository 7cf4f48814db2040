"""Microscaling: MXFP8 and MXFP4 (OCP MX v1.0), and NVIDIA's NVFP4 (Blackwell).

Both put a small block of values behind one shared scale, so that an outlier costs only its own
block's precision:

- **MX** (OCP Microscaling Formats v1.0): blocks of 32 along a row share an *E8M0* scale, a bare
  power of two ``2^(c - 127)`` in one byte. The spec's shared exponent is
  ``floor(log2(amax)) - emax_elem``, where ``emax_elem`` is the exponent of the element format's
  largest value (8 for E4M3, 2 for FP4 E2M1), and each element is ``x / 2^shared`` cast to the
  element format, rounding to nearest even and saturating. MXFP8: 8 + 8/32 = 8.25 bits per
  weight; MXFP4: 4 + 8/32 = 4.25. A power-of-two scale is cheap in hardware but coarse: the
  block's largest value can land anywhere in [emax, 2*emax), and E2M1 above 6 saturates.
- **NVFP4**: blocks of 16 share an *E4M3* scale (a real FP8 number, so the block's largest value
  maps close to 6), and the tensor has one float32 scale on top so that the E4M3 block scales
  stay in their range: ``global = amax(tensor) / (448 * 6)``, ``s_b = e4m3(amax_b / 6 / global)``,
  element ``e2m1(x / (s_b * global))``. 4 + 8/16 = 4.5 bits per weight (plus 32 per tensor).

A block must divide the row (no partial blocks: the hardware has none); an all-zero block gets
the smallest scale (ggml's choice for MX, scale 0 and zeros for NVFP4). An MX exponent outside
E8M0's range (a block whose values are all below ~2^-125) is refused, as are NaN weights and
NaN/zero/inf scales when decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer_lab.model.quant import FormatError
from infer_lab.model.quant.fp8 import check_finite, check_scale
from infer_lab.model.quant.minifloat import E2M1, E4M3, FORMATS, e8m0_decode, e8m0_encode

MX_BLOCK = 32
NVFP4_BLOCK = 16
MX_ELEMENTS = {"mxfp8": "fp8_e4m3", "mxfp8_e5m2": "fp8_e5m2", "mxfp4": "fp4_e2m1"}


def check_block(k: int, block: int, name: str, fmt: str) -> None:
    """Raise :class:`FormatError` unless blocks of ``block`` tile a row of ``k`` exactly."""
    if k % block:
        raise FormatError(f"{name}: {fmt} blocks of {block} do not divide its rows of {k} "
                          "values")


def _blocks(w: torch.Tensor, block: int, name: str, fmt: str) -> torch.Tensor:
    if w.dim() != 2:
        raise FormatError(f"{name}: {fmt} takes a 2-D tensor, got {tuple(w.shape)}")
    check_block(w.shape[1], block, name, fmt)
    check_finite(w, name)
    return w.detach().float().view(w.shape[0], -1, block)


@dataclass
class MXTensor:
    """An MX tensor: element codes ``[N, K]`` (uint8, one per value) and E8M0 scale codes
    ``[N, K / 32]``."""

    codes: torch.Tensor
    scale: torch.Tensor
    fmt: str

    @property
    def bits_per_weight(self) -> float:
        return FORMATS[MX_ELEMENTS[self.fmt]].bits + 8 / MX_BLOCK

    def dequantize(self, name: str = "weight") -> torch.Tensor:
        return dequantize_mx(self, name)


def quantize_mx(w: torch.Tensor, fmt: str = "mxfp4", name: str = "weight") -> MXTensor:
    """``w [N, K]`` in ``fmt`` (``mxfp8``, ``mxfp8_e5m2`` or ``mxfp4``), blocks of 32 along K."""
    if fmt not in MX_ELEMENTS:
        raise FormatError(f"MX format must be one of {tuple(MX_ELEMENTS)}, got {fmt!r}")
    elem = FORMATS[MX_ELEMENTS[fmt]]
    g = _blocks(w, MX_BLOCK, name, fmt)
    amax = g.abs().amax(-1)
    exp = torch.where(amax > 0, torch.frexp(amax)[1] - 1 - elem.emax,
                      torch.full_like(amax, -127, dtype=torch.int32))
    scale = e8m0_encode(exp, f"{name} ({fmt})")
    x = g / e8m0_decode(scale)[..., None]
    codes = elem.encode(x, name, signed_zero=fmt != "mxfp4").view(w.shape)
    return MXTensor(codes, scale, fmt)


def dequantize_mx(t: MXTensor, name: str = "weight") -> torch.Tensor:
    elem = FORMATS[MX_ELEMENTS[t.fmt]]
    n, k = t.codes.shape
    scale = e8m0_decode(t.scale, f"{name} scale")
    values = elem.decode(t.codes).view(n, -1, MX_BLOCK) * scale[..., None]
    if not torch.isfinite(values).all():
        raise FormatError(f"{name}: NaN or inf element codes")
    return values.view(n, k)


@dataclass
class NVFP4Tensor:
    """NVFP4: E2M1 codes ``[N, K]``, E4M3 block-scale codes ``[N, K / 16]``, a float32
    tensor scale."""

    codes: torch.Tensor
    block_scale: torch.Tensor
    tensor_scale: torch.Tensor

    @property
    def bits_per_weight(self) -> float:
        return 4 + 8 / NVFP4_BLOCK + 32 / self.codes.numel()

    def dequantize(self, name: str = "weight") -> torch.Tensor:
        return dequantize_nvfp4(self, name)


def quantize_nvfp4(w: torch.Tensor, name: str = "weight") -> NVFP4Tensor:
    """``w [N, K]`` in NVFP4 (blocks of 16 along K)."""
    g = _blocks(w, NVFP4_BLOCK, name, "nvfp4")
    amax = g.abs().amax()
    tensor_scale = amax / (E4M3.max_finite * E2M1.max_finite) if amax > 0 else torch.tensor(1.0)
    block_scale = E4M3.encode(g.abs().amax(-1) / E2M1.max_finite / tensor_scale, name)
    denom = E4M3.decode(block_scale)[..., None] * tensor_scale
    x = torch.where(denom > 0, g / torch.where(denom > 0, denom, 1.0), 0.0)
    codes = E2M1.encode(x, name, signed_zero=False).view(w.shape)
    return NVFP4Tensor(codes, block_scale, tensor_scale.float().reshape(()))


def dequantize_nvfp4(t: NVFP4Tensor, name: str = "weight") -> torch.Tensor:
    check_scale(t.tensor_scale, f"{name} tensor scale")
    bs = E4M3.decode(t.block_scale)
    if not torch.isfinite(bs).all() or (bs < 0).any():
        raise FormatError(f"{name}: NaN or negative E4M3 block scales")
    n, k = t.codes.shape
    values = E2M1.decode(t.codes).view(n, -1, NVFP4_BLOCK) * bs[..., None] * t.tensor_scale
    return values.view(n, k)


# ------------------------------------------------------------------ ggml's block layouts
def mxfp4_to_ggml(t: MXTensor) -> torch.Tensor:
    """The same MXFP4 tensor as ggml's 17-byte blocks (E8M0 byte, then value ``j`` in the low
    nibble of byte ``j`` and value ``j + 16`` in its high nibble), ``[N * K / 32, 17]``."""
    c = t.codes.view(-1, MX_BLOCK)
    qs = c[:, :16] | (c[:, 16:] << 4)
    return torch.cat([t.scale.reshape(-1, 1), qs], dim=1)


def nvfp4_to_ggml(t: NVFP4Tensor) -> torch.Tensor:
    """ggml's NVFP4 blocks of 64 values (four E4M3 block scales, then per block of 16 value ``j``
    in the low nibble of byte ``j`` and value ``j + 8`` in its high one), ``[N * K / 64, 36]``.
    ggml has no tensor scale: its values are ours divided by ``tensor_scale``."""
    c = t.codes.view(-1, 4, NVFP4_BLOCK)
    qs = (c[..., :8] | (c[..., 8:] << 4)).reshape(-1, 32)
    return torch.cat([t.block_scale.reshape(-1, 4), qs], dim=1)
