"""Paged attention in Triton: the K/V store, decode (plain and split-K) and chunked prefill.

All three read the cache of Chapter 3, ``[num_blocks, block_size, Hkv, D]`` per layer, through the
block tables: a tile of ``BLOCK_N`` key positions is gathered slot by slot, so a tile may span
several pages and the page size need not divide anything. Softmax is computed *online*
(Milakov & Gimelshein; FlashAttention): a running maximum ``m``, a running sum ``l`` and an
unnormalised output ``acc`` are rescaled by ``exp(m_old - m_new)`` whenever a tile raises the
maximum, so the scores of a long context never have to exist in memory all at once. Scores are
kept in base 2 (``exp2``, with log2(e) folded into the scale), which is what the hardware computes.

Decode groups the query heads that share a KV head (GQA) into one tile of ``BLOCK_H`` rows, so each
K/V block is read once per group, not once per query head. ``tl.dot`` needs at least 16 rows on a
GPU, so the group is padded to 16 and the padding rows masked.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from infer_lab.kernels.dispatch import interpreting

LOG2E = 1.4426950408889634
NEG_BIG = -1.0e30  # the running max starts finite: exp2(NEG_BIG - NEG_BIG) is 1, not NaN


# ----------------------------------------------------------------------------- store
@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    k_stride_t, k_stride_h, v_stride_t, v_stride_h, c_stride_slot, c_stride_h,
    n_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    live_heads = tl.where(slot >= 0, n_heads, 0)  # slot -1 marks a padding token: no write
    mask = (heads < live_heads) & (dims < head_dim)
    k = tl.load(k_ptr + tok * k_stride_t + heads * k_stride_h + dims, mask=mask)
    v = tl.load(v_ptr + tok * v_stride_t + heads * v_stride_h + dims, mask=mask)
    dst = slot * c_stride_slot + heads * c_stride_h + dims
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.stride(-1) != 1 or k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1):
        raise ValueError("cache blocks must be [num_blocks, block_size, Hkv, D], unit stride in D,"
                         " slots laid end to end")


def store_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k``/``v`` ``[T, Hkv, D]`` (strided views are fine) into their cache slots."""
    _check_cache(k_cache, v_cache)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    t, h, d = k.shape
    if t:
        _store_kv_kernel[(t,)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1),
            k_cache.stride(2), h, d,
            BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d), num_warps=4,
        )


