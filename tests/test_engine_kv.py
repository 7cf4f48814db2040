"""The engine's block manager: prefix-cache naming, reuse, eviction, and copy-on-write."""

from __future__ import annotations

from infer_lab.engine import EngineConfig, KVCacheManager, SamplingParams
from infer_lab.engine.sequence import Request, Sequence


def manager(num_blocks: int, block_size: int) -> KVCacheManager:
    return KVCacheManager(EngineConfig(num_kv_blocks=num_blocks, block_size=block_size))


def seq(tokens: list[int], sid: int = 0) -> Sequence:
    req = Request(str(sid), None, list(tokens), SamplingParams(), 0.0, frozenset())
    return Sequence(sid, req, 0, list(tokens), len(tokens))


def computed(kv: KVCacheManager, s: Sequence) -> None:
    assert kv.allocate_slots(s, s.num_tokens)
    s.num_computed = s.num_tokens
    kv.cache_blocks(s)


def test_freed_full_blocks_stay_cached_until_reused():
    kv = manager(6, 4)
    a = seq(list(range(10)))  # 2 full blocks + 2 tokens
    computed(kv, a)
    blocks = list(a.block_table)
    kv.free(a)
    assert kv.num_free_blocks == 6 and kv.num_cached_blocks == 2
    b = seq(list(range(8)) + [99, 98, 97], sid=1)
    hit = kv.get_computed_blocks(b)
    assert hit == blocks[:2]
    assert kv.allocate_slots(b, 3, hit) and b.block_table[:2] == blocks[:2]
    assert kv.num_free_blocks == 3
    c = seq([7] * 5, sid=2)  # a different prefix: no hit, and it may evict nothing in use
    assert kv.get_computed_blocks(c) == []
    computed(kv, c)
    kv.free(b)
    kv.free(c)
    assert kv.num_free_blocks == 6


def test_a_reallocated_block_loses_its_name():
    kv = manager(2, 4)
    a = seq([1, 2, 3, 4, 5])
    computed(kv, a)
    kv.free(a)
    assert kv.num_cached_blocks == 1
    other = seq([9] * 8, sid=1)
    assert kv.allocate_slots(other, 8)  # takes both blocks, evicting the named one
    assert kv.num_cached_blocks == 0
    assert kv.get_computed_blocks(seq([1, 2, 3, 4, 5], sid=2)) == []
    kv.free(other)


def test_a_prefix_must_match_every_block_before_it():
    kv = manager(8, 2)
    computed(kv, seq([1, 2, 3, 4, 5]))
    assert len(kv.get_computed_blocks(seq([1, 2, 3, 4, 6], sid=1))) == 2
    assert kv.get_computed_blocks(seq([0, 2, 3, 4, 5], sid=2)) == []  # same block 2, other parent
    assert len(kv.get_computed_blocks(seq([1, 2, 3, 4], sid=3))) == 1  # one token left to compute


def test_fork_copies_a_shared_partial_block_before_writing():
    kv = manager(4, 4)
    parent = seq([1, 2, 3, 4, 5, 6])
    computed(kv, parent)
    child = seq([1, 2, 3, 4, 5, 6], sid=1)
    kv.fork(parent, child)
    assert kv.ref_count(parent.block_table[1]) == 2
    assert kv.allocate_slots(child, 1)  # writes into block 1: must get its own copy
    assert kv.pending_copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0] != child.block_table[1]
    kv.pending_copies.clear()
    assert kv.allocate_slots(parent, 1) and not kv.pending_copies  # now the sole owner
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 4


def test_allocation_that_does_not_fit_changes_nothing():
    kv = manager(2, 4)
    s = seq([1] * 12)
    assert not kv.allocate_slots(s, 12)
    assert s.block_table == [] and kv.num_free_blocks == 2
