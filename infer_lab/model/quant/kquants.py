"""llama.cpp's K-quants Q4_K, Q5_K and Q6_K: super-blocks of 256 weights with quantized scales.

Q4_1 (Chapter 8) spends 32 bits of fp16 scale and minimum on every 32 weights: 5 bits per weight.
A K-quant *quantizes the scales too*: a super-block of 256 weights holds one fp16 ``d`` (and for
Q4_K one fp16 ``dmin``), and each sub-block stores small integer multiples of them.

- **Q4_K** (144 bytes, 4.5 bits per weight): ``d``, ``dmin`` (fp16 each), 12 bytes packing eight
  6-bit scales ``sc`` and eight 6-bit mins ``m`` (one per sub-block of 32), then 128 bytes of
  nibbles. Weight ``i`` of sub-block ``j`` is ``d * sc[j] * q - dmin * m[j]``, ``q`` in 0..15.
  Sub-blocks ``2c`` and ``2c + 1`` share the 32 bytes ``32c..32c+31``: low nibbles then high.
  The 12 scale bytes: bytes 0-3 hold ``sc[0..3]`` in their low 6 bits, bytes 4-7 ``m[0..3]``;
  ``sc[4..7]`` and ``m[4..7]`` keep their low 4 bits in bytes 8-11 (low and high nibble) and
  their top 2 bits in the top 2 bits of bytes 0-3 and 4-7.
- **Q5_K** (176 bytes, 5.5 bits per weight): Q4_K with a fifth bit. ``d``, ``dmin``, the same 12
  scale bytes, then 32 bytes ``qh`` and the 128 bytes of low nibbles laid out as Q4_K's. Weight
  ``l`` of sub-block ``j`` takes its top bit from bit ``j`` of ``qh[l]``; ``q`` in 0..31.
- **Q6_K** (210 bytes, 6.5625 bits per weight): 128 bytes ``ql`` (the low 4 bits), 64 bytes
  ``qh`` (the top 2), sixteen int8 scales (one per 16 weights), fp16 ``d``. Weight ``i`` is
  ``d * scales[i // 16] * (q - 32)``, ``q`` in 0..63. Within each half of 128 weights, weight
  ``r`` takes byte ``r % 64`` of the half's 64 ``ql`` bytes (low nibble if ``r < 64``) and
  bits ``2 * (r // 32)`` of byte ``r % 32`` of its 32 ``qh`` bytes.

The decoders follow that layout and are checked against ``gguf``'s dequantizers. ``gguf`` has no
K-quant encoder; ours is the simple *covering* one (llama.cpp's searches scales to lower the
error further): each sub-block's integer scale is rounded *up* so the grid covers the sub-block,
so every weight is within half a step, ``d * sc / 2``, of its value. A row must be a multiple of
256 values (llama.cpp falls back to another type for a tensor whose rows are not).
"""

from __future__ import annotations

import numpy as np
import torch

from infer_lab.model.quant import FormatError
from infer_lab.model.quant.fp8 import check_finite
from infer_lab.model.quant.mx import check_block
from infer_lab.model.quantize import q4k_scale_min

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BITS_PER_WEIGHT = {name: 8 * size / QK_K for name, size in BLOCK_BYTES.items()}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """fp16 values of little-endian byte pairs ``[..., 2]``."""
    return b.contiguous().view(torch.float16).float().squeeze(-1)


def _blocks(data: torch.Tensor | np.ndarray, qtype: str, name: str) -> torch.Tensor:
    b = torch.as_tensor(np.asarray(data, dtype=np.uint8)).reshape(-1)
    if b.numel() % BLOCK_BYTES[qtype]:
        raise FormatError(f"{name}: {b.numel()} bytes are not whole {qtype} blocks "
                          f"of {BLOCK_BYTES[qtype]}")
    return b.view(-1, BLOCK_BYTES[qtype])