# ----------------------------------------------------------------------------- shared pieces
@triton.jit
def _gather_tile(cache_ptr, table_row_ptr, offs, ok, kv_head, PAGE: tl.constexpr, stride_blk,
                 stride_slot, stride_h, dims, dim_ok):
    """Load positions ``offs`` of one sequence, one KV head: ``[BLOCK_N, BLOCK_D]``."""
    blk = tl.load(table_row_ptr + offs // PAGE, mask=ok, other=0).to(tl.int64)
    row = blk * stride_blk + (offs % PAGE) * stride_slot + kv_head * stride_h
    return tl.load(cache_ptr + row[:, None] + dims[None, :], mask=ok[:, None] & dim_ok[None, :],
                   other=0.0)


@triton.jit
def _online_softmax_step(s, v, m, l_sum, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Fold one tile of base-2 scores ``s`` (masked entries -inf) and values ``v`` in."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)  # how much the old running sums shrink under the new maximum
    p = tl.exp2(s - m_new[:, None])
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    if UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_sum, acc


# ----------------------------------------------------------------------------- decode
@triton.jit
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, table_ptr, ctx_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    scale_log2, window, group, head_dim, min_tiles,
    q_stride_t, q_stride_h, c_stride_blk, c_stride_slot, c_stride_h, table_stride,
    o_stride_t, o_stride_h, max_parts,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    ctx_len = tl.load(ctx_ptr + seq).to(tl.int32)
    hs = tl.arange(0, BLOCK_H)
    heads = kv_head * group + hs  # the q heads of this KV head's group
    head_ok = hs < group
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + seq * q_stride_t + heads[:, None] * q_stride_h + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx_len - window, 0)  # the query at ctx_len-1 sees the last `window`
    tile_lo = lo // BLOCK_N
    tile_hi = tl.cdiv(ctx_len, BLOCK_N)
    if SPLIT:  # this program's partition of the context only: computed here, from the length
        per_part = tl.maximum(tl.cdiv(tl.cdiv(ctx_len, BLOCK_N), max_parts), min_tiles)
        tile_lo = tl.maximum(tile_lo, part * per_part)
        tile_hi = tl.minimum(tile_hi, (part + 1) * per_part)
    q = q.to(tl.float32) if UPCAST else q.to(kc_ptr.dtype.element_ty)
    m = tl.full([BLOCK_H], NEG_BIG, tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table_row = table_ptr + seq * table_stride
    for tile in range(tile_lo, tile_hi):
        offs = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = (offs < ctx_len) & (offs >= lo)
        k = _gather_tile(kc_ptr, table_row, offs, ok, kv_head, PAGE, c_stride_blk,
                         c_stride_slot, c_stride_h, dims, dim_ok)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(ok[None, :], s, float("-inf"))
        v = _gather_tile(vc_ptr, table_row, offs, ok, kv_head, PAGE, c_stride_blk,
                         c_stride_slot, c_stride_h, dims, dim_ok)
        m, l_sum, acc = _online_softmax_step(s, v, m, l_sum, acc, UPCAST, PRECISION)
    if SPLIT:
        # Unnormalised partial result; the reduction kernel rescales the partitions together.
        row = (seq * group * tl.num_programs(1) + heads) * max_parts + part
        tl.store(part_acc_ptr + row[:, None] * BLOCK_D + dims[None, :], acc,
                 mask=head_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m, mask=head_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_sum, mask=head_ok)
    else:
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(out_ptr + seq * o_stride_t + heads[:, None] * o_stride_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])


@triton.jit
def _reduce_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, head_dim, max_parts, o_stride_t, o_stride_h, n_heads,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Combine the partitions of one (sequence, q head): the last step of flash-decoding."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    parts = tl.arange(0, BLOCK_P)
    part_ok = parts < max_parts
    row = (seq * n_heads + head) * max_parts + parts
    m = tl.load(part_ml_ptr + row * 2, mask=part_ok, other=NEG_BIG)
    l_sum = tl.load(part_ml_ptr + row * 2 + 1, mask=part_ok, other=0.0)
    dims = tl.arange(0, BLOCK_D)
    acc = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + dims[None, :],
                  mask=part_ok[:, None], other=0.0)
    weight = tl.exp2(m - tl.max(m, axis=0))  # empty partitions have l = 0 and weigh nothing
    total = tl.sum(weight * l_sum, axis=0)
    out = tl.sum(weight[:, None] * acc, axis=0) / total
    tl.store(out_ptr + seq * o_stride_t + head * o_stride_h + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


def _default_tile(cache: torch.Tensor) -> int:
    """Positions per tile: small in the interpreter (more tiles, more code paths exercised);
    on a GPU 64 for 16-bit data, 32 for fp32 so the pipelined K/V tiles fit in shared memory."""
    if interpreting():
        return 16
    return 64 if cache.element_size() <= 2 else 32


def _precision(cache: torch.Tensor, upcast: bool) -> str:
    """fp32 operands get true fp32 products ("ieee"): by default a GPU rounds them to tf32."""
    return "ieee" if upcast or cache.dtype == torch.float32 else "tf32"


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def auto_splits(num_seqs: int, kv_heads: int, device: torch.device) -> int:
    """How many partitions per context: enough for ~4 programs per SM when the grid of
    (sequence, KV head) alone would leave SMs idle, else 1. Decided from shapes only."""
    if interpreting():
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    programs = num_seqs * kv_heads
    return 1 if programs >= 2 * sms else min(64, triton.cdiv(4 * sms, programs))


def paged_decode_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float | None = None, window: int | None = None, *,
    num_splits: int | None = None, min_split_tokens: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """One query token per sequence (``q`` ``[B, Hq, D]``) over its paged context.

    ``num_splits`` > 1 cuts each context into that many partitions, of at least
    ``min_split_tokens`` positions each, that run in parallel (flash-decoding) and are then
    reduced; 1 never splits; None decides from the grid size. The partitions are computed inside
    the kernel from each sequence's length, so nothing here reads ``context_lens`` on the host:
    no synchronisation, and the launch can be captured in a CUDA graph and replayed at any length.
    """
    _check_cache(k_cache, v_cache)
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not split into groups over {hkv} KV heads")
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    block_n = block_n or _default_tile(k_cache)
    block_d = max(16, triton.next_power_of_2(d))
    block_h = max(16, triton.next_power_of_2(group))  # tl.dot wants >= 16 rows on a GPU
    out = torch.empty_like(q)
    if b == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    parts = auto_splits(b, hkv, q.device) if num_splits is None else num_splits
    if parts < 1:
        raise ValueError(f"num_splits must be at least 1, got {parts}")
    if min_split_tokens is None:
        min_split_tokens = block_n if interpreting() else 4 * block_n
    min_tiles = max(1, triton.cdiv(min_split_tokens, block_n))
    split = parts > 1
    if split:
        part_acc = torch.empty(b, hq, parts, block_d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(b, hq, parts, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    upcast = interpreting() and k_cache.dtype == torch.bfloat16  # bf16 tl.dot is wrong there
    _decode_kernel[(b, hkv, parts)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_ml,
        scale * LOG2E, window or 0, group, d, min_tiles,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), parts,
        PAGE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, SPLIT=split,
        HAS_WINDOW=window is not None, UPCAST=upcast, PRECISION=_precision(k_cache, upcast),
        num_warps=4, num_stages=2,
    )
    if split:
        _reduce_kernel[(b, hq)](
            part_acc, part_ml, out, d, parts, out.stride(0), out.stride(1), hq,
            BLOCK_P=triton.next_power_of_2(parts), BLOCK_D=block_d, num_warps=4,
        )
    return out


# ----------------------------------------------------------------------------- prefill
@triton.jit
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, table_ptr, ctx_ptr, cu_ptr, out_ptr,
    scale_log2, window, group, head_dim,
    q_stride_t, q_stride_h, c_stride_blk, c_stride_slot, c_stride_h, table_stride,
    o_stride_t, o_stride_h,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    kv_head = head // group
    q_start = tl.load(cu_ptr + seq).to(tl.int32)
    q_len = tl.load(cu_ptr + seq + 1).to(tl.int32) - q_start
    ctx_len = tl.load(ctx_ptr + seq).to(tl.int32)
    first = ctx_len - q_len + tile * BLOCK_M  # position of this tile's first query
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    pos = ctx_len - q_len + rows
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * q_stride_t + head * q_stride_h + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(tl.float32) if UPCAST else q.to(kc_ptr.dtype.element_ty)
    # Keys this tile can see: causal, so none past its last query; a tile past the chunk's end
    # (the grid is sized for the longest chunk) gets an empty range and stores nothing.
    hi = tl.minimum(first + BLOCK_M, ctx_len)
    hi = tl.where(tile * BLOCK_M < q_len, hi, 0)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first - window + 1, 0)
    m = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = table_ptr + seq * table_stride
    for start in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        ok = offs < hi
        k = _gather_tile(kc_ptr, table_row, offs, ok, kv_head, PAGE, c_stride_blk,
                         c_stride_slot, c_stride_h, dims, dim_ok)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        visible = ok[None, :] & (offs[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (offs[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        v = _gather_tile(vc_ptr, table_row, offs, ok, kv_head, PAGE, c_stride_blk,
                         c_stride_slot, c_stride_h, dims, dim_ok)
        m, l_sum, acc = _online_softmax_step(s, v, m, l_sum, acc, UPCAST, PRECISION)
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * o_stride_t + head * o_stride_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_prefill_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float | None = None,
    window: int | None = None, *, max_query_len: int | None = None,
    block_m: int | None = None, block_n: int | None = None,
) -> torch.Tensor:
    """Query chunks of a flattened ragged batch (``q`` ``[T, Hq, D]``), each attending causally to
    itself and to its sequence's earlier K/V, all of it already in the paged cache."""
    _check_cache(k_cache, v_cache)
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not split into groups over {hkv} KV heads")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    b = len(context_lens)
    if t == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    block_m = block_m or _default_tile(k_cache)
    block_n = block_n or _default_tile(k_cache)
    block_d = max(16, triton.next_power_of_2(d))
    upcast = interpreting() and k_cache.dtype == torch.bfloat16  # bf16 tl.dot is wrong there
    _prefill_kernel[(triton.cdiv(max_query_len, block_m), b, hq)](
        q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, out,
        scale * LOG2E, window or 0, hq // hkv, d,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        PAGE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_WINDOW=window is not None, UPCAST=upcast, PRECISION=_precision(k_cache, upcast),
        num_warps=4, num_stages=2,
    )
    return out


def paged_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Same contract as ``paged_attention_ref``: decode kernel when every chunk is one token
    (``T == B``; each chunk has at least one), the prefill kernel otherwise."""
    if q.shape[0] == len(context_lens):
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens,
                                             scale, window)
    return paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, context_lens,
                                          cu_seqlens_q, scale, window)
