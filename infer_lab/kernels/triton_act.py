"""SiLU-and-mul (SwiGLU's gate) in Triton.

The fused gate/up projection gives ``[..., 2n]``; torch would write ``silu(gate)`` to memory and
read it back for the product. One kernel reads each input element once and writes the output once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * out_stride + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :n]) * x[..., n:]`` for ``x`` ``[..., 2n]``."""
    two_n = x.shape[-1]
    if two_n % 2:
        raise ValueError(f"the last dimension must be even (gate and up), got {two_n}")
    n = two_n // 2
    x2 = x.reshape(-1, two_n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    if x2.shape[0] and n:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, out, n, x2.stride(0), out.stride(0), BLOCK=block, num_warps=4,
        )
    return out.view(*x.shape[:-1], n)
