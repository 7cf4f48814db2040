"""Triton paged attention (decode, split-K decode, chunked prefill) and the K/V store, run through
Triton's interpreter on CPU against ``paged_attention_ref`` evaluated in fp64.

Inputs are fresh random numbers every run (the seed is in every failure message); the shapes are
the awkward ones: single tokens, lengths that are not multiples of the page or tile size, chunks
that start mid-sequence, pages of 3 and 16 tokens, GQA ratios 1, 4 and 8.
"""

from __future__ import annotations

import random

import pytest
import torch

from infer_lab import kernels
from infer_lab.cache import build_paged_batch, paged_attention_ref

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed")

TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # relative to max |ref|
RATIOS = {"mha": (4, 4), "gqa4": (8, 2), "gqa8": (8, 1)}
HEAD_DIM = 16


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def triton_attn():
    return kernels.triton_module("triton_attention")


def paged_problem(chunks, hq, hkv, block_size, dtype, seed, num_blocks=48):
    """Random q and a random cache holding each sequence's context in randomly placed pages.

    ``chunks`` are ``(context_len, q_len)``: the query chunk is the last q_len positions.
    """
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, hkv, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, HEAD_DIM, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    spec = []
    for ctx_len, q_len in chunks:
        table = [free.pop() for _ in range(-(-ctx_len // block_size))]
        spec.append(([0] * q_len, ctx_len - q_len, table))
    batch = build_paged_batch(spec, block_size, num_blocks)
    q = torch.randn(batch.num_tokens, hq, HEAD_DIM, generator=gen).to(dtype)
    return q, k_cache, v_cache, batch


def reference64(q, k_cache, v_cache, batch, window=None):
    return paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), batch.block_tables,
                               batch.context_lens, batch.cu_seqlens_q, window=window)


def assert_close(out, ref, dtype, seed, what):
    assert out.dtype == dtype and out.shape == ref.shape
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e} > {TOL[dtype]:.0e} (seed {seed})"


DECODE_LENS = [1, 5, 16, 17, 40, 33]  # one token per sequence: (len, 1)


