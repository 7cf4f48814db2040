"""Plain-torch reference versions of the small fused ops.

These are the definitions: every faster kernel (Chapter 4) is tested against them, and they are
what runs wherever Triton cannot (CPU, macOS, Windows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in fp32, as Llama defines it; with ``residual``, add it first and return both.

    The fused form ``(norm(x + residual), x + residual)`` is how an engine saves a pass over the
    hidden states: the sum is needed twice (normalised now, as the residual stream later).
    """
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``position * inv_freq``, computed in fp32 then cast, as transformers does."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[..., Hq, D]`` and k ``[..., Hkv, D]`` by their positions ``[...]``.

    Llama's layout ("rotate half"): dimension i pairs with i + D/2, not with its neighbour.
    """
    cos, sin = rope_cos_sin(positions, inv_freq, q.dtype)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: ``silu(x[..., :n]) * x[..., n:]`` for the fused gate/up projection."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k``/``v`` ``[T, Hkv, D]`` into cache slots (``block * block_size + offset``)."""
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)
