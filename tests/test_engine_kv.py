"""The engine's KV manager on the block pool: prefix naming, reuse, eviction, copy-on-write."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

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
    child.num_computed = parent.num_computed  # the scheduler's part of a fork
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


class KVManagerMachine(RuleBasedStateMachine):
    """The engine's manager on the pool, against a fake cache whose every slot holds the prefix
    its K/V would depend on: a wrong prefix hit, a missing copy-on-write or a block handed to two
    writers shows up as a sequence reading back a prefix that is not its own."""

    seqs = Bundle("seqs")

    @initialize(num_blocks=st.integers(2, 16), block_size=st.integers(1, 4))
    def setup(self, num_blocks, block_size):
        self.kv = manager(num_blocks, block_size)
        self.bs = block_size
        self.cache: dict[int, tuple[int, ...]] = {}  # slot -> the prefix whose K/V it holds
        self.live: dict[int, Sequence] = {}
        self.next_id = 0

    def _slot(self, s: Sequence, p: int) -> int:
        return s.block_table[p // self.bs] * self.bs + p % self.bs

    def _compute(self, s: Sequence, start: int) -> None:
        for src, dst in self.kv.pending_copies:  # what the runner does before the forward
            for i in range(self.bs):
                if src * self.bs + i in self.cache:
                    self.cache[dst * self.bs + i] = self.cache[src * self.bs + i]
        self.kv.pending_copies.clear()
        for p in range(start, s.num_tokens):
            self.cache[self._slot(s, p)] = tuple(s.token_ids[: p + 1])
        s.num_computed = s.num_tokens
        self.kv.cache_blocks(s)

    @rule(target=seqs, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def admit(self, tokens):
        self.next_id += 1
        s = seq(tokens, self.next_id)
        hit = self.kv.get_computed_blocks(s)
        cached = len(hit) * self.bs
        assert cached < s.num_tokens  # one token is always left to compute
        if not self.kv.allocate_slots(s, s.num_tokens - cached, hit):
            assert s.block_table == []
            return s
        s.num_computed = cached
        self._compute(s, cached)
        self.live[s.seq_id] = s
        return s

    @rule(s=seqs, new=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def grow(self, s, new):
        if s.seq_id not in self.live:
            return
        table, free = list(s.block_table), self.kv.num_free_blocks
        s.token_ids += new
        if not self.kv.allocate_slots(s, len(new)):
            assert s.block_table == table and self.kv.num_free_blocks == free
            del s.token_ids[-len(new):]
            return
        self._compute(s, s.num_computed)

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        if parent.seq_id not in self.live:
            return parent
        self.next_id += 1
        child = seq(list(parent.token_ids), self.next_id)
        self.kv.fork(parent, child)
        child.num_computed = parent.num_computed  # the scheduler's part of a fork
        self.live[child.seq_id] = child
        return child

    @rule(s=consumes(seqs))
    def free(self, s):
        if self.live.pop(s.seq_id, None) is not None:
            self.kv.free(s)

    @invariant()
    def every_sequence_reads_back_its_own_prefixes(self):
        for s in self.live.values():
            for p in range(s.num_computed):
                assert self.cache.get(self._slot(s, p)) == tuple(s.token_ids[: p + 1]), (
                    f"sequence {s.seq_id} position {p}")

    @invariant()
    def reference_counts_are_the_holders(self):
        pool = self.kv.pool
        holders = [0] * pool.num_blocks
        for s in self.live.values():
            for b in s.block_table:
                holders[b] += 1
        assert [pool.ref_count(b) for b in range(pool.num_blocks)] == holders
        assert sorted(pool.free_block_ids()) == [b for b, h in enumerate(holders) if h == 0]

    def teardown(self):
        if hasattr(self, "kv"):
            for s in self.live.values():
                self.kv.free(s)
            assert self.kv.num_free_blocks == self.kv.num_blocks


KVManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, database=None, deadline=None
)
TestKVManager = KVManagerMachine.TestCase
