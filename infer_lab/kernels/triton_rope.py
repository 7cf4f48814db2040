"""Rotary position embedding in Triton, applied in place to q and k.

Llama's layout pairs dimension i with i + D/2 ("rotate half"). Llama-3 frequency scaling lives in
``inv_freq`` (see :func:`infer_lab.model.rope.rope_inv_freq`), so the kernel is the same for every
RoPE type. One program rotates every head of one token: the cos/sin of that position are computed
once, in fp32, and shared by all q and k heads — no cos/sin table is read from memory at all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(ptr, tok_stride, head_stride, tok, n_heads, half, cos, sin,
            BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (dims < half)
    first = ptr + tok * tok_stride + heads * head_stride + dims
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=mask)
    tl.store(first + half, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, inv_freq_ptr,
    q_tok_stride, q_head_stride, k_tok_stride, k_head_stride, n_q_heads, n_k_heads, half,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    pos = tl.load(pos_ptr + tok).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + dims, mask=dims < half, other=0.0).to(tl.float32)
    angle = (pos * inv_freq)[None, :]
    cos, sin = tl.cos(angle), tl.sin(angle)
    _rotate(q_ptr, q_tok_stride, q_head_stride, tok, n_q_heads, half, cos, sin,
            BLOCK_HQ, BLOCK_HALF)
    _rotate(k_ptr, k_tok_stride, k_head_stride, tok, n_k_heads, half, cos, sin,
            BLOCK_HK, BLOCK_HALF)


def _as_tokens(x: torch.Tensor) -> torch.Tensor:
    """``[..., H, D]`` as ``[tokens, H, D]`` sharing memory with ``x`` (unit stride in D)."""
    try:
        flat = x.view(-1, *x.shape[-2:])
    except RuntimeError:
        raise ValueError("q/k cannot be viewed as [tokens, heads, head_dim]") from None
    if flat.stride(-1) != 1:
        raise ValueError("q/k need unit stride in head_dim")
    return flat


def rope_triton_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[..., Hq, D]`` and k ``[..., Hkv, D]`` in place; returns them.

    They may be strided views (heads split out of a fused qkv projection): written where they lie.
    Views that cannot be flattened are rotated in a contiguous copy and copied back.
    """
    try:
        qf, kf = _as_tokens(q), _as_tokens(k)
    except ValueError:
        qc, kc = q.contiguous(), k.contiguous()
        rope_triton_(qc, kc, positions, inv_freq)
        q.copy_(qc)
        k.copy_(kc)
        return q, k
    d = q.shape[-1]
    if d % 2 or k.shape[-1] != d or inv_freq.numel() != d // 2:
        raise ValueError(f"head_dim {d} / {k.shape[-1]} and {inv_freq.numel()} frequencies")
    pos = positions.reshape(-1)
    if pos.numel() != qf.shape[0] or kf.shape[0] != qf.shape[0]:
        raise ValueError(f"{pos.numel()} positions for {qf.shape[0]} q and {kf.shape[0]} k tokens")
    if qf.shape[0]:
        _rope_kernel[(qf.shape[0],)](
            qf, kf, pos.contiguous(), inv_freq.to(torch.float32).contiguous(),
            qf.stride(0), qf.stride(1), kf.stride(0), kf.stride(1), qf.shape[1], kf.shape[1],
            d // 2,
            BLOCK_HQ=triton.next_power_of_2(qf.shape[1]),
            BLOCK_HK=triton.next_power_of_2(kf.shape[1]),
            BLOCK_HALF=triton.next_power_of_2(d // 2), num_warps=4,
        )
    return q, k
