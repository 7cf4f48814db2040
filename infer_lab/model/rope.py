"""Rotary-embedding frequencies, including Llama 3.1's long-context scaling."""

from __future__ import annotations

import math

import torch

from infer_lab.model.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int, max_positions: int) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` in fp32 for the configured RoPE type.

    ``llama3`` leaves high frequencies alone, divides low frequencies by ``factor`` and blends the
    band in between: short-range position information survives a longer context.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    # llama3
    old_len = rope.original_max_position_embeddings or max_positions
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)
