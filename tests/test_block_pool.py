"""The block pool and block manager of Chapter 3: no block handed out twice, none leaked.

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

from infer_lab.cache import BlockManager, BlockPool, NoFreeBlocksError
from infer_lab.cache.block_pool import cdiv

# ------------------------------------------------------------------------------------- the pool


def test_pool_allocates_each_block_once_then_signals():
    pool = BlockPool(4, block_size=8)
    got = [pool.allocate() for _ in range(4)]
    assert sorted(got) == [0, 1, 2, 3] and pool.num_free == 0 and not pool.can_allocate(1)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()
    assert issubclass(NoFreeBlocksError, RuntimeError)
    pool.free(got[2])
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    assert pool.allocate() == got[2]


def test_pool_refcounts():
    pool = BlockPool(2)
    b = pool.allocate()
    pool.incref(b)
    assert pool.ref_count(b) == 2
    pool.free(b)
    assert pool.num_free == 1 and pool.ref_count(b) == 1  # still held once
    pool.free(b)
    assert pool.num_free == 2 and pool.ref_count(b) == 0
    with pytest.raises(ValueError, match="double free"):
        pool.free(b)
    with pytest.raises(ValueError, match="free"):
        pool.incref(b)
    with pytest.raises(ValueError, match="outside"):
        pool.free(2)


@pytest.mark.parametrize("kwargs", [dict(num_blocks=0), dict(num_blocks=-3),
                                    dict(num_blocks=4, block_size=0),
                                    dict(num_blocks=4, block_size=-16),
                                    dict(num_blocks=4, block_size=2.5)])
def test_bad_sizes_raise(kwargs):
    with pytest.raises(ValueError):
        BlockPool(**kwargs)
    with pytest.raises(ValueError):
        BlockManager(**kwargs)


# ---------------------------------------------------------------------------------- the manager


def test_tables_grow_a_block_at_a_time():
    mgr = BlockManager(8, block_size=4)
    table = mgr.allocate_sequence("a", 5)
    assert len(table) == 2 and mgr.num_free_blocks == 6
    assert mgr.append_slots("a", 3) == [] and len(mgr.block_table("a")) == 2  # 8 = 2 full blocks
    mgr.append_slots("a")
    assert len(mgr.block_table("a")) == 3 and mgr.num_tokens("a") == 9
    t = mgr.block_table("a")
    expected = [t[0] * 4 + 3, *(t[1] * 4 + i for i in range(4)), t[2] * 4]
    assert mgr.slot_mapping("a", 3, 9) == expected
    with pytest.raises(ValueError):
        mgr.slot("a", 9)  # not reserved yet
    mgr.free_sequence("a")
    assert mgr.num_free_blocks == 8 and "a" not in mgr


def test_fork_then_append_copies_the_shared_partial_block():
    mgr = BlockManager(8, block_size=4)
    parent = mgr.allocate_sequence("p", 6)  # one full block, one half-full
    mgr.fork("p", "c")
    assert mgr.block_table("c") == parent
    assert [mgr.pool.ref_count(b) for b in parent] == [2, 2]
    copies = mgr.append_slots("c")
    (src, dst), = copies
    assert src == parent[1] and dst not in parent
    assert mgr.block_table("c") == [parent[0], dst]
    assert mgr.pool.ref_count(parent[0]) == 2 and mgr.pool.ref_count(src) == 1
    assert mgr.append_slots("p") == []  # the parent now owns its last block alone: no copy
    assert mgr.block_table("p") == parent
    mgr.free_sequence("p")
    mgr.free_sequence("c")
    assert mgr.num_free_blocks == 8


def test_fork_on_a_block_boundary_needs_no_copy():
    mgr = BlockManager(4, block_size=4)
    mgr.allocate_sequence("p", 4)
    mgr.fork("p", "c")
    assert mgr.append_slots("c") == []
    assert mgr.block_table("c")[0] == mgr.block_table("p")[0]
    assert mgr.block_table("c")[1] != mgr.block_table("p")[0]


def test_prefix_sharing_increments_refcounts():
    mgr = BlockManager(8, block_size=4)
    first = mgr.allocate_sequence("a", 10)  # blocks 0, 1 full, 2 partial
    shared = first[:2]
    second = mgr.allocate_sequence("b", 11, prefix_blocks=shared)
    assert second[:2] == shared and second[2] not in first
    assert [mgr.pool.ref_count(b) for b in first] == [2, 2, 1]
    assert mgr.num_free_blocks == 8 - 4
    mgr.free_sequence("a")
    assert [mgr.pool.ref_count(b) for b in shared] == [1, 1] and mgr.num_free_blocks == 5
    with pytest.raises(ValueError):
        mgr.allocate_sequence("c", 7, prefix_blocks=shared)  # 2 blocks hold 8 > 7 tokens
    with pytest.raises(ValueError, match="free"):
        mgr.allocate_sequence("c", 12, prefix_blocks=[first[2]])  # freed with "a"


def test_out_of_blocks_is_signalled_and_changes_nothing():
    mgr = BlockManager(3, block_size=4)
    mgr.allocate_sequence("a", 8)
    assert not mgr.can_allocate(5) and mgr.can_allocate(4)
    with pytest.raises(NoFreeBlocksError):
        mgr.allocate_sequence("b", 5)
    assert "b" not in mgr and mgr.num_free_blocks == 1
    mgr.fork("a", "c")
    mgr.append_slots("a", 4)  # takes the last block
    assert not mgr.can_append("c", 1)
    with pytest.raises(NoFreeBlocksError):
        mgr.append_slots("c", 1)
    assert mgr.num_tokens("c") == 8 and mgr.num_free_blocks == 0


def test_misuse_raises():
    mgr = BlockManager(4, block_size=4)
    mgr.allocate_sequence("a", 3)
    with pytest.raises(ValueError):
        mgr.allocate_sequence("a", 3)
    with pytest.raises(ValueError):
        mgr.allocate_sequence("b", 0)
    with pytest.raises(KeyError):
        mgr.append_slots("nope")
    with pytest.raises(ValueError):
        mgr.fork("a", "a")
    with pytest.raises(KeyError):
        mgr.free_sequence("nope")


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
        if not self.mgr.can_allocate(n):
            with pytest.raises(NoFreeBlocksError):
                self.mgr.allocate_sequence(seq, n)
            return seq  # never created: later rules see it is not in the manager
        self.mgr.allocate_sequence(seq, n)
        self.tokens[seq] = self._fresh(n)
        self._write(seq, 0, self.tokens[seq])
        return seq

    @rule(target=seqs, src=seqs, extra=st.integers(0, 6), k=st.integers(0, 3))
    def share_prefix(self, src, extra, k):
        if src not in self.tokens:
            return src
        k = min(k, self.mgr.num_tokens(src) // self.bs)  # only full blocks can be shared
        prefix = self.mgr.block_table(src)[:k]
        n = k * self.bs + extra
        if n == 0:
            return src
        seq = self._new_id()
        if not self.mgr.can_allocate(n, num_prefix_blocks=k):
            with pytest.raises(NoFreeBlocksError):
                self.mgr.allocate_sequence(seq, n, prefix_blocks=prefix)
            return seq
        self.mgr.allocate_sequence(seq, n, prefix_blocks=prefix)
        self.tokens[seq] = self.tokens[src][: k * self.bs] + self._fresh(extra)
        self._write(seq, k * self.bs, self.tokens[seq][k * self.bs:])
        return seq

    @rule(seq=seqs, n=st.integers(1, 5))
    def append(self, seq, n):
        if seq not in self.tokens:
            return
        before = self.mgr.num_tokens(seq)
        if not self.mgr.can_append(seq, n):
            free = self.mgr.num_free_blocks
            with pytest.raises(NoFreeBlocksError):
                self.mgr.append_slots(seq, n)
            assert self.mgr.num_tokens(seq) == before and self.mgr.num_free_blocks == free
            return
        for src, dst in self.mgr.append_slots(seq, n):
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
            self.mgr.free_sequence(seq)
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
        holders = [0] * pool.num_total
        for seq in self.tokens:
            table = self.mgr.block_table(seq)
            assert len(table) == len(set(table)), "a table holds a block twice"
            assert len(table) == cdiv(self.mgr.num_tokens(seq), self.bs)
            for b in table:
                holders[b] += 1
        for b in range(pool.num_total):
            assert pool.ref_count(b) == holders[b]
            assert (b in free) == (holders[b] == 0), f"block {b} leaked or handed out while free"
        assert set(self.mgr.seq_ids()) == set(self.tokens)

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for seq in list(self.tokens):
            self.mgr.free_sequence(seq)
        assert self.mgr.num_free_blocks == self.mgr.pool.num_total


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, database=None, deadline=None
)
TestBlockManager = BlockManagerMachine.TestCase
