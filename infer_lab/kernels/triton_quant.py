"""Triton matmuls that dequantize the weight inside the kernel: W8A16 and W4A16 (Chapter 8).

The weight never exists in 16 bits anywhere in memory: each program loads a tile of int8 (or
packed int4) codes with its scales, widens it in registers and multiplies. So a decode step reads
1 (or ~0.6) byte per weight instead of 2, which is the whole point at batch 1.

Two shapes of kernel, picked by the number of rows of ``x``:

- GEMV (decode, ``M <= TRITON_GEMV_MAX_ROWS``): a program owns ``BLOCK_N`` output columns of one
  row and walks ``K``; the reduction is an elementwise product and a sum, no tensor cores needed.
- GEMM (prefill): a ``BLOCK_M x BLOCK_N`` output tile per program with ``tl.dot``.

int4 codes are nibble-packed along ``K`` (low nibble: even column, see
:func:`infer_lab.model.quantize.quantize_int4`). Rather than interleave the two nibbles back into
one tile, the kernels multiply the even columns of ``x`` by the low nibbles and the odd columns by
the high ones. A group's scale and minimum factor out of its sum:
``sum_k x_k (q_k s + m) = s * sum_k x_k q_k + m * sum_k x_k``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer_lab.kernels.quant import TRITON_GEMV_MAX_ROWS


@triton.jit
def _w8_gemv(x_ptr, q_ptr, s_ptr, y_ptr, N, K, stride_xm, stride_qn, stride_ym,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + n[:, None] * stride_qn + k[None, :],
                    mask=(n[:, None] < N) & (k[None, :] < K), other=0).to(tl.float32)
        acc += tl.sum(q * x[None, :], axis=1)
    s = tl.load(s_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + n, (acc * s).to(y_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _w8_gemm(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_ym,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             IEEE: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :],
                    mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(q_ptr + rn[None, :] * stride_qn + k[:, None],
                    mask=(rn[None, :] < N) & (k[:, None] < K), other=0).to(a.dtype)  # [K, N]
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    s = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    out = (acc * s[None, :]).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], out,
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _w4_gemv(x_ptr, p_ptr, s_ptr, z_ptr, y_ptr, N, K, stride_xm, stride_pn, stride_sn,
             stride_ym, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    # One group of GROUP weights (GROUP // 2 bytes) per iteration.
    HALF: tl.constexpr = GROUP // 2
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    j = tl.arange(0, HALF)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for g in range(0, K // GROUP):
        kb = g * HALF + j  # byte index within the row
        xe = tl.load(x_ptr + m * stride_xm + 2 * kb).to(tl.float32)
        xo = tl.load(x_ptr + m * stride_xm + 2 * kb + 1).to(tl.float32)
        p = tl.load(p_ptr + n[:, None] * stride_pn + kb[None, :], mask=nmask[:, None],
                    other=0).to(tl.int32)
        lo = (p & 15).to(tl.float32)
        hi = ((p >> 4) & 15).to(tl.float32)
        dot = tl.sum(lo * xe[None, :] + hi * xo[None, :], axis=1)
        s = tl.load(s_ptr + n * stride_sn + g, mask=nmask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + n * stride_sn + g, mask=nmask, other=0.0).to(tl.float32)
        acc += s * dot + z * (tl.sum(xe, axis=0) + tl.sum(xo, axis=0))
    tl.store(y_ptr + m * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _w4_gemm(x_ptr, p_ptr, s_ptr, z_ptr, y_ptr, M, N, K, stride_xm, stride_pn, stride_sn,
             stride_ym, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             IEEE: tl.constexpr):
    HALF: tl.constexpr = GROUP // 2
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = rm < M, rn < N
    j = tl.arange(0, HALF)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, K // GROUP):
        kb = g * HALF + j
        ae = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * kb[None, :], mask=mmask[:, None],
                     other=0.0)
        ao = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * kb[None, :] + 1,
                     mask=mmask[:, None], other=0.0)
        p = tl.load(p_ptr + rn[None, :] * stride_pn + kb[:, None], mask=nmask[None, :],
                    other=0).to(tl.int32)  # [HALF, N]
        s = tl.load(s_ptr + rn * stride_sn + g, mask=nmask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rn * stride_sn + g, mask=nmask, other=0.0).to(tl.float32)
        # Dequantize the tile in registers, then one dot per nibble half.
        lo = ((p & 15).to(tl.float32) * s[None, :] + z[None, :]).to(ae.dtype)
        hi = (((p >> 4) & 15).to(tl.float32) * s[None, :] + z[None, :]).to(ae.dtype)
        if IEEE:
            acc += tl.dot(ae, lo, input_precision="ieee")
            acc += tl.dot(ao, hi, input_precision="ieee")
        else:
            acc += tl.dot(ae, lo)
            acc += tl.dot(ao, hi)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def _check(x: torch.Tensor, qweight: torch.Tensor, k_per_row: int) -> tuple[int, int, int]:
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    m, k = x.shape
    if qweight.shape[1] != k_per_row:
        raise ValueError(f"x has K={k} but the weight is {tuple(qweight.shape)}")
    return m, qweight.shape[0], k


def w8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
              force: str | None = None) -> torch.Tensor:
    """``x [M, K] @ (qweight int8 [N, K] * scale[:, None]).T`` in ``x``'s dtype.

    ``force`` ``"gemv"``/``"gemm"`` picks a kernel regardless of ``M`` (tests cover both).
    """
    x = x.contiguous()
    m, n, k = _check(x, qweight, x.shape[1])
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    kind = force or ("gemv" if m <= TRITON_GEMV_MAX_ROWS else "gemm")
    if kind == "gemv":
        block_n, block_k = 64, 128
        _w8_gemv[(m, triton.cdiv(n, block_n))](
            x, qweight, scale, y, n, k, x.stride(0), qweight.stride(0), y.stride(0),
            BLOCK_N=block_n, BLOCK_K=block_k)
    else:
        bm, bn, bk = 32, 64, 64
        _w8_gemm[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x, qweight, scale, y, m, n, k, x.stride(0), qweight.stride(0), y.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=x.dtype == torch.float32)
    return y


def w4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
              group_size: int, force: str | None = None) -> torch.Tensor:
    """``x [M, K]`` times the int4 weight ``packed [N, K/2]`` with per-group scale and minimum."""
    x = x.contiguous()
    m, n, k = _check(x, packed, x.shape[1] // 2)
    if k % group_size or group_size < 32 or group_size & (group_size - 1):
        raise ValueError(f"the Triton int4 kernels take power-of-two groups of at least 32 that "
                         f"divide K={k}; got {group_size}")
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    scale, minimum = scale.contiguous(), minimum.contiguous()
    kind = force or ("gemv" if m <= TRITON_GEMV_MAX_ROWS else "gemm")
    if kind == "gemv":
        block_n = 64
        _w4_gemv[(m, triton.cdiv(n, block_n))](
            x, packed, scale, minimum, y, n, k, x.stride(0), packed.stride(0), scale.stride(0),
            y.stride(0), GROUP=group_size, BLOCK_N=block_n)
    else:
        bm, bn = 32, 64
        _w4_gemm[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x, packed, scale, minimum, y, m, n, k, x.stride(0), packed.stride(0),
            scale.stride(0), y.stride(0), GROUP=group_size, BLOCK_M=bm, BLOCK_N=bn,
            IEEE=x.dtype == torch.float32)
    return y