# ------------------------------------------------------------------------------ Q4_K
def _scale_min_weights(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``d * sc[j] * q - dmin * m[j]`` of blocks ``b`` and their codes ``q [B, 8, 32]``."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = q4k_scale_min(b[:, 4:16])
    w = d[:, None, None] * sc[..., None] * q.float() - dmin[:, None, None] * m[..., None]
    return w.reshape(-1)


def _low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Codes ``[B, 8, 32]`` of 128 nibble bytes per block: sub-blocks ``2c`` and ``2c + 1`` in
    the low and high nibbles of bytes ``32c..32c+31``."""
    qs = qs.long().view(-1, 4, 32)
    return torch.stack([qs & 15, qs >> 4], dim=2).reshape(-1, 8, 32)


def dequantize_q4_k(data: torch.Tensor | np.ndarray, name: str = "weight") -> torch.Tensor:
    """float32 values ``[B * 256]`` of Q4_K blocks."""
    b = _blocks(data, "Q4_K", name)
    return _scale_min_weights(b, _low_nibbles(b[:, 16:]))


def dequantize_q5_k(data: torch.Tensor | np.ndarray, name: str = "weight") -> torch.Tensor:
    """float32 values ``[B * 256]`` of Q5_K blocks."""
    b = _blocks(data, "Q5_K", name)
    qh = b[:, 16:48].long()
    high = torch.stack([(qh >> j) & 1 for j in range(8)], dim=1)  # [B, 8 sub-blocks, 32]
    return _scale_min_weights(b, _low_nibbles(b[:, 48:]) | (high << 4))


def _f16_up(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to an fp16 value not below it."""
    h = x.half()
    return torch.where(h.float() < x, torch.nextafter(h, torch.tensor(torch.inf).half()),
                       h).float()


def _encode_scale_min(w: torch.Tensor, name: str, qtype: str, top: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The covering encoder of Q4_K (``top`` 15) and Q5_K (31): each block's 16 header bytes
    (``d``, ``dmin``, the 12 scale bytes) ``[B, 16]`` and its codes ``[B, 8, 32]``."""
    g = _kq_input(w, name, qtype).view(-1, 8, 32)
    lo = g.amin(-1).clamp(max=0.0)  # the minimum is subtracted: it must be <= 0
    hi = g.amax(-1)
    dmin = _f16_up((-lo).amax(-1) / 62)  # 62, not 63: room for the rounding up below
    m = torch.where(dmin[:, None] > 0, torch.ceil(-lo / dmin[:, None].clamp(min=1e-30)), 0)
    base = -dmin[:, None] * m
    need = (hi - base) / top
    d = _f16_up(need.amax(-1) / 62)
    sc = torch.where(d[:, None] > 0, torch.ceil(need / d[:, None].clamp(min=1e-30)), 0)
    step = (d[:, None] * sc)[..., None]
    q = torch.where(step > 0, torch.round((g - base[..., None]) / step.clamp(min=1e-30)), 0)
    q = q.clamp(0, top).long()
    sc, m = sc.long(), m.long()
    scales = torch.cat([
        (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
        (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], dim=1)
    head = torch.stack([d.half(), dmin.half()], 1).view(torch.uint8).long()
    return torch.cat([head, scales], dim=1), q


def _pack_low_nibbles(q: torch.Tensor) -> torch.Tensor:
    qb = (q & 15).view(-1, 4, 2, 32)
    return (qb[:, :, 0] | (qb[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(w: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """Q4_K blocks (uint8 ``[N * K / 256, 144]``) of ``w [N, K]``: the covering encoder."""
    head, q = _encode_scale_min(w, name, "Q4_K", 15)
    return torch.cat([head, _pack_low_nibbles(q)], dim=1).to(torch.uint8)


def quantize_q5_k(w: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """Q5_K blocks (uint8 ``[N * K / 256, 176]``) of ``w [N, K]``: the covering encoder."""
    head, q = _encode_scale_min(w, name, "Q5_K", 31)
    qh = sum(((q[:, j] >> 4) & 1) << j for j in range(8))  # [B, 32]: bit j from sub-block j
    return torch.cat([head, qh, _pack_low_nibbles(q)], dim=1).to(torch.uint8)


# ------------------------------------------------------------------------------ Q6_K
def dequantize_q6_k(data: torch.Tensor | np.ndarray, name: str = "weight") -> torch.Tensor:
    """float32 values ``[B * 256]`` of Q6_K blocks."""
    b = _blocks(data, "Q6_K", name)
    ql, qh = b[:, :128].long().view(-1, 2, 64), b[:, 128:192].long().view(-1, 2, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210])
    low = torch.cat([ql & 15, ql >> 4], dim=2)  # [B, 2 halves, 128]
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2)
    q = (low | (high << 4)).view(-1, 16, 16).float() - 32
    return (d[:, None, None] * scales[..., None] * q).reshape(-1)


def quantize_q6_k(w: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """Q6_K blocks (uint8 ``[N * K / 256, 210]``) of ``w [N, K]``: the covering encoder."""
    g = _kq_input(w, name, "Q6_K").view(-1, 16, 16)
    need = g.abs().amax(-1) / 31  # q - 32 in -32..31: 31 steps each side covers both signs
    d = _f16_up(need.amax(-1) / 126)
    sc = torch.where(d[:, None] > 0, torch.ceil(need / d[:, None].clamp(min=1e-30)), 0)
    step = (d[:, None] * sc)[..., None]
    q = torch.where(step > 0, torch.round(g / step.clamp(min=1e-30)), 0).clamp(-32, 31) + 32
    q = q.long().view(-1, 2, 128)
    low, high = q & 15, q >> 4
    ql = (low[..., :64] | (low[..., 64:] << 4)).reshape(-1, 128)
    qh = sum(high[..., 32 * s: 32 * s + 32] << (2 * s) for s in range(4)).reshape(-1, 64)
    scales = sc.to(torch.int8).view(torch.uint8).long()
    dbytes = d.half()[:, None].view(torch.uint8).long()
    return torch.cat([ql, qh, scales, dbytes], dim=1).to(torch.uint8)


def _kq_input(w: torch.Tensor, name: str, qtype: str) -> torch.Tensor:
    if w.dim() != 2:
        raise FormatError(f"{name}: {qtype} takes a 2-D tensor, got {tuple(w.shape)}")
    check_block(w.shape[1], QK_K, name, qtype)
    check_finite(w, name)
    return w.detach().float().reshape(-1, QK_K)


CODECS = {"Q4_K": (quantize_q4_k, dequantize_q4_k), "Q5_K": (quantize_q5_k, dequantize_q5_k),
          "Q6_K": (quantize_q6_k, dequantize_q6_k)}


def fake_quant_kquant(w: torch.Tensor, qtype: str, name: str = "weight") -> torch.Tensor:
    """``w`` through Q4_K, Q5_K or Q6_K and back, shaped like ``w``."""
    if qtype not in CODECS:
        raise FormatError(f"K-quant type must be one of {sorted(CODECS)}, got {qtype!r}")
    enc, dec = CODECS[qtype]
    return dec(enc(w, name), name).view(w.shape)
