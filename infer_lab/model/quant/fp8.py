"""FP8 weights and activations with a float32 scale per tensor, per channel or per 128x128 block.

An FP8 number has a fixed *relative* precision (3 mantissa bits in E4M3: steps of 1/8 to 1/16
of the value) over a range set by its exponent, so unlike int8 it needs a scale only to put the
tensor's largest value near the format's top (448 for E4M3), ``scale = amax / 448``, and
``w ≈ fp8(w / scale) * scale``. Where the scale is taken decides how well small values survive
beside an outlier:

- ``"tensor"``: one scale (what Hopper's ``torch._scaled_mm`` took first; vLLM's default FP8);
- ``"channel"``: one per output row (weights) or per token (activations, computed on the fly);
- ``"block"``: one per 128x128 tile of the weight, as DeepSeek-V3 ships; tiles at the right and
  bottom edges may be smaller (a ``[N, K]`` weight has ``ceil(N/128) x ceil(K/128)`` scales).

Decoding refuses a scale of zero, inf or NaN (a checkpoint with one would be silent garbage).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from infer_lab.model.quant import FormatError
from infer_lab.model.quant.minifloat import FORMATS, Minifloat

GRANULARITIES = ("tensor", "channel", "block")
BLOCK = 128


@dataclass
class FP8Tensor:
    """A 2-D tensor in FP8: codes ``[N, K]`` (uint8), float32 scales shaped by granularity."""

    codes: torch.Tensor
    scale: torch.Tensor  # [] per tensor, [N] per channel, [ceil(N/b), ceil(K/b)] per block
    fmt: str
    granularity: str
    block: int = BLOCK

    @property
    def bits_per_weight(self) -> float:
        return 8 + 32 * self.scale.numel() / self.codes.numel()

    def dequantize(self, name: str = "weight") -> torch.Tensor:
        return dequantize_fp8(self, name)


def check_finite(x: torch.Tensor, name: str) -> None:
    """Raise :class:`FormatError` naming ``name`` if ``x`` holds NaN or inf."""
    if not torch.isfinite(x).all():
        n = int((~torch.isfinite(x)).sum())
        raise FormatError(f"{name}: {n} NaN or inf value(s); refusing to quantize it")


def check_scale(scale: torch.Tensor, name: str) -> None:
    """Raise :class:`FormatError` unless every scale is finite and positive."""
    bad = ~torch.isfinite(scale) | (scale <= 0)
    if bad.any():
        first = scale.flatten()[bad.flatten()][0].item()
        raise FormatError(f"{name}: {int(bad.sum())} scale(s) zero, negative, inf or NaN "
                          f"(e.g. {first}); a scale must be finite and positive")


def _fmt(fmt: str) -> Minifloat:
    if fmt not in ("fp8_e4m3", "fp8_e5m2"):
        raise FormatError(f"FP8 format must be fp8_e4m3 or fp8_e5m2, got {fmt!r}")
    return FORMATS[fmt]


def _expand(scale: torch.Tensor, shape: torch.Size, granularity: str, block: int
            ) -> torch.Tensor:
    """The scale of every element of a ``shape`` tensor."""
    if granularity == "tensor":
        return scale.expand(shape)
    if granularity == "channel":
        return scale[:, None].expand(shape)
    n, k = shape
    return scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]


def fp8_scales(w: torch.Tensor, fmt: str = "fp8_e4m3", granularity: str = "tensor",
               block: int = BLOCK) -> torch.Tensor:
    """``amax / max_finite`` at ``granularity`` (an all-zero group gets scale 1)."""
    f = _fmt(fmt)
    a = w.detach().float().abs()
    if granularity == "tensor":
        amax = a.amax()
    elif granularity == "channel":
        amax = a.amax(dim=1)
    elif granularity == "block":
        n, k = a.shape
        padded = torch.zeros(math.ceil(n / block) * block, math.ceil(k / block) * block)
        padded[:n, :k] = a
        amax = padded.view(padded.shape[0] // block, block, -1, block).amax(dim=(1, 3))
    else:
        raise FormatError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    scale = amax / f.max_finite
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_fp8(w: torch.Tensor, fmt: str = "fp8_e4m3", granularity: str = "tensor",
                 block: int = BLOCK, name: str = "weight") -> FP8Tensor:
    """``w [N, K]`` in FP8 with scales at ``granularity`` (round to nearest even, saturating)."""
    if w.dim() != 2:
        raise FormatError(f"{name}: FP8 quantization takes a 2-D tensor, got {tuple(w.shape)}")
    check_finite(w, name)
    scale = fp8_scales(w, fmt, granularity, block)
    codes = _fmt(fmt).encode(w.float() / _expand(scale, w.shape, granularity, block), name)
    return FP8Tensor(codes, scale, fmt, granularity, block)


def dequantize_fp8(t: FP8Tensor, name: str = "weight") -> torch.Tensor:
    """float32 values of an :class:`FP8Tensor`; refuses bad scales and NaN codes."""
    check_scale(t.scale, f"{name} scale")
    values = _fmt(t.fmt).decode(t.codes)
    if not torch.isfinite(values).all():
        raise FormatError(f"{name}: NaN or inf FP8 codes")
    return values * _expand(t.scale, t.codes.shape, t.granularity, t.block)


def fake_quant_fp8(w: torch.Tensor, fmt: str = "fp8_e4m3", granularity: str = "tensor",
                   name: str = "weight") -> torch.Tensor:
    """``w`` through FP8 and back (what a model computing with it sees)."""
    return dequantize_fp8(quantize_fp8(w, fmt, granularity, name=name), name)
