"""Fixed-size KV blocks, their free list and reference counts, and per-sequence block tables.

Chapter 3's idea in plain Python: instead of reserving ``max_len`` slots per sequence up front, the
cache is cut into blocks of ``block_size`` token slots (each block covers every layer), and a
sequence owns a *block table*, the list of blocks holding its tokens in order. A block can be held
by several sequences at once (a forked sequence, a shared prompt prefix); its reference count says
by how many, and it goes back to the free list when the last holder lets go.

Running out of blocks is a normal condition, not a bug: :meth:`BlockPool.allocate` raises
:class:`NoFreeBlocksError`, and ``can_allocate`` / ``num_blocks_needed`` let a scheduler ask first.
Operations that need several blocks check first and change nothing when they cannot complete.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence

SeqId = Hashable


class NoFreeBlocksError(RuntimeError):
    """The pool has fewer free blocks than the request needs (a scheduler preempts or waits)."""


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or int(value) != value or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` slots ``a`` tokens need."""
    return -(-a // b)


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` slots: a free list plus a reference count per block.

    A block is either free (in the free list, ref count 0) or in use (ref count >= 1), never both.
    """

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        _check_positive("num_blocks", num_blocks)
        _check_positive("block_size", block_size)
        self.block_size = int(block_size)
        self._ref_counts = [0] * int(num_blocks)
        # FIFO: a freed block goes to the back, so recently freed blocks are reused last
        # (the order vLLM keeps so that a freed prefix stays cached as long as possible).
        self._free: deque[int] = deque(range(int(num_blocks)))

    @property
    def num_total(self) -> int:
        return len(self._ref_counts)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int = 1) -> bool:
        """True when ``n`` blocks can be allocated right now."""
        return n <= len(self._free)

    def free_block_ids(self) -> list[int]:
        """The free list, in the order blocks will be handed out (for inspection and tests)."""
        return list(self._free)

    def ref_count(self, block: int) -> int:
        self._check_block(block)
        return self._ref_counts[block]

    def allocate(self) -> int:
        """Take a free block (ref count becomes 1); raises :class:`NoFreeBlocksError` if none."""
        if not self._free:
            raise NoFreeBlocksError(f"all {self.num_total} KV blocks are in use")
        block = self._free.popleft()
        self._ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        """One more holder of an in-use block (a fork or a shared prefix)."""
        self._check_block(block)
        if self._ref_counts[block] == 0:
            raise ValueError(f"block {block} is free; only an allocated block can be shared")
        self._ref_counts[block] += 1

    def free(self, block: int) -> None:
        """One holder fewer; the block returns to the free list when nobody holds it."""
        self._check_block(block)
        if self._ref_counts[block] == 0:
            raise ValueError(f"block {block} is already free (double free)")
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free.append(block)

    def _check_block(self, block: int) -> None:
        if not 0 <= block < self.num_total:
            raise ValueError(f"block {block} is outside the pool of {self.num_total} blocks")


class BlockManager:
    """Per-sequence block tables on top of a :class:`BlockPool` (vLLM's block manager).

    It only does bookkeeping; the tensors live in the cache. Where a shared block must be copied
    before a sequence writes into it (copy-on-write), :meth:`append_slots` returns the
    ``(src, dst)`` block pairs and the caller copies them (``PagedKVCache.copy_blocks``).
    """

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = self.pool.block_size
        self._tables: dict[SeqId, list[int]] = {}
        self._num_tokens: dict[SeqId, int] = {}

    # ------------------------------------------------------------------ queries
    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._tables

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def block_table(self, seq_id: SeqId) -> list[int]:
        """The blocks holding ``seq_id``'s tokens, in order (a copy)."""
        return list(self._table(seq_id))

    def num_tokens(self, seq_id: SeqId) -> int:
        """Token slots reserved for ``seq_id`` so far."""
        self._table(seq_id)
        return self._num_tokens[seq_id]

    def seq_ids(self) -> list[SeqId]:
        return list(self._tables)

    def num_blocks_needed(self, seq_id: SeqId, n: int = 1) -> int:
        """Fresh blocks that appending ``n`` tokens to ``seq_id`` takes (copy-on-write included)."""
        table, used = self._table(seq_id), self._num_tokens[seq_id]
        needed = cdiv(used + n, self.block_size) - len(table)
        if self._last_block_shared_and_partial(seq_id) and n > 0:
            needed += 1
        return needed

    def can_append(self, seq_id: SeqId, n: int = 1) -> bool:
        return self.pool.can_allocate(self.num_blocks_needed(seq_id, n))

    def can_allocate(self, num_tokens: int, num_prefix_blocks: int = 0) -> bool:
        """Whether a new sequence of ``num_tokens`` tokens fits (its first blocks shared)."""
        return self.pool.can_allocate(cdiv(num_tokens, self.block_size) - num_prefix_blocks)

    # ------------------------------------------------------------------ changes
    def allocate_sequence(
        self, seq_id: SeqId, num_tokens: int, prefix_blocks: Sequence[int] = ()
    ) -> list[int]:
        """Block table for a new sequence of ``num_tokens`` tokens.

        ``prefix_blocks`` are existing *full* blocks that already hold this sequence's first
        ``len(prefix_blocks) * block_size`` tokens (a shared prompt prefix): they are shared by
        reference count instead of being allocated and recomputed.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        _check_positive("num_tokens", num_tokens)
        if len(prefix_blocks) * self.block_size > num_tokens:
            raise ValueError(
                f"{len(prefix_blocks)} prefix blocks hold more than the {num_tokens} tokens given"
            )
        for block in prefix_blocks:
            if self.pool.ref_count(block) == 0:
                raise ValueError(f"prefix block {block} is free, so it holds no prefix")
        fresh = cdiv(num_tokens, self.block_size) - len(prefix_blocks)
        self._require(fresh)
        for block in prefix_blocks:
            self.pool.incref(block)
        table = list(prefix_blocks) + [self.pool.allocate() for _ in range(fresh)]
        self._tables[seq_id], self._num_tokens[seq_id] = table, int(num_tokens)
        return list(table)

    def append_slots(self, seq_id: SeqId, n: int = 1) -> list[tuple[int, int]]:
        """Reserve slots for ``n`` more tokens; returns the ``(src, dst)`` block copies to do.

        A new block is allocated when the last one is full. When the last block is partly filled
        and shared (after :meth:`fork`), this sequence gets its own copy first (copy-on-write),
        because its next token would otherwise overwrite a slot another sequence will write.
        """
        _check_positive("n", n)
        table = self._table(seq_id)
        self._require(self.num_blocks_needed(seq_id, n))
        copies = []
        if self._last_block_shared_and_partial(seq_id):
            src = table[-1]
            dst = self.pool.allocate()
            self.pool.free(src)  # drops this sequence's reference only; the other holder keeps it
            table[-1] = dst
            copies.append((src, dst))
        self._num_tokens[seq_id] += n
        while len(table) * self.block_size < self._num_tokens[seq_id]:
            table.append(self.pool.allocate())
        return copies

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """``child_id`` shares every block of ``parent_id`` (parallel sampling, beam search)."""
        table = self._table(parent_id)
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id!r} already has blocks")
        for block in table:
            self.pool.incref(block)
        self._tables[child_id] = list(table)
        self._num_tokens[child_id] = self._num_tokens[parent_id]

    def free_sequence(self, seq_id: SeqId) -> None:
        """Release ``seq_id``'s blocks (shared ones stay with their other holders)."""
        table = self._table(seq_id)
        for block in reversed(table):  # tail first: the prefix blocks stay cached longest
            self.pool.free(block)
        del self._tables[seq_id], self._num_tokens[seq_id]

    # ------------------------------------------------------------------ slots
    def slot(self, seq_id: SeqId, position: int) -> int:
        """Flat cache slot of the token at ``position``: block_id * block_size + offset."""
        table = self._table(seq_id)
        if not 0 <= position < self._num_tokens[seq_id]:
            raise ValueError(
                f"position {position} is outside the {self._num_tokens[seq_id]} slots of "
                f"sequence {seq_id!r}"
            )
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def slot_mapping(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        """Slots of the tokens at positions ``start .. end-1`` (where their K/V are written)."""
        table, used = self._table(seq_id), self._num_tokens[seq_id]
        if not 0 <= start <= end <= used:
            raise ValueError(
                f"positions {start}..{end - 1} are outside the {used} slots of sequence {seq_id!r}"
            )
        return slot_mapping_for(table, start, end, self.block_size)

    # ------------------------------------------------------------------ internals
    def _table(self, seq_id: SeqId) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def _last_block_shared_and_partial(self, seq_id: SeqId) -> bool:
        table = self._tables[seq_id]
        partial = self._num_tokens[seq_id] % self.block_size != 0
        return bool(table) and partial and self.pool.ref_count(table[-1]) > 1

    def _require(self, n: int) -> None:
        if not self.pool.can_allocate(n):
            raise NoFreeBlocksError(
                f"need {n} KV blocks but only {self.pool.num_free} of {self.pool.num_total} "
                "are free"
            )


def slot_mapping_for(
    block_table: Sequence[int], start: int, end: int, block_size: int
) -> list[int]:
    """Slots of positions ``start .. end-1`` of a sequence with ``block_table`` (no manager)."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
