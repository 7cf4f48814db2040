"""The one block allocator and Chapter 3's manager on it: no block handed out twice, none leaked.

The stateful test keeps a fake cache (one token id per slot) beside the manager and writes every
sequence's tokens through its slot mapping, so a missing copy-on-write or a block handed to two
owners shows up as a sequence reading back tokens it never wrote.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from infer_lab.cache import BlockManager, BlockPool, NoFreeBlocksError, block_key
from infer_lab.utils import cdiv

# ------------------------------------------------------------------------------------- the pool


def test_pool_allocates_each_block_once_then_signals():
    pool = BlockPool(4)
    got = pool.get_new_blocks(4)
    assert sorted(got) == [0, 1, 2, 3] and pool.num_free_blocks == 0 and not pool.can_allocate(1)
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(1)
    assert issubclass(NoFreeBlocksError, RuntimeError)
    pool.free_blocks([got[2]])
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1  # a request that cannot be met takes nothing
    assert pool.get_new_blocks(1) == [got[2]]


def test_pool_refcounts():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert pool.ref_count(b) == 2
    pool.free_blocks([b])
    assert pool.num_free_blocks == 1 and pool.ref_count(b) == 1  # still held once
    pool.free_blocks([b])
    assert pool.num_free_blocks == 2 and pool.ref_count(b) == 0
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([b])
    with pytest.raises(ValueError, match="free"):
        pool.touch([b])  # free and unnamed: nothing in it may be read
    with pytest.raises(ValueError, match="outside"):
        pool.free_blocks([2])


def test_free_queue_is_least_recently_freed_first():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks([blocks[2], blocks[0]])
    pool.free_blocks([blocks[3]])
    assert pool.free_block_ids() == [blocks[2], blocks[0], blocks[3]]
    assert pool.get_new_blocks(2) == [blocks[2], blocks[0]]


def test_a_named_free_block_can_be_taken_back_until_it_is_reused():
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    key = block_key(None, [1, 2])
    assert pool.cache_block(a, key) and not pool.cache_block(b, key)  # one block per key
    pool.free_blocks([c, b, a])
    assert pool.get_cached_block(key) == a and pool.num_free_blocks == 3
    pool.touch([a])  # a later request with the same prefix takes it back
    assert pool.ref_count(a) == 1 and a not in pool.free_block_ids()
    pool.free_blocks([a])
    assert pool.get_new_blocks(2) == [c, b]  # least recently freed first: a is kept longest
    assert pool.get_cached_block(key) == a
    assert pool.get_new_blocks(1) == [a] and pool.get_cached_block(key) is None  # evicted
    assert pool.key_of(a) is None and pool.num_cached_blocks == 0


def test_keys_chain_the_prefix():
    first = block_key(None, [1, 2])
    assert block_key(first, [3, 4]) != block_key(block_key(None, [9, 2]), [3, 4])
    assert block_key(first, [3, 4]) == block_key(block_key(None, (1, 2)), (3, 4))


def test_without_caching_freed_blocks_forget_their_name():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    assert not pool.cache_block(a, block_key(None, [1]))
    assert pool.num_cached_blocks == 0


@pytest.mark.parametrize("kwargs", [dict(num_blocks=0), dict(num_blocks=-3),
                                    dict(num_blocks=4, block_size=0),
                                    dict(num_blocks=4, block_size=-16),
                                    dict(num_blocks=4, block_size=2.5)])
def test_bad_sizes_raise(kwargs):
    with pytest.raises(ValueError):
        BlockManager(**kwargs)
    if "block_size" not in kwargs:
        with pytest.raises(ValueError):
            BlockPool(**kwargs)


class BlockPoolMachine(RuleBasedStateMachine):
    """The allocator against a plain model: a list as the free queue, counts, a key map."""

    @initialize(num_blocks=st.integers(1, 10), caching=st.booleans())
    def setup(self, num_blocks, caching):
        self.pool = BlockPool(num_blocks, enable_caching=caching)
        self.caching = caching
        self.free = list(range(num_blocks))  # the model's free queue, front first
        self.refs = [0] * num_blocks
        self.keys: dict[int, object] = {}  # block -> key
        self.next_key = 0

    @rule(n=st.integers(0, 4))
    def get_new_blocks(self, n):
        if n > len(self.free):
            with pytest.raises(NoFreeBlocksError):
                self.pool.get_new_blocks(n)
            return
        got = self.pool.get_new_blocks(n)
        assert got == self.free[:n], "blocks must come from the front of the free queue"
        del self.free[:n]
        for b in got:
            self.refs[b] = 1
            self.keys.pop(b, None)  # handed out again: evicted

    @rule(data=st.data())
    def touch(self, data):
        candidates = [b for b, r in enumerate(self.refs) if r > 0 or b in self.keys]
        if not candidates:
            return
        b = data.draw(st.sampled_from(candidates))
        self.pool.touch([b])
        if self.refs[b] == 0:
            self.free.remove(b)
        self.refs[b] += 1

    @rule(data=st.data())
    def free_one(self, data):
        held = [b for b, r in enumerate(self.refs) if r > 0]
        if not held:
            return
        b = data.draw(st.sampled_from(held))
        self.pool.free_blocks([b])
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self.free.append(b)
            if not self.caching:
                self.keys.pop(b, None)

    @rule(data=st.data())
    def name(self, data):
        held = [b for b, r in enumerate(self.refs) if r > 0]
        if not held:
            return
        b = data.draw(st.sampled_from(held))
        self.next_key += 1
        key = block_key(None, [self.next_key])
        named = self.pool.cache_block(b, key)
        assert named == (self.caching and b not in self.keys)
        if named:
            self.keys[b] = key

    @invariant()
    def matches_the_model(self):
        pool = self.pool
        assert pool.free_block_ids() == self.free
        assert [pool.ref_count(b) for b in range(pool.num_blocks)] == self.refs
        assert pool.num_free_blocks + sum(r > 0 for r in self.refs) == pool.num_blocks
        assert pool.num_cached_blocks == len(self.keys)
        for b, key in self.keys.items():
            assert pool.get_cached_block(key) == b and pool.key_of(b) == key


BlockPoolMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, database=None, deadline=None
)
TestBlockPool = BlockPoolMachine.TestCase


# ---------------------------------------------------------------------------------- the manager


def test_tables_grow_a_block_at_a_time():
    mgr = BlockManager(8, block_size=4)
    assert mgr.allocate_slots("a", 5) == []  # no copies
    assert len(mgr.block_table("a")) == 2 and mgr.num_free_blocks == 6
    assert mgr.allocate_slots("a", 3) == [] and len(mgr.block_table("a")) == 2  # 8 = 2 full blocks
    mgr.allocate_slots("a", 1)
    assert len(mgr.block_table("a")) == 3 and mgr.num_tokens("a") == 9
    t = mgr.block_table("a")
    expected = [t[0] * 4 + 3, *(t[1] * 4 + i for i in range(4)), t[2] * 4]
    assert mgr.slot_mapping("a", 3, 9) == expected
    with pytest.raises(ValueError):
        mgr.slot("a", 9)  # not reserved yet
    mgr.free("a")
    assert mgr.num_free_blocks == 8 and "a" not in mgr


def test_fork_then_append_copies_the_shared_partial_block():
    mgr = BlockManager(8, block_size=4)
    mgr.allocate_slots("p", 6)
    parent = mgr.block_table("p")  # one full block, one half-full
    mgr.fork("p", "c")
    assert mgr.block_table("c") == parent
    assert [mgr.pool.ref_count(b) for b in parent] == [2, 2]
    copies = mgr.allocate_slots("c", 1)
    (src, dst), = copies
    assert src == parent[1] and dst not in parent
    assert mgr.block_table("c") == [parent[0], dst]
    assert mgr.pool.ref_count(parent[0]) == 2 and mgr.pool.ref_count(src) == 1
    assert mgr.allocate_slots("p", 1) == []  # the parent now owns its last block alone: no copy
    assert mgr.block_table("p") == parent
    mgr.free("p")
    mgr.free("c")
    assert mgr.num_free_blocks == 8


def test_fork_on_a_block_boundary_needs_no_copy():
    mgr = BlockManager(4, block_size=4)
    mgr.allocate_slots("p", 4)
    mgr.fork("p", "c")
    assert mgr.allocate_slots("c", 1) == []
    assert mgr.block_table("c")[0] == mgr.block_table("p")[0]
    assert mgr.block_table("c")[1] != mgr.block_table("p")[0]


def test_prefix_sharing_increments_refcounts():
    mgr = BlockManager(8, block_size=4)
    mgr.allocate_slots("a", 10)
    first = mgr.block_table("a")  # blocks 0, 1 full, 2 partial
    shared = first[:2]
    mgr.allocate_slots("b", 3, computed_blocks=shared)
    second = mgr.block_table("b")
    assert second[:2] == shared and second[2] not in first
    assert [mgr.pool.ref_count(b) for b in first] == [2, 2, 1]
    assert mgr.num_free_blocks == 8 - 4
    mgr.free("a")
    assert [mgr.pool.ref_count(b) for b in shared] == [1, 1] and mgr.num_free_blocks == 5
    with pytest.raises(ValueError, match="already has blocks"):
        mgr.allocate_slots("b", 1, computed_blocks=shared)  # computed blocks start a table
    with pytest.raises(ValueError, match="free"):
        mgr.allocate_slots("c", 4, computed_blocks=[first[2]])  # freed with "a"


def test_out_of_blocks_is_signalled_and_changes_nothing():
    mgr = BlockManager(3, block_size=4)
    mgr.allocate_slots("a", 8)
    assert not mgr.can_allocate("b", 5) and mgr.can_allocate("b", 4)
    with pytest.raises(NoFreeBlocksError):
        mgr.allocate_slots("b", 5)
    assert "b" not in mgr and mgr.num_free_blocks == 1
    mgr.fork("a", "c")
    mgr.allocate_slots("a", 4)  # takes the last block
    assert not mgr.can_allocate("c", 1)
    with pytest.raises(NoFreeBlocksError):
        mgr.allocate_slots("c", 1)
    assert mgr.num_tokens("c") == 8 and mgr.num_free_blocks == 0


def test_misuse_raises():
    mgr = BlockManager(4, block_size=4)
    mgr.allocate_slots("a", 3)
    with pytest.raises(ValueError):
        mgr.allocate_slots("a", 0)
    with pytest.raises(ValueError):
        mgr.allocate_slots("b", 0)
    with pytest.raises(KeyError):
        mgr.block_table("nope")
    with pytest.raises(ValueError):
        mgr.fork("a", "a")
    with pytest.raises(KeyError):
        mgr.free("nope")


# ------------------------------------------------------------------------ the stateful property


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / prefix-share against a fake slot-level cache."""

    seqs = Bundle("seqs")

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 4))
    def setup(self, num_blocks, block_size):
        self.mgr = BlockManager(num_blocks, block_size)
        self.bs = block_size
        self.cache: dict[int, int] = {}  # slot -> token id written there
        self.tokens: dict[int, list[int]] = {}  # what each live sequence should read back
        self.next_id = 0
        self.next_token = 0

    def _fresh(self, n):
        self.next_token += n
        return list(range(self.next_token - n, self.next_token))

    def _write(self, seq, start, toks):
        for pos, tok in zip(range(start, start + len(toks)), toks, strict=True):
            self.cache[self.mgr.slot(seq, pos)] = tok

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    @rule(target=seqs, n=st.integers(1, 10))
    def allocate(self, n):
        seq = self._new_id()
        if not self.mgr.can_allocate(seq, n):
            with pytest.raises(NoFreeBlocksError):
                self.mgr.allocate_slots(seq, n)
            return seq  # never created: later rules see it is not in the manager
        self.mgr.allocate_slots(seq, n)
        self.tokens[seq] = self._fresh(n)
        self._write(seq, 0, self.tokens[seq])
        return seq

    @rule(target=seqs, src=seqs, extra=st.integers(0, 6), k=st.integers(0, 3))
    def share_prefix(self, src, extra, k):
        if src not in self.tokens:
            return src
        k = min(k, self.mgr.num_tokens(src) // self.bs)  # only full blocks can be shared
        prefix = self.mgr.block_table(src)[:k]
        if extra == 0:
            return src
        seq = self._new_id()
        if not self.mgr.can_allocate(seq, extra, computed_blocks=prefix):
            with pytest.raises(NoFreeBlocksError):
                self.mgr.allocate_slots(seq, extra, computed_blocks=prefix)
            return seq
        self.mgr.allocate_slots(seq, extra, computed_blocks=prefix)
        self.tokens[seq] = self.tokens[src][: k * self.bs] + self._fresh(extra)
        self._write(seq, k * self.bs, self.tokens[seq][k * self.bs:])
        return seq

    @rule(seq=seqs, n=st.integers(1, 5))
    def append(self, seq, n):
        if seq not in self.tokens:
            return
        before = self.mgr.num_tokens(seq)
        if not self.mgr.can_allocate(seq, n):
            free = self.mgr.num_free_blocks
            with pytest.raises(NoFreeBlocksError):
                self.mgr.allocate_slots(seq, n)
            assert self.mgr.num_tokens(seq) == before and self.mgr.num_free_blocks == free
            return
        for src, dst in self.mgr.allocate_slots(seq, n):
            for i in range(self.bs):
                if src * self.bs + i in self.cache:
                    self.cache[dst * self.bs + i] = self.cache[src * self.bs + i]
        toks = self._fresh(n)
        self.tokens[seq] += toks
        self._write(seq, before, toks)

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        if parent not in self.tokens:
            return parent
        child = self._new_id()
        self.mgr.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        return child

    @rule(seq=consumes(seqs))
    def free(self, seq):
        if seq in self.tokens:
            self.mgr.free(seq)
            del self.tokens[seq]

    @invariant()
    def every_sequence_reads_back_its_own_tokens(self):
        for seq, toks in self.tokens.items():
            got = [self.cache.get(s) for s in self.mgr.slot_mapping(seq, 0, len(toks))]
            assert got == toks, f"sequence {seq} reads {got}, wrote {toks}"

    @invariant()
    def blocks_are_free_xor_held_with_the_right_refcount(self):
        pool = self.mgr.pool
        free = pool.free_block_ids()
        assert len(free) == len(set(free)), "a block is on the free list twice"
        holders = [0] * pool.num_blocks
        for seq in self.tokens:
            table = self.mgr.block_table(seq)
            assert len(table) == len(set(table)), "a table holds a block twice"
            assert len(table) == cdiv(self.mgr.num_tokens(seq), self.bs)
            for b in table:
                holders[b] += 1
        for b in range(pool.num_blocks):
            assert pool.ref_count(b) == holders[b]
            assert (b in free) == (holders[b] == 0), f"block {b} leaked or handed out while free"
        assert set(self.mgr.seq_ids()) == set(self.tokens)

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for seq in list(self.tokens):
            self.mgr.free(seq)
        assert self.mgr.num_free_blocks == self.mgr.pool.num_blocks


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, database=None, deadline=None
)
TestBlockManager = BlockManagerMachine.TestCase


def test_the_old_keyword_n_still_works_and_warns():
    """``n`` was renamed ``num_blocks`` (vLLM's name); the old keyword keeps working a while."""
    pool = BlockPool(4)
    with pytest.warns(DeprecationWarning, match=r"can_allocate\(n=...\) is deprecated: use num"):
        assert pool.can_allocate(n=4)
    with pytest.warns(DeprecationWarning, match="use num_blocks="):
        assert len(pool.get_new_blocks(n=2)) == 2
    assert pool.get_new_blocks(num_blocks=1) and pool.can_allocate(1)
    with pytest.raises(TypeError, match="both n= and num_blocks="):
        pool.can_allocate(n=1, num_blocks=1)
