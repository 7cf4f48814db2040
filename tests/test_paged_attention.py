"""Paged attention of Chapter 3: the same numbers as dense causal attention, the same tokens as
naive generation, and every block back in the pool afterwards."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import infer_lab as il
from infer_lab.cache import (
    BlockManager,
    NoFreeBlocksError,
    PagedAttentionContext,
    PagedKVCache,
    build_paged_batch,
    paged_attention_ref,
)
from infer_lab.model.attention import causal_attention
from infer_lab.model.baselines import default_num_blocks, generate_paged
from tests.helpers import assert_greedy_equal, make_checkpoint

# ------------------------------------------------------------ the reference vs dense attention

# (context length after the step, query chunk length): a single token, odd lengths, exact and
# crossing block boundaries, chunks that start mid-sequence (cached prefix + new tokens).
CASES = [(1, 1), (7, 7), (16, 16), (17, 1), (33, 5), (9, 3), (40, 23), (21, 1)]


def scatter_into_pages(seqs, block_size, num_blocks, gen):
    """Lay each sequence's dense K/V into randomly placed blocks; returns the batch and cache."""
    hkv, d = seqs[0][1].shape[1:]
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)  # garbage elsewhere
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    chunks = []
    for q, k, v in seqs:
        ctx_len, q_len = k.shape[0], q.shape[0]
        table = [free.pop() for _ in range(-(-ctx_len // block_size))]
        for pos in range(ctx_len):
            blk, off = table[pos // block_size], pos % block_size
            k_cache[blk, off], v_cache[blk, off] = k[pos], v[pos]
        chunks.append(([0] * q_len, ctx_len - q_len, table))
    return build_paged_batch(chunks, block_size, num_blocks), k_cache, v_cache


def dense_attention(q, k, v, window):
    """softmax(q k^T / sqrt(d)) v over ``[S, H, D]``, the mask written out: p - window < j <= p."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    p, j = torch.arange(len(q))[:, None], torch.arange(len(k))[None, :]
    visible = (j <= p) & ((j > p - window) if window else True)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "mqa8"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_ref_equals_dense_causal(window, heads, block_size):
    hq, hkv = heads
    d = 16
    gen = torch.Generator().manual_seed(hq * 100 + hkv + block_size + (window or 0))
    seqs, full_qs = [], []
    for ctx_len, q_len in CASES:
        full_q = torch.randn(ctx_len, hq, d, generator=gen)
        k = torch.randn(ctx_len, hkv, d, generator=gen)
        v = torch.randn(ctx_len, hkv, d, generator=gen)
        seqs.append((full_q[ctx_len - q_len:], k, v))
        full_qs.append(full_q)
    batch, k_cache, v_cache = scatter_into_pages(seqs, block_size, 64, gen)
    q = torch.cat([s[0] for s in seqs])
    out = paged_attention_ref(q, k_cache, v_cache, batch.block_tables, batch.context_lens,
                              batch.cu_seqlens_q, window=window)
    assert out.shape == q.shape
    # Dense references: the whole sequence's causal attention (the model's no-cache path) and a
    # by-hand softmax, keeping the chunk's rows (the last ones).
    for b, (full_q, (qb, k, v)) in enumerate(zip(full_qs, seqs, strict=True)):
        rows = out[batch.cu_seqlens_q[b]:batch.cu_seqlens_q[b + 1]]
        dense = causal_attention(full_q[None], k[None], v[None], window)[0][-qb.shape[0]:]
        torch.testing.assert_close(rows, dense, atol=1e-5, rtol=1e-5)
        by_hand = dense_attention(full_q, k, v, window)[-qb.shape[0]:]
        torch.testing.assert_close(rows, by_hand, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "mqa8"])
def test_batched_torch_backend_equals_the_reference(window, heads):
    """The context's batched path (one gather, one SDPA per layer) against the per-sequence ref."""
    from infer_lab.model.config import ModelConfig

    hq, hkv = heads
    d, block_size, num_blocks = 16, 4, 64
    gen = torch.Generator().manual_seed(hq + 10 * hkv + (window or 0))
    seqs = [(torch.randn(q_len, hq, d, generator=gen), torch.randn(n, hkv, d, generator=gen),
             torch.randn(n, hkv, d, generator=gen)) for n, q_len in CASES]
    batch, k_cache, v_cache = scatter_into_pages(seqs, block_size, num_blocks, gen)
    cfg = ModelConfig.from_dict(dict(
        model_type="llama", vocab_size=8, hidden_size=hq * d, intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d,
    ))
    cache = PagedKVCache(cfg, num_blocks, block_size)
    cache.k_caches[0].copy_(k_cache)
    cache.v_caches[0].copy_(v_cache)
    q = torch.cat([s[0] for s in seqs])
    # the new tokens' K/V are re-written through the slot mapping: give the values already there
    slots = batch.slot_mapping
    k_new = k_cache.view(-1, hkv, d)[slots].clone()
    v_new = v_cache.view(-1, hkv, d)[slots].clone()
    out = PagedAttentionContext(cache, batch, backend="torch").attend(0, q, k_new, v_new, window)
    ref = paged_attention_ref(q, k_cache, v_cache, batch.block_tables, batch.context_lens,
                              batch.cu_seqlens_q, window=window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


class RecordSDPA(TorchDispatchMode):
    """The query shapes ``[B, Hq, q_len, D]`` of every SDPA call inside (one op in inference
    mode; outside it, the CPU kernel SDPA dispatches to)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func):
            self.q_shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


# (context length after the step, query rows): a long chunk starting mid-sequence, decodes at
# different context lengths, and two 4-row chunks, the groups' sequences interleaved
MIXED = [(37, 1), (430, 300), (5, 1), (60, 4), (200, 1), (9, 4), (64, 1)]


@pytest.mark.parametrize("window", [None, 7, 64])
@pytest.mark.parametrize("order", ["interleaved", "decodes_first"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_is_unpadded_and_equals_the_reference(window, order, kv_dtype):
    """A long chunk beside decodes (GQA, a window, bf16 keys read into fp32 queries): the torch
    path equals the per-sequence reference, and its SDPA calls see exactly the step's query
    rows (a padded path would see every sequence padded to the 300-row chunk)."""
    from infer_lab.model.config import ModelConfig

    hq, hkv, d, block_size, num_blocks = 8, 2, 16, 16, 64
    cases = MIXED if order == "interleaved" else sorted(MIXED, key=lambda c: c[1])
    gen = torch.Generator().manual_seed(len(order) + (window or 0))
    seqs = [(torch.randn(q_len, hq, d, generator=gen), torch.randn(n, hkv, d, generator=gen),
             torch.randn(n, hkv, d, generator=gen)) for n, q_len in cases]
    batch, k_cache, v_cache = scatter_into_pages(seqs, block_size, num_blocks, gen)
    assert batch.num_seqs * batch.max_query_len > 5 * batch.num_tokens  # padding would show
    cfg = ModelConfig.from_dict(dict(
        model_type="llama", vocab_size=8, hidden_size=hq * d, intermediate_size=8,
        num_hidden_layers=2, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d,
    ))
    cache = PagedKVCache(cfg, num_blocks, block_size, dtype=kv_dtype)
    cache.k_caches[1].copy_(k_cache)
    cache.v_caches[1].copy_(v_cache)
    q = torch.cat([s[0] for s in seqs])
    slots = batch.slot_mapping
    k_new = cache.k_caches[1].view(-1, hkv, d)[slots].float()  # what is there already
    v_new = cache.v_caches[1].view(-1, hkv, d)[slots].float()
    ctx = PagedAttentionContext(cache, batch, backend="torch")
    with RecordSDPA() as seen:
        out = ctx.attend(1, q, k_new, v_new, window)
    ref = paged_attention_ref(q, cache.k_caches[1], cache.v_caches[1], batch.block_tables,
                              batch.context_lens, batch.cu_seqlens_q, window=window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert sum(b * q_len for b, _, q_len, _ in seen.q_shapes) == batch.num_tokens
    assert sorted(q_len for _, _, q_len, _ in seen.q_shapes) == [1, 4, 300]  # a call a length
    # a second layer of the same step reuses the step's groups and gives the same answer
    cache.k_caches[0].copy_(cache.k_caches[1])
    cache.v_caches[0].copy_(cache.v_caches[1])
    torch.testing.assert_close(ctx.attend(0, q, k_new, v_new, window), out, atol=0, rtol=0)


def test_batch_layout():
    # Sequence 0: 3 cached + 2 new tokens; sequence 1: a 6-token prompt; block size 4.
    batch = build_paged_batch([([7, 8], 3, [5, 2]), ([1, 2, 3, 4, 5, 6], 0, [0, 3, 9])], 4, 10)
    assert batch.input_ids.tolist() == [7, 8, 1, 2, 3, 4, 5, 6]
    assert batch.positions.tolist() == [3, 4, 0, 1, 2, 3, 4, 5]
    assert batch.slot_mapping.tolist() == [5 * 4 + 3, 2 * 4 + 0, 0, 1, 2, 3, 3 * 4, 3 * 4 + 1]
    assert batch.block_tables.tolist() == [[5, 2], [0, 3]]  # unused entry 9 dropped
    assert batch.context_lens.tolist() == [5, 6]
    assert batch.cu_seqlens_q.tolist() == [0, 2, 8]
    assert batch.logits_indices.tolist() == [1, 7]
    padded = build_paged_batch([([7], 0, [1]), ([1] * 5, 0, [0, 3])], 4, 10)
    assert padded.block_tables.tolist() == [[1, -1], [0, 3]]


def test_block_table_past_the_pool_is_a_value_error():
    with pytest.raises(ValueError, match="outside the pool"):
        build_paged_batch([([1, 2, 3], 0, [4])], block_size=4, num_blocks=4)
    with pytest.raises(ValueError, match="need 2 blocks"):
        build_paged_batch([([1, 2, 3], 2, [1])], block_size=4, num_blocks=4)
    q = torch.randn(3, 2, 8)
    cache = torch.randn(4, 4, 2, 8)
    for bad in ([[4]], [[-1]]):
        with pytest.raises(ValueError, match="outside the pool"):
            paged_attention_ref(q, cache, cache, torch.tensor(bad), torch.tensor([3]),
                                torch.tensor([0, 3]))
    with pytest.raises(ValueError):  # more queries than context
        paged_attention_ref(q, cache, cache, torch.tensor([[1]]), torch.tensor([2]),
                            torch.tensor([0, 3]))


def test_context_writes_new_kv_through_the_slot_mapping():
    from infer_lab.model.config import ModelConfig

    cfg = ModelConfig.from_dict(dict(
        model_type="llama", vocab_size=8, hidden_size=16, intermediate_size=8,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    ))
    cache = PagedKVCache(cfg, num_blocks=6, block_size=4)
    batch = build_paged_batch([([1, 2, 3], 2, [4, 1]), ([5], 0, [3])], 4, 6)
    q, k, v = torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    PagedAttentionContext(cache, batch).attend(1, q, k, v, None)
    flat_k = cache.k_caches[1].view(-1, 1, 8)
    assert torch.equal(flat_k[[4 * 4 + 2, 4 * 4 + 3, 1 * 4 + 0, 3 * 4]], k)
    assert cache.k_caches[0].abs().sum() == 0  # layer 0 untouched
    cache.copy_blocks([(4, 0)])
    assert torch.equal(cache.kv[:, :, 0], cache.kv[:, :, 4])


@pytest.mark.parametrize(("kv_dtype", "cache_dtype", "new_dtype"), [
    ("auto", torch.float32, torch.float32), ("auto", torch.bfloat16, torch.bfloat16),
    ("auto", torch.bfloat16, torch.float32), ("fp8_e4m3", torch.float32, torch.float32),
    ("int8", torch.float32, torch.float32), ("fp8_e4m3_scaled", torch.float32, torch.float32)])
def test_the_torch_store_writes_what_the_reference_store_writes(kv_dtype, cache_dtype,
                                                                new_dtype):
    """The context's own store (``index_copy_`` when the cache is a plain tensor of the new
    K/V's dtype, the reference's path otherwise) leaves every cache exactly as
    ``store_kv_ref`` does, keys and values, and attention reads them back as the reference."""
    from infer_lab.cache.kv_quant import make_paged_kv_cache
    from infer_lab.kernels.reference import store_kv_ref
    from infer_lab.model.config import ModelConfig

    cfg = ModelConfig.from_dict(dict(
        model_type="llama", vocab_size=8, hidden_size=16, intermediate_size=8,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    ))
    mine, ref = (make_paged_kv_cache(cfg, 6, 4, dtype=cache_dtype, kv_cache_dtype=kv_dtype)
                 for _ in range(2))
    batch = build_paged_batch([([1, 2, 3], 2, [4, 1]), ([5], 0, [3])], 4, 6)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(4, h, 8, generator=g).to(new_dtype) for h in (2, 1, 1))
    out = PagedAttentionContext(mine, batch, backend="torch").attend(1, q, k, v, None)
    store_kv_ref(k, v, ref.k_caches[1], ref.v_caches[1], batch.slot_mapping)
    assert torch.equal(mine.kv, ref.kv)
    assert mine.kv[1].float().abs().sum() > 0 and mine.kv[0].float().abs().sum() == 0
    if kv_dtype in ("int8", "fp8_e4m3_scaled"):
        assert torch.equal(mine.scales, ref.scales)
    expect = paged_attention_ref(q, ref.k_caches[1], ref.v_caches[1], batch.block_tables,
                                 batch.context_lens, batch.cu_seqlens_q)
    tol = 1e-5 if new_dtype == torch.float32 else 2e-2  # one batched call vs a loop: bf16 ulps
    torch.testing.assert_close(out, expect, atol=tol, rtol=tol)


# --------------------------------------------------------------------------------- with a model

PROMPTS = [
    "In the beginning was the word",
    "Prefill",
    [5, 17, 200, 31, 9, 44, 120, 3, 88, 61, 250, 12, 77, 14, 15, 16, 19, 300],  # 18 tokens
    "The quick brown fox",
]


@pytest.fixture(scope="module", params=["llama3", "mistral_window", "qwen3"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(path, request.param)
    return il.load(path)


def logits_after(model, prompt_ids):
    return lambda prefix: model(torch.tensor([prompt_ids + prefix]), last_only=True)[0, -1]


@pytest.mark.parametrize("block_size", [4, 16])
def test_generate_paged_equals_naive_and_frees_every_block(model, block_size):
    m, tok = model
    mgr = BlockManager(num_blocks=40, block_size=block_size)
    # 20 new tokens: every sequence crosses block boundaries and goes past mistral's window of 8.
    outs = generate_paged(m, tok, PROMPTS, max_tokens=20, ignore_eos=True, block_manager=mgr)
    assert mgr.num_free_blocks == mgr.pool.num_blocks and not mgr.seq_ids()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = il.generate_naive(m, tok, prompt, max_tokens=20, ignore_eos=True)
        assert out.prompt_token_ids == ref.prompt_token_ids and len(out.token_ids) == 20
        assert_greedy_equal(out.token_ids, ref.token_ids, logits_after(m, ref.prompt_token_ids))


def test_default_pool_is_exactly_enough_and_one_block_less_is_signalled(model):
    m, tok = model
    lens = [len(o.prompt_token_ids) for o in generate_paged(m, tok, PROMPTS, max_tokens=1)]
    # All four run 20 steps; at the last each holds prompt + 19 tokens (the 20th is never fed).
    needed = default_num_blocks(lens, [20] * 4, 4)
    assert needed == sum(-(-(n + 19) // 4) for n in lens)
    generate_paged(m, tok, PROMPTS, max_tokens=20, block_size=4, ignore_eos=True)
    with pytest.raises(NoFreeBlocksError):
        generate_paged(m, tok, PROMPTS, max_tokens=20, block_size=4, num_blocks=needed - 1,
                       ignore_eos=True)


def prefill_logits(m, cache, mgr, seq, ids, start):
    """Run ``ids[start:]`` as one chunk of sequence ``seq`` whose first ``start`` are cached."""
    batch = build_paged_batch([(ids[start:], start, mgr.block_table(seq))], mgr.block_size,
                              mgr.pool.num_blocks)
    return m(batch.input_ids, batch.positions, PagedAttentionContext(cache, batch))[0]


def test_chunked_prefill_and_shared_prefix_match_the_plain_forward(model):
    m, _ = model
    ids = torch.randint(3, 384, (19,), generator=torch.Generator().manual_seed(0)).tolist()
    full = m(torch.tensor([ids]), last_only=True)[0, -1]
    mgr = BlockManager(num_blocks=12, block_size=4)
    cache = PagedKVCache(m.config, 12, 4)
    # Chunked prefill: 7 tokens, then 12 more starting mid-block, attending to the cached 7.
    mgr.allocate_slots("a", 7)
    prefill_logits(m, cache, mgr, "a", ids[:7], 0)
    mgr.allocate_slots("a", 12)
    torch.testing.assert_close(prefill_logits(m, cache, mgr, "a", ids, 7), full,
                               atol=1e-4, rtol=1e-4)
    # Prefix sharing: "b" has the same first 8 tokens, reuses a's two full blocks, computes 11.
    mgr.allocate_slots("b", 11, computed_blocks=mgr.block_table("a")[:2])
    torch.testing.assert_close(prefill_logits(m, cache, mgr, "b", ids, 8), full,
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("codec", [None, "int8", "fp8_e4m3_scaled"])
def test_the_block_gather_copies_whole_blocks_of_any_cache(codec):
    """``gather_blocks`` (``index_select`` on blocks) reads what ``cache[tables]`` reads, for a
    float cache and for the 8-bit ones (``Int8Blocks`` decodes what it gathers), row by row."""
    from infer_lab.cache.kv_quant import Int8Blocks
    from infer_lab.cache.paged import gather_blocks

    g = torch.Generator().manual_seed(0)
    blocks = torch.randn(9, 4, 2, 8, generator=g)
    if codec is None:
        cache = blocks
    else:
        store = Int8Blocks(torch.zeros(9, 4, 2, 8, dtype=torch.int8 if codec == "int8" else
                                       torch.float8_e4m3fn),
                           torch.zeros(9, 4, 2, dtype=torch.float16), torch.float32, codec)
        store.view(-1, 2, 8)[torch.arange(36)] = blocks.view(-1, 2, 8)
        cache = store
    tables = torch.tensor([[3, 0, 7], [8, 8, 1]])
    got = gather_blocks(cache, tables)
    assert got.shape == (2, 12, 2, 8)
    assert torch.equal(got, cache[tables].flatten(1, 2))
    if codec is not None:  # and the codes really were decoded, not zeros
        assert torch.allclose(got, blocks[tables].flatten(1, 2), atol=0.1, rtol=0.1)
