"""Tree attention (Chapter 9, EAGLE): the tree mask in the flattened batch, taken by the paged
attention backends — the torch reference, the batched torch path of the engine's context and
the Triton prefill kernel (in the interpreter on a CPU) — each checked against attention
written out row by row on fresh random inputs, in a batch that mixes a prompt chunk, a decode,
a target's draft tree and a draft's one-row tree chunk."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infer_lab import kernels
from infer_lab.cache import PagedAttentionContext, PagedKVCache, build_paged_batch
from infer_lab.cache.paged import paged_attention_ref
from infer_lab.engine.draft_tree import (
    DraftTree,
    chain_paths,
    parse_token_tree,
    tree_mask,
    tree_parents,
)
from infer_lab.model.config import ModelConfig

TREE = DraftTree((5, 6, 7, 8, 9, 10), (-1, -1, 0, 0, 1, 2))  # two first tokens, then more


def test_ancestor_mask_depths_and_paths():
    m = TREE.ancestor_mask()
    assert m.shape == (7, 7)
    assert m[:, 0].all()  # every node sees the root
    assert m[3].tolist() == [True, True, False, True, False, False, False]  # node 2 <- node 0
    assert m[6].tolist() == [True, True, False, True, False, False, True]  # node 5 <- 2 <- 0
    assert not m[2, 1] and not m[1, 2]  # siblings do not see each other
    assert TREE.depths() == [1, 1, 2, 2, 2, 3]
    assert TREE.path_to(5) == [0, 2, 5]
    assert DraftTree.chain([1, 2, 3]).is_chain and not TREE.is_chain
    chain_mask = DraftTree.chain([1, 2, 3]).ancestor_mask()
    assert (chain_mask == np.tri(4, dtype=bool)).all()  # a chain's mask is causal


def test_accepted_path_follows_the_targets_tokens_through_the_tree():
    # root: the target picks 6 (node 1, the second candidate); at node 1 it picks 9 (node 4)
    target = [6, 0, 9, 0, 0, 42, 0]
    assert TREE.accepted_nodes(target) == [1, 4]
    assert TREE.accepted_path(target) == [6, 9, 42]
    assert TREE.compaction([1, 4], 10) == ([11, 14], [10, 11])
    assert TREE.compaction([0, 2], 10) == ([12], [11])  # node 0 is already in place
    assert TREE.accepted_path([1, 0, 0, 0, 0, 0, 0]) == [1]  # no candidate matched


def test_token_tree_parsing():
    paths = parse_token_tree("[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]")
    assert tree_parents(paths) == (-1, -1, 0, 0, 1, 2)
    assert tree_parents(chain_paths(3)) == (-1, 0, 1)
    for bad in ("[(0, 0)]", "[(0,), (0,)]", "[(-1,)]", "[]", "[[0], 'x']", "((0,)"):
        with pytest.raises(ValueError, match="speculative_token_tree"):
            parse_token_tree(bad)


# ----------------------------------------------------------------------------- the kernels
HQ, HKV, D, BLOCK, NUM_BLOCKS = 4, 2, 16, 4, 40


def random_step(gen: torch.Generator):
    """A cache with random K/V and a mixed batch: (context length, query rows, region)."""
    draft_region = np.array([[True, False, True, False, True]])  # a draft's one-row tree chunk
    chunks = [(10, 6, None),  # a prompt chunk starting mid-sequence
              (7, 1, None),  # a decode
              (9 + 1 + len(TREE.tokens), 1 + len(TREE.tokens), TREE.ancestor_mask()),
              (12, 1, draft_region)]
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // BLOCK))] for n, _, _ in chunks]
    batch = build_paged_batch([([0] * q, n - q, t) for (n, q, _), t in zip(chunks, tables)],
                              BLOCK, NUM_BLOCKS)
    regions = {b: r for b, (_, _, r) in enumerate(chunks) if r is not None}
    batch.tree_mask = tree_mask(batch.cu_seqlens_q.numpy(), regions)
    return batch, chunks, tables


def visible_keys(ctx_len: int, q_len: int, region) -> np.ndarray:
    """``[q_len, ctx_len]``: causal by index, except over the region's last keys."""
    qi = np.arange(ctx_len - q_len, ctx_len)[:, None]
    vis = np.arange(ctx_len)[None, :] <= qi
    if region is not None:
        vis[:, ctx_len - region.shape[1] :] = region
    return vis


