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
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from infer_lab.kernels.dispatch import interpreting

LOG2E = 1.4426950408889634
# Decode packs a KV head's query heads into one tile of max(16, group) rows; larger groups (rare:
# multi-query models with many heads) go through the prefill kernel, one program per query head.
MAX_DECODE_GROUP = 16
# The running max starts finite: exp2(NEG_BIG - NEG_BIG) is 1, not NaN. A constexpr, because a
# compiled kernel (Triton >= 3.0) refuses plain globals; the interpreter would not notice.
NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)


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


NO_WINDOW = 1 << 30  # a window longer than any context: every earlier key is visible


def _window(window: int | None) -> int:
    """The page size and the window are runtime arguments, not constexprs: one compiled kernel
    serves every page size and both window modes (a division and a compare per key position,
    against a [BLOCK_N, D] load), so there are 4x fewer kernels to compile and to keep in cache."""
    if window is None:
        return NO_WINDOW
    if not 0 < window < NO_WINDOW:
        raise ValueError(f"window must be a positive number of positions, got {window}")
    return window


def _index(t: torch.Tensor) -> torch.Tensor:
    """Index tensors (block tables, lengths, cu_seqlens, slots) as the kernels read them: the
    kernels step through rows with one stride and assume the rest is packed."""
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"index tensors must be int32 or int64, got {t.dtype}")
    return t if t.is_contiguous() else t.contiguous()


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
    slot_mapping = _index(slot_mapping)
    if t:
        _store_kv_kernel[(t,)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1),
            k_cache.stride(2), h, d,
            BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d), num_warps=4,
        )


