"""The fused mixture-of-experts kernel in Triton: grouped GEMMs over tokens sorted by expert.

:func:`~infer_lab.kernels.moe.moe_align_block_size` lays the (token, expert) pairs out in blocks of
``BLOCK_M`` rows that each belong to one expert. One kernel, launched twice, then does what
:func:`~infer_lab.kernels.moe.moe_grouped` does with a loop and three extra passes over memory:

1. gate/up: each program takes one block of pairs and ``BLOCK_N`` of the expert's ``I`` hidden
   units, gathers the block's token rows straight from ``x`` through ``sorted_token_ids`` (no
   gathered copy of ``x`` is written), multiplies them by that expert's gate rows *and* up rows
   (two accumulators), and stores ``silu(gate) * up``: ``[T*k, I]``, one row per pair;
2. down: the same over those rows and the expert's ``w2``, each row scaled by its routing
   weight, stored per pair: ``[T*k, H]``.

The ``k`` rows of a token are then summed (``[T, k, H].sum(1)``, as vLLM's ``moe_sum``), which
keeps the kernel free of atomics and the result deterministic. The grid is sized from the shapes
alone and programs past ``num_tokens_post_padded`` return at once, so nothing syncs with the host
and the whole layer can be captured in a CUDA graph. Accumulation is fp32; fp32 inputs use IEEE
dots (no TF32), so the interpreter and the GPU agree with the torch reference closely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from infer_lab.kernels.dispatch import gpu_capability
from infer_lab.kernels.moe import moe_align_block_size


@triton.jit
def _fused_moe_kernel(
    a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, expert_ptr, used_ptr,
    N, K, num_pairs, stride_am, stride_be, stride_bn, stride_cm,
    TOP_K: tl.constexpr, SWIGLU: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return  # past the last expert's padded block
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)  # flat (token, slot) index; padding holds num_pairs
    valid = pair < num_pairs
    a_row = (pair // TOP_K).to(tl.int64)  # TOP_K = 1 when A already has one row per pair
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    b_base = b_ptr + expert * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        a = tl.load(a_ptr + a_row[:, None] * stride_am + rk[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_base + rn[None, :] * stride_bn + rk[:, None],
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        if SWIGLU:  # the up rows sit N rows below the gate rows of the same expert
            u = tl.load(b_base + (rn[None, :] + N) * stride_bn + rk[:, None],
                        mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            if IEEE:
                acc_up += tl.dot(a, u, input_precision="ieee")
            else:
                acc_up += tl.dot(a, u)
    if SWIGLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        w = tl.load(w_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    tl.store(c_ptr + pair.to(tl.int64)[:, None] * stride_cm + rn[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class MoETiles:
    """A launch configuration of :func:`_fused_moe_kernel`."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def choose_tiles(num_pairs: int, num_experts: int, dtype: torch.dtype,
                 capability: tuple[int, int] = (8, 0)) -> MoETiles:
    """Small row blocks when each expert gets few rows (decode), bigger ones for prefill; fp32
    tiles are half as deep (twice the bytes per element); Turing (sm_75) gets narrower tiles,
    since the gate and up accumulators side by side otherwise spill registers there.

    ``scripts/gpu_compile.py`` compiles every configuration this can return, per target.
    """
    small = num_pairs <= 4 * num_experts  # at most ~4 rows per expert on average
    if capability < (8, 0):
        return MoETiles(16 if small else 32, 32, 32, 4, 2)
    if dtype == torch.float32:
        return MoETiles(16, 64, 32, 4, 2) if small else MoETiles(32, 32, 32, 4, 2)
    return MoETiles(16 if small else 64, 64, 64, 4, 3)


def tile_configs(dtype: torch.dtype, capability: tuple[int, int]) -> list[MoETiles]:
    """Every configuration :func:`choose_tiles` can pick (what gpu-compile builds)."""
    return sorted({choose_tiles(n, 8, dtype, capability) for n in (1, 1000)},
                  key=lambda t: t.block_m)


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor,
            sorted_ids: torch.Tensor, expert_ids: torch.Tensor, used: torch.Tensor, n: int,
            num_pairs: int, top_k: int, swiglu: bool, mul_weight: bool, t: MoETiles) -> None:
    grid = (expert_ids.numel(), triton.cdiv(n, t.block_n))
    _fused_moe_kernel[grid](
        a, b, c, weights, sorted_ids, expert_ids, used, n, a.shape[1], num_pairs,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        TOP_K=top_k, SWIGLU=swiglu, MUL_WEIGHT=mul_weight, BLOCK_M=t.block_m,
        BLOCK_N=t.block_n, BLOCK_K=t.block_k, IEEE=a.dtype == torch.float32,
        num_warps=t.num_warps, num_stages=t.num_stages)


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     tiles: MoETiles | None = None) -> torch.Tensor:
    """``fused_experts`` for ``x [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``; ``tiles``
    overrides :func:`choose_tiles` (the tests run both kinds)."""
    t, hidden = x.shape
    e, two_i, _ = w13.shape
    k = topk_ids.shape[1]
    if t == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    if tiles is None:
        cap = (8, 0)  # the interpreter: any configuration runs
        if x.is_cuda:
            cap = gpu_capability(x.device.index if x.device.index is not None
                                 else torch.cuda.current_device())
        tiles = choose_tiles(t * k, e, x.dtype, cap)
    sorted_ids, expert_ids, used = moe_align_block_size(topk_ids, tiles.block_m, e)
    weights = topk_weights.contiguous().view(-1)
    act = torch.empty(t * k, two_i // 2, dtype=x.dtype, device=x.device)
    _launch(x, w13, act, weights, sorted_ids, expert_ids, used, two_i // 2, t * k, k,
            True, False, tiles)
    out = torch.empty(t * k, hidden, dtype=x.dtype, device=x.device)
    _launch(act, w2, out, weights, sorted_ids, expert_ids, used, hidden, t * k, 1,
            False, True, tiles)
    return out.view(t, k, hidden).sum(1)