def written_out(q, k_cache, v_cache, chunks, tables) -> torch.Tensor:
    """Each query row's softmax over the keys it may see, gathered page by page."""
    out, row = torch.empty_like(q), 0
    for (n, qn, region), table in zip(chunks, tables):
        keys = torch.stack([k_cache[table[p // BLOCK], p % BLOCK] for p in range(n)])
        vals = torch.stack([v_cache[table[p // BLOCK], p % BLOCK] for p in range(n)])
        vis = torch.from_numpy(visible_keys(n, qn, region))
        for i in range(qn):
            for h in range(HQ):
                s = keys[:, h // (HQ // HKV)] @ q[row + i, h] / D**0.5
                w = s.masked_fill(~vis[i], float("-inf")).softmax(0)
                out[row + i, h] = w @ vals[:, h // (HQ // HKV)]
        row += qn
    return out


@pytest.fixture
def step():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))  # fresh each run
    batch, chunks, tables = random_step(gen)
    cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=8, hidden_size=HQ * D,
                                     intermediate_size=8, num_hidden_layers=1,
                                     num_attention_heads=HQ, num_key_value_heads=HKV))
    cache = PagedKVCache(cfg, NUM_BLOCKS, BLOCK)
    cache.kv.normal_(generator=gen)
    t = batch.num_tokens
    q, k, v = (torch.randn(t, h, D, generator=gen) for h in (HQ, HKV, HKV))
    return batch, chunks, tables, cache, q, k, v


def test_reference_and_torch_backend_equal_attention_written_out(step):
    batch, chunks, tables, cache, q, k, v = step
    ctx = PagedAttentionContext(cache, batch, backend="torch")
    got = ctx.attend(0, q, k, v, None)  # stores this step's K/V, then attends
    kc, vc = cache.k_caches[0], cache.v_caches[0]
    want = written_out(q, kc, vc, chunks, tables)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    ref = paged_attention_ref(q, kc, vc, batch.block_tables, batch.context_lens,
                              batch.cu_seqlens_q, tree_mask=batch.tree_mask)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)
    # the mask matters: without it the tree's rows see their siblings
    plain = paged_attention_ref(q, kc, vc, batch.block_tables, batch.context_lens,
                                batch.cu_seqlens_q)
    tree_rows = slice(int(batch.cu_seqlens_q[2]) + 2, int(batch.cu_seqlens_q[3]))
    assert not torch.allclose(plain[tree_rows], want[tree_rows], atol=1e-3)


def test_window_applies_inside_the_tree_region_too(step):
    batch, chunks, tables, cache, q, k, v = step
    ctx = PagedAttentionContext(cache, batch, backend="torch")
    got = ctx.attend(0, q, k, v, 3)
    ref = paged_attention_ref(q, cache.k_caches[0], cache.v_caches[0], batch.block_tables,
                              batch.context_lens, batch.cu_seqlens_q, window=3,
                              tree_mask=batch.tree_mask)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed")
def test_triton_prefill_kernel_takes_the_tree_mask(step):
    """The Triton path (interpreted on CPU) against the reference on the same cache."""
    batch, chunks, tables, cache, q, k, v = step
    kc, vc = cache.k_caches[0], cache.v_caches[0]
    kernels.store_kv(k, v, kc, vc, batch.slot_mapping, backend="torch")
    want = written_out(q, kc, vc, chunks, tables)
    mod = kernels.triton_module("triton_attention")
    got = mod.paged_attention_triton(q, kc, vc, batch.block_tables, batch.context_lens,
                                     batch.cu_seqlens_q, max_query_len=batch.max_query_len,
                                     tree_mask=batch.tree_mask)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="tree_mask"):
        mod.paged_attention_triton(q, kc, vc, batch.block_tables, batch.context_lens,
                                   batch.cu_seqlens_q, tree_mask=batch.tree_mask.int())


def test_tree_mask_rejects_a_region_narrower_than_its_chunk():
    with pytest.raises(ValueError, match="tree region"):
        tree_mask(np.array([0, 3]), {0: np.ones((3, 2), bool)})