@pytest.mark.parametrize("splits", [1, 3], ids=["one-pass", "split-k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads", RATIOS.values(), ids=RATIOS.keys())
def test_decode_attention(heads, dtype, splits):
    seed = fresh_seed()
    q, kc, vc, batch = paged_problem([(n, 1) for n in DECODE_LENS], *heads, 16, dtype, seed)
    out = triton_attn().paged_decode_attention_triton(
        q, kc, vc, batch.block_tables, batch.context_lens, num_splits=splits)
    assert_close(out, reference64(q, kc, vc, batch), dtype, seed, "decode")


@pytest.mark.parametrize("window", [None, 6])
def test_decode_split_k_odd_pages_and_window(window):
    """Pages of 3 tokens, so tiles straddle pages; 4 partitions of >= 32 positions, more partitions
    than a short context can fill (empty ones must weigh nothing in the reduction)."""
    seed = fresh_seed()
    q, kc, vc, batch = paged_problem([(n, 1) for n in [2, 31, 64, 70]], 8, 2, 3, torch.float32,
                                     seed, num_blocks=96)
    out = triton_attn().paged_decode_attention_triton(
        q, kc, vc, batch.block_tables, batch.context_lens, window=window, num_splits=4,
        min_split_tokens=32)
    assert_close(out, reference64(q, kc, vc, batch, window), torch.float32, seed, "split-k")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_row_without_keys_gives_zero_not_nan(num_splits):
    """A row whose context is empty gives 0 whether or not the context is split: the split
    path's reduction then divides a sum of 0 by a total of 0. The engine never sends such a row
    (CUDA-graph padding rows have a context of 1), a caller of the kernel may."""
    seed = fresh_seed()
    q, kc, vc, batch = paged_problem([(40, 1), (1, 1)], 4, 2, 16, torch.float32, seed)
    lens = batch.context_lens.clone()
    lens[1] = 0
    out = triton_attn().paged_decode_attention_triton(
        q, kc, vc, batch.block_tables, lens, num_splits=num_splits, min_split_tokens=16,
        block_n=16)
    assert torch.equal(out[1], torch.zeros_like(out[1])), (seed, out[1])
    assert_close(out[:1], reference64(q, kc, vc, batch)[:1], torch.float32, seed,
                 "rows with keys")


# (context length after the step, query chunk length): a whole prompt, one token, chunks starting
# mid-sequence (a cached prefix), a chunk longer than a tile, lengths off the page size.
PREFILL_CHUNKS = [(7, 7), (1, 1), (33, 5), (40, 23), (21, 1), (16, 16), (50, 17)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads", RATIOS.values(), ids=RATIOS.keys())
def test_prefill_attention(heads, dtype):
    seed = fresh_seed()
    q, kc, vc, batch = paged_problem(PREFILL_CHUNKS, *heads, 16, dtype, seed)
    out = triton_attn().paged_prefill_attention_triton(
        q, kc, vc, batch.block_tables, batch.context_lens, batch.cu_seqlens_q)
    assert_close(out, reference64(q, kc, vc, batch), dtype, seed, "prefill")


def test_prefill_sliding_window_odd_pages():
    seed = fresh_seed()
    q, kc, vc, batch = paged_problem(PREFILL_CHUNKS, 8, 2, 3, torch.float32, seed, 96)
    out = triton_attn().paged_prefill_attention_triton(
        q, kc, vc, batch.block_tables, batch.context_lens, batch.cu_seqlens_q, window=5)
    assert_close(out, reference64(q, kc, vc, batch, 5), torch.float32, seed, "window")


def test_bf16_upcasts_in_the_interpreter():
    """bf16 ``tl.dot`` is wrong in the interpreter (measured); the kernels upcast there."""
    seed = fresh_seed()
    dtype = torch.bfloat16
    q, kc, vc, batch = paged_problem(PREFILL_CHUNKS[:4], 8, 2, 16, dtype, seed)
    out = kernels.paged_attention_triton(q, kc, vc, batch.block_tables, batch.context_lens,
                                         batch.cu_seqlens_q)
    assert_close(out, reference64(q, kc, vc, batch), dtype, seed, "bf16 prefill")
    q, kc, vc, batch = paged_problem([(n, 1) for n in DECODE_LENS], 8, 2, 16, dtype, seed)
    out = kernels.paged_attention_triton(q, kc, vc, batch.block_tables, batch.context_lens,
                                         batch.cu_seqlens_q)
    assert_close(out, reference64(q, kc, vc, batch), dtype, seed, "bf16 decode")


def test_dispatch_picks_decode_or_prefill():
    """``paged_attention_triton`` takes any flattened batch: all-decode, or mixed."""
    seed = fresh_seed()
    mixed = [(9, 1), (30, 12), (17, 1)]
    q, kc, vc, batch = paged_problem(mixed, 8, 2, 16, torch.float32, seed)
    out = kernels.paged_attention_triton(q, kc, vc, batch.block_tables, batch.context_lens,
                                         batch.cu_seqlens_q)
    assert_close(out, reference64(q, kc, vc, batch), torch.float32, seed, "mixed batch")


def test_mixed_step_sends_one_token_chunks_to_the_decode_kernel():
    """A chunked-prefill step: decode computes exactly the one-token chunks' rows (K/V read once
    per KV-head group), prefill exactly the others; together they are the reference."""
    seed = fresh_seed()
    mixed = [(9, 1), (30, 12), (17, 1), (5, 5)]
    q, kc, vc, batch = paged_problem(mixed, 8, 2, 16, torch.float32, seed)
    ref = reference64(q, kc, vc, batch)
    one = torch.tensor([0, 13], dtype=torch.long)  # the rows of the (9, 1) and (17, 1) chunks
    rest = torch.tensor([i for i in range(len(q)) if i not in one.tolist()])
    mod = triton_attn()
    sentinel = torch.full_like(q, 7.0)
    out = mod.paged_decode_attention_triton(q, kc, vc, batch.block_tables, batch.context_lens,
                                            cu_seqlens_q=batch.cu_seqlens_q, out=sentinel.clone())
    assert_close(out[one], ref[one], torch.float32, seed, "decode rows of a mixed step")
    assert (out[rest] == 7.0).all(), "the decode kernel wrote rows of a longer chunk"
    out = mod.paged_prefill_attention_triton(q, kc, vc, batch.block_tables, batch.context_lens,
                                             batch.cu_seqlens_q, min_query_len=2,
                                             out=sentinel.clone(), max_query_len=12)
    assert_close(out[rest], ref[rest], torch.float32, seed, "prefill rows of a mixed step")
    assert (out[one] == 7.0).all(), "the prefill kernel wrote a one-token chunk's rows"
    both = kernels.paged_attention_triton(q, kc, vc, batch.block_tables, batch.context_lens,
                                          batch.cu_seqlens_q, max_query_len=12)
    assert_close(both, ref, torch.float32, seed, "mixed step")


def test_index_tensors_need_not_be_contiguous():
    """Block tables sliced out of a wider array (a persistent table, a column view) work."""
    seed = fresh_seed()
    q, kc, vc, batch = paged_problem([(20, 1), (33, 1), (7, 1)], 8, 2, 16, torch.float32, seed)
    wide = torch.zeros(batch.block_tables.shape[0], 2 * batch.block_tables.shape[1],
                       dtype=batch.block_tables.dtype)
    wide[:, ::2] = batch.block_tables
    tables = wide[:, ::2]  # same values, stride 2 along a row
    lens = torch.stack([batch.context_lens, batch.context_lens], 1)[:, 0]  # stride 2
    assert not tables.is_contiguous() and not lens.is_contiguous()
    out = kernels.paged_attention_triton(q, kc, vc, tables, lens, batch.cu_seqlens_q)
    assert_close(out, reference64(q, kc, vc, batch), torch.float32, seed, "strided index tensors")
    with pytest.raises(TypeError, match="int32 or int64"):
        kernels.paged_attention_triton(q, kc, vc, tables.float(), lens, batch.cu_seqlens_q)


def test_large_query_groups_go_through_the_prefill_kernel():
    """More than MAX_DECODE_GROUP query heads per KV head (multi-query models): still right."""
    seed = fresh_seed()
    hq = 2 * triton_attn().MAX_DECODE_GROUP
    q, kc, vc, batch = paged_problem([(12, 1), (5, 1)], hq, 1, 16, torch.float32, seed)
    out = kernels.paged_attention_triton(q, kc, vc, batch.block_tables, batch.context_lens,
                                         batch.cu_seqlens_q)
    assert_close(out, reference64(q, kc, vc, batch), torch.float32, seed, "group of 32")
    with pytest.raises(ValueError, match="at most"):
        triton_attn().paged_decode_attention_triton(q, kc, vc, batch.block_tables,
                                                    batch.context_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_store_kv_through_slot_mapping(dtype):
    """k/v as strided views of a fused qkv projection; slot -1 (padding) writes nothing."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    t, hkv, d, blocks, bs = 11, 2, HEAD_DIM, 8, 4
    qkv = torch.randn(t, (4 + 2 * hkv) * d, generator=gen).to(dtype)
    _, k, v = qkv.split([4 * d, hkv * d, hkv * d], -1)
    k, v = k.unflatten(-1, (hkv, d)), v.unflatten(-1, (hkv, d))
    slots = torch.randperm(blocks * bs, generator=gen)[:t]
    slots[3] = -1
    caches = [torch.randn(blocks, bs, hkv, d, generator=gen).to(dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    keep = slots >= 0
    kernels.reference.store_kv_ref(k[keep], v[keep], *expected, slots[keep])
    kernels.store_kv(k, v, *caches, slots, backend="triton")
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1]), seed


def test_context_backend_keyword_and_default():
    """``PagedAttentionContext(cache, batch)`` still works; ``backend=`` forces a kernel set."""
    from infer_lab.cache import PagedAttentionContext, PagedKVCache
    from infer_lab.model.config import ModelConfig

    cfg = ModelConfig.from_dict(dict(
        model_type="llama", vocab_size=32, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64))
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    batch = build_paged_batch([([0] * 5, 0, [2]), ([0] * 3, 0, [0])], 16, 4)
    outs = []
    for backend in (None, "torch", "triton"):
        cache = PagedKVCache(cfg, 4, 16)
        ctx = PagedAttentionContext(cache, batch) if backend is None else \
            PagedAttentionContext(cache, batch, backend=backend)
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(8, h, 8, generator=g) for h in (4, 2, 2))
        outs.append((ctx.attend(0, q, k, v, None), cache.kv.clone()))
    del gen
    for out, kv in outs[1:]:
        torch.testing.assert_close(out, outs[0][0], rtol=1e-5, atol=1e-5)
        assert torch.equal(kv, outs[0][1])


def test_auto_splits_for_a_named_sm_count_fills_the_gpu_within_the_cap() -> None:
    from infer_lab.kernels.triton_attention import MAX_SPLITS, auto_splits

    assert auto_splits(64, 8, num_sms=132) == 1  # 512 programs: the grid is full already
    assert auto_splits(16, 8, num_sms=132) == 5  # 128 programs -> ceil(528 / 128)
    assert auto_splits(4, 8, num_sms=132) == 17  # 32 programs -> ceil(528 / 32)
    assert auto_splits(1, 8, num_sms=132) == MAX_SPLITS == 64  # 66 wanted, capped
    with pytest.raises(ValueError, match="positive"):
        auto_splits(0, 8, num_sms=132)
