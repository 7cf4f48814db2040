"""RMSNorm in Triton, fused with the residual add.

Unfused, ``norm(x + r)`` reads x and r, writes the sum, reads the sum back twice (the mean of
squares, then the scaling) and writes the output. Fused, each row is read once into registers:
x and r in, the sum and the output out — four row-passes over memory instead of seven.
One program handles one row (a token's hidden vector), which fits in registers for any real
hidden size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    n_cols, x_stride, res_stride, out_stride, sum_stride, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols  # the hidden size need not be a power of two
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        tl.store(sum_ptr + row * sum_stride + cols, x, mask=mask)  # the new residual stream
    h = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    # Round to the input dtype before the weight, as the reference does.
    h = (h * inv_rms).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`~infer_lab.kernels.reference.rms_norm_ref`; inputs untouched."""
    shape, n = x.shape, x.shape[-1]
    x2 = x.reshape(-1, n)  # a view when possible, a copy for e.g. heads split out of a qkv row
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        total = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    else:
        r2 = total = x2  # unused: HAS_RESIDUAL is False
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out, total, n, x2.stride(0), r2.stride(0), out.stride(0),
            total.stride(0), eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    out = out.view(shape)
    return out if residual is None else (out, total.view(shape))