# ----------------------------------------------------------------------------- shared pieces
@triton.jit
def _gather_tile(cache_ptr, table_row_ptr, offs, ok, kv_head, page, stride_blk,
                 stride_slot, stride_h, dims, dim_ok):
    """Load positions ``offs`` of one sequence, one KV head: ``[BLOCK_N, BLOCK_D]``."""
    blk = tl.load(table_row_ptr + offs // page, mask=ok, other=0).to(tl.int64)
    row = blk * stride_blk + (offs % page) * stride_slot + kv_head * stride_h
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
    q_ptr, kc_ptr, vc_ptr, table_ptr, ctx_ptr, cu_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    scale_log2, window, page, group, head_dim, min_tiles, use_cu,
    q_stride_t, q_stride_h, c_stride_blk, c_stride_slot, c_stride_h, table_stride,
    o_stride_t, o_stride_h, max_parts,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    ctx_len = tl.load(ctx_ptr + seq).to(tl.int32)
    # In a mixed step (use_cu = 1) sequence `seq`'s query is row cu[seq], and only sequences with
    # a one-token chunk are decode's to do; the prefill kernel takes the others.
    # Arithmetic, not masks: use_cu = 0 reads cu_ptr[0] twice (valid memory) and ignores it.
    first_q = tl.load(cu_ptr + seq * use_cu).to(tl.int64)
    next_q = tl.load(cu_ptr + (seq + 1) * use_cu).to(tl.int64)
    q_len = (next_q - first_q) * use_cu + (1 - use_cu)
    row_q = first_q * use_cu + seq * (1 - use_cu)
    live = tl.where(q_len == 1, group, 0)  # heads to compute: none for a longer chunk
    hs = tl.arange(0, BLOCK_H)
    heads = kv_head * group + hs  # the q heads of this KV head's group
    head_ok = hs < live
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + row_q * q_stride_t + heads[:, None] * q_stride_h + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    lo = tl.maximum(ctx_len - window, 0)  # the query at ctx_len-1 sees the last `window`
    tile_lo = lo // BLOCK_N
    tile_hi = tl.where(live > 0, tl.cdiv(ctx_len, BLOCK_N), 0)
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
        k = _gather_tile(kc_ptr, table_row, offs, ok, kv_head, page, c_stride_blk,
                         c_stride_slot, c_stride_h, dims, dim_ok)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(ok[None, :], s, float("-inf"))
        v = _gather_tile(vc_ptr, table_row, offs, ok, kv_head, page, c_stride_blk,
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
        tl.store(out_ptr + row_q * o_stride_t + heads[:, None] * o_stride_h + dims[None, :],
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
    # A row with no visible key at all (every partition empty: a caller's context of 0) gives
    # 0, as the unsplit kernel does, not 0 / 0 = NaN.
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * o_stride_t + head * o_stride_h + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


class Tiles(NamedTuple):
    """Launch shape of an attention kernel: query rows and key positions per tile, warps, stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def choose_tiles(kind: str, element_size: int, head_dim: int,
                 capability: tuple[int, int] | None) -> Tiles:
    """The tiles the dispatch launches ``kind`` ("decode" or "prefill") with, from the cache's
    element size, the head size and the GPU's compute capability (None: the interpreter).

    Pure Python on purpose: ``scripts/gpu_compile.py`` compiles exactly these shapes for each GPU
    generation on a machine without one, and fails on shared memory or register spills.

    Chosen from what ptxas reports at head_dim 128 (registers / spill bytes / shared memory):

    - 16-bit on sm_80+: 64x64 tiles; decode 4 warps (168-170 regs, 0 spill, 22 KB), prefill 8
      warps (161-231 regs, 0 spill, 32-40 KB): with 4 warps Triton 3.6 spilled 68 B on A100 at
      255 registers where Triton 3.9 did not.
    - 16-bit on sm_75 (T4): Triton's ``tl.dot`` has no tensor cores there, and 64x64 tiles sat at
      exactly the T4's 64 KB of shared memory with ~47 KB of spills; 32x32 with 8 warps: 0 spill,
      32 KB. Decode likewise 32 positions per tile, 8 warps (200 regs, 0 spill).
    - fp32 everywhere: 32x32 with 8 warps; with 4 warps fp32 prefill spilled 0.5-2 KB on A100
      and H100 and fp32 decode 0.75 KB on H100.
    """
    if capability is None:
        return Tiles(16, 16, 4, 2)  # interpreter: small tiles, more tiles, more code paths run
    if element_size > 2 or capability < (8, 0):
        return Tiles(32, 32, 8, 2)
    return Tiles(64, 64, 4 if kind == "decode" else 8, 2)


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _tiles(kind: str, cache: torch.Tensor, head_dim: int) -> Tiles:
    if interpreting():
        return choose_tiles(kind, cache.element_size(), head_dim, None)
    index = cache.device.index if cache.device.index is not None else torch.cuda.current_device()
    return choose_tiles(kind, cache.element_size(), head_dim, _capability(index))


def precision_for(dtype_name: str) -> str:
    """``tl.dot`` input precision: fp32 operands get true fp32 products ("ieee"), since by default
    a GPU rounds them to tf32; for 16-bit operands the setting does not matter."""
    return "ieee" if dtype_name == "fp32" else "tf32"


def _precision(cache: torch.Tensor, upcast: bool) -> str:
    return precision_for("fp32" if upcast or cache.dtype == torch.float32 else "16-bit")


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


MAX_SPLITS = 64  # partitions per context at most (the reduction's tile, the compiled shapes)


def auto_splits(num_seqs: int, kv_heads: int, device: torch.device | None = None, *,
                num_sms: int | None = None) -> int:
    """How many partitions per context: enough for ~4 programs per SM when the grid of
    (sequence, KV head) alone would leave SMs idle, else 1; at most ``MAX_SPLITS``. Decided
    from shapes only. ``num_sms`` answers for a GPU that is not here (Chapter 4's table);
    without it, the interpreter never splits and a GPU reports its own count."""
    if num_sms is None:
        if interpreting() or device is None:
            return 1
        index = device.index if device.index is not None else torch.cuda.current_device()
        num_sms = _num_sms(index)
    if num_seqs < 1 or kv_heads < 1 or num_sms < 1:
        raise ValueError(f"num_seqs, kv_heads and num_sms must be positive, got "
                         f"{num_seqs}, {kv_heads}, {num_sms}")
    programs = num_seqs * kv_heads
    return 1 if programs >= 2 * num_sms else min(MAX_SPLITS, triton.cdiv(4 * num_sms, programs))


def _decode_group(hq: int, hkv: int) -> int:
    """Query heads per KV head, which the decode kernel packs into one tile of rows."""
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not split into groups over {hkv} KV heads")
    group = hq // hkv
    if group > MAX_DECODE_GROUP:
        raise ValueError(f"decode packs at most {MAX_DECODE_GROUP} query heads per KV head, got "
                         f"{group}: use paged_prefill_attention_triton")
    return group


def _partitions(num_splits: int | None, min_split_tokens: int | None, num_seqs: int,
                kv_heads: int, device: torch.device, block_n: int) -> tuple[int, int]:
    """(partitions per context, the fewest KV tiles one partition takes)."""
    parts = auto_splits(num_seqs, kv_heads, device) if num_splits is None else num_splits
    if parts < 1:
        raise ValueError(f"num_splits must be at least 1, got {parts}")
    if min_split_tokens is None:
        min_split_tokens = block_n if interpreting() else 4 * block_n
    return parts, max(1, triton.cdiv(min_split_tokens, block_n))


def _partition_buffers(num_seqs: int, hq: int, parts: int, block_d: int, device: torch.device,
                       out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each partition's accumulator and (max, sum) for the reduction; unused (``out`` stands
    in) when the context is not split."""
    if parts == 1:
        return out, out
    return (torch.empty(num_seqs, hq, parts, block_d, dtype=torch.float32, device=device),
            torch.empty(num_seqs, hq, parts, 2, dtype=torch.float32, device=device))


def paged_decode_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float | None = None, window: int | None = None, *,
    num_splits: int | None = None, min_split_tokens: int | None = None,
    block_n: int | None = None, cu_seqlens_q: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence (``q`` ``[B, Hq, D]``) over its paged context.

    With ``cu_seqlens_q`` (a mixed chunked-prefill step, ``q`` ``[T, Hq, D]``), only the
    sequences whose chunk is one token are computed, into those rows of ``out``; the prefill
    kernel does the rest. Partitioning is then off (the prefill work fills the GPU).

    ``num_splits`` > 1 cuts each context into that many partitions, of at least
    ``min_split_tokens`` positions each, that run in parallel (flash-decoding) and are then
    reduced; 1 never splits; None decides from the grid size. The partitions are computed inside
    the kernel from each sequence's length, so nothing here reads ``context_lens`` on the host:
    no synchronisation, and the launch can be captured in a CUDA graph and replayed at any length.
    """
    _check_cache(k_cache, v_cache)
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = _decode_group(hq, hkv)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    tiles = _tiles("decode", k_cache, d)
    block_n = block_n or tiles.block_n
    block_d = max(16, triton.next_power_of_2(d))
    block_h = 16  # tl.dot wants >= 16 rows on a GPU; groups up to 16 fit (one compiled shape)
    out = torch.empty_like(q) if out is None else out
    block_tables, context_lens = _index(block_tables), _index(context_lens)
    mixed = cu_seqlens_q is not None
    if mixed:
        cu_seqlens_q = _index(cu_seqlens_q)
        b = len(context_lens)
        num_splits = 1
    if b == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    parts, min_tiles = _partitions(num_splits, min_split_tokens, b, hkv, q.device, block_n)
    split = parts > 1
    part_acc, part_ml = _partition_buffers(b, hq, parts, block_d, q.device, out)
    upcast = interpreting() and k_cache.dtype == torch.bfloat16  # bf16 tl.dot is wrong there
    _decode_kernel[(b, hkv, parts)](
        q, k_cache, v_cache, block_tables, context_lens,
        cu_seqlens_q if mixed else context_lens, out, part_acc, part_ml,
        scale * LOG2E, _window(window), k_cache.shape[1], group, d, min_tiles, int(mixed),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), parts,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, SPLIT=split,
        UPCAST=upcast, PRECISION=_precision(k_cache, upcast),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
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
    q_ptr, kc_ptr, vc_ptr, table_ptr, ctx_ptr, cu_ptr, out_ptr, tree_ptr,
    scale_log2, window, page, group, head_dim, min_q_len, tree_w,
    q_stride_t, q_stride_h, c_stride_blk, c_stride_slot, c_stride_h, table_stride,
    o_stride_t, o_stride_h, tree_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, TREE: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    kv_head = head // group
    q_start = tl.load(cu_ptr + seq).to(tl.int32)
    q_len = tl.load(cu_ptr + seq + 1).to(tl.int32) - q_start
    ctx_len = tl.load(ctx_ptr + seq).to(tl.int32)
    q_len = tl.where(q_len >= min_q_len, q_len, 0)  # shorter chunks: the decode kernel's
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
    lo = tl.maximum(first - window + 1, 0)
    m = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = table_ptr + seq * table_stride
    for start in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        ok = offs < hi
        k = _gather_tile(kc_ptr, table_row, offs, ok, kv_head, page, c_stride_blk,
                         c_stride_slot, c_stride_h, dims, dim_ok)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        causal = offs[None, :] <= pos[:, None]
        if TREE:  # the sequence's last tree_w keys: the tree mask's row instead of causality
            col = offs[None, :] - (ctx_len - tree_w)
            in_tree = (col >= 0) & ok[None, :]
            seen = tl.load(tree_ptr + q_rows[:, None] * tree_stride + col,
                           mask=row_ok[:, None] & in_tree, other=0)
            causal = tl.where(in_tree, seen != 0, causal)
        visible = ok[None, :] & causal & (offs[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        v = _gather_tile(vc_ptr, table_row, offs, ok, kv_head, page, c_stride_blk,
                         c_stride_slot, c_stride_h, dims, dim_ok)
        m, l_sum, acc = _online_softmax_step(s, v, m, l_sum, acc, UPCAST, PRECISION)
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * o_stride_t + head * o_stride_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_prefill_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float | None = None,
    window: int | None = None, *, max_query_len: int | None = None,
    block_m: int | None = None, block_n: int | None = None, min_query_len: int = 1,
    out: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Query chunks of a flattened ragged batch (``q`` ``[T, Hq, D]``), each attending causally to
    itself and to its sequence's earlier K/V, all of it already in the paged cache.

    ``max_query_len``: the longest chunk, known on the host when the batch is built; without it
    it is read from ``cu_seqlens_q``, a device-to-host sync. Chunks shorter than
    ``min_query_len`` are skipped (their rows of ``out`` untouched): the decode kernel does them.
    ``tree_mask`` (bool ``[T, W]``, :class:`~infer_lab.cache.PagedBatch`): each sequence's last
    W keys are visible where its row says, not by causality (tree speculation, Chapter 9).
    """
    _check_cache(k_cache, v_cache)
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not split into groups over {hkv} KV heads")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q) if out is None else out
    b = len(context_lens)
    if t == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_tables, context_lens = _index(block_tables), _index(context_lens)
    cu_seqlens_q = _index(cu_seqlens_q)
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    tiles = _tiles("prefill", k_cache, d)
    block_m = block_m or tiles.block_m
    block_n = block_n or tiles.block_n
    block_d = max(16, triton.next_power_of_2(d))
    upcast = interpreting() and k_cache.dtype == torch.bfloat16  # bf16 tl.dot is wrong there
    tree = _tree(tree_mask, t)
    _prefill_kernel[(triton.cdiv(max_query_len, block_m), b, hq)](
        q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, out,
        tree if tree is not None else cu_seqlens_q.view(torch.uint8),
        scale * LOG2E, _window(window), k_cache.shape[1], hq // hkv, d, min_query_len,
        0 if tree is None else tree.shape[1],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        0 if tree is None else tree.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        UPCAST=upcast, PRECISION=_precision(k_cache, upcast), TREE=tree is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


def _tree(tree_mask: torch.Tensor | None, num_rows: int) -> torch.Tensor | None:
    """The tree mask as the prefill kernel reads it: one byte per entry, rows packed."""
    if tree_mask is None:
        return None
    if tree_mask.dtype != torch.bool or tree_mask.dim() != 2 or tree_mask.shape[0] != num_rows:
        raise ValueError(f"tree_mask must be bool [{num_rows}, W], got {tree_mask.dtype} "
                         f"{list(tree_mask.shape)}")
    return tree_mask.contiguous().view(torch.uint8)


def paged_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float | None = None,
    window: int | None = None, *, max_query_len: int | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``paged_attention_ref``. Every chunk one token (``T == B``; each chunk
    has at least one): the decode kernel. Otherwise, a mixed chunked-prefill step: the decode
    kernel takes the one-token chunks (K/V read once per KV-head group, not once per query
    head) and the prefill kernel the longer ones, both writing into one output.
    ``max_query_len`` (a host int from the batch) spares the prefill kernel a sync.

    Groups of more than ``MAX_DECODE_GROUP`` query heads per KV head go through the prefill
    kernel alone, which has no such limit; so does a batch with a ``tree_mask`` (a one-token
    chunk of a draft tree may see some of its sequence's last keys and not others).
    """
    if tree_mask is not None:
        return paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, context_lens,
                                              cu_seqlens_q, scale, window,
                                              max_query_len=max_query_len, tree_mask=tree_mask)
    hkv = k_cache.shape[2]
    group_ok = q.shape[1] % hkv == 0 and q.shape[1] // hkv <= MAX_DECODE_GROUP
    if q.shape[0] == len(context_lens) and group_ok:
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens,
                                             scale, window)
    if not group_ok:
        return paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, context_lens,
                                              cu_seqlens_q, scale, window,
                                              max_query_len=max_query_len)
    out = paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale,
                                        window, cu_seqlens_q=cu_seqlens_q)
    return paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, context_lens,
                                          cu_seqlens_q, scale, window, out=out,
                                          max_query_len=max_query_len, min_query_len=2)
