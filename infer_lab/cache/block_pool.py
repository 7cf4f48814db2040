"""The KV block allocator, and Chapter 3's per-sequence block tables on top of it.

Chapter 3's idea in plain Python: instead of reserving ``max_len`` slots per sequence up front, the
cache is cut into blocks of ``block_size`` token slots (each block covers every layer), and a
sequence owns a *block table*, the list of blocks holding its tokens in order.

:class:`BlockPool` is the one allocator of the package: Chapter 3's :class:`BlockManager` and the
engine's :class:`~infer_lab.engine.kv_cache_manager.KVCacheManager` both sit on it (the way vLLM
v1 composes its ``KVCacheManager`` over a ``BlockPool``). It keeps

- a **free queue** in least-recently-freed order: a freed block goes to the back, new blocks come
  from the front, so a block freed a moment ago is reused last;
- a **reference count** per block: a block can be held by several sequences at once (a fork, a
  shared prompt prefix), and goes back to the free queue when the last holder lets go;
- the **prefix map** from a block key (a name for the tokens a full block holds, and everything
  before them) to the block. A named block keeps its name and contents while it sits in the free
  queue; a later sequence with the same prefix can take it back (:meth:`BlockPool.touch`). It loses
  its name only when it is handed out again for something else (eviction).

Running out of blocks is a normal condition, not a bug: :meth:`BlockPool.get_new_blocks` raises
:class:`NoFreeBlocksError`, and ``num_free_blocks`` / ``can_allocate`` let a scheduler ask first.
Operations that need several blocks check first and change nothing when they cannot complete.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence

import numpy as np

from infer_lab.utils import cdiv, check_positive_int, renamed_keyword

SeqId = Hashable
BlockKey = bytes  # SHA-256 of (the previous block's key, this block's tokens): 32 bytes
NONE_KEY = bytes(32)  # the "previous key" of a prompt's first block


class NoFreeBlocksError(RuntimeError):
    """The pool has fewer free blocks than the request needs (a scheduler preempts or waits)."""


def block_key(parent: BlockKey | None, tokens: Sequence[int]) -> BlockKey:
    """The name of a full block: its tokens and, through ``parent``, every token before them.

    Two blocks with equal tokens after different prefixes hold different K/V (attention mixed the
    prefix in), so the key must include the prefix; chaining the previous key does that in
    constant size. The key is a SHA-256 digest over the parent's key (``NONE_KEY`` for the first
    block) and the token ids as fixed-width little-endian uint32, and the digest is the whole
    key: two prompts share a cached block only if they share every token up to its end, unless
    someone finds a SHA-256 collision. (A key of Python's ``hash()`` is unseeded for ints and
    invertible step by step, so a client can build a block that another tenant's prompt would
    hit: vLLM's CVE-2025-25183.) The same tokens give the same key in every process, so a key can
    name a block in another cache tier or another engine.
    """
    try:
        data = struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error as e:
        raise ValueError(f"block tokens must be ids in [0, 2**32): {e}") from None
    return hashlib.sha256((NONE_KEY if parent is None else parent) + data).digest()


class BlockPool:
    """``num_blocks`` KV blocks: the free queue, reference counts and the prefix map.

    A block is either free (in the free queue, ref count 0) or in use (ref count >= 1), never both.
    A free block may still carry a key (its contents are a cached prefix) until it is handed out.
    ``enable_caching=False`` makes freed blocks forget their contents at once.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = check_positive_int("num_blocks", num_blocks)
        self.enable_caching = enable_caching
        # An ordered dict as the free queue: append and pop at the ends, and O(1) removal from the
        # middle when a cached block is taken back.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref = [0] * num_blocks
        self._key: list[BlockKey | None] = [None] * num_blocks
        self._cached: dict[BlockKey, int] = {}
        # Called as (block, key) just before a named block is handed out again, while it still
        # holds its K/V: a second tier (Chapter 13's ``KVTier``) keeps the bytes.
        self.on_evict: Callable[[int, BlockKey], None] | None = None

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that carry a key (in use or free)."""
        return len(self._cached)

    @renamed_keyword("n", "num_blocks")
    def can_allocate(self, num_blocks: int) -> bool:
        """True when ``num_blocks`` new blocks can be handed out right now."""
        return num_blocks <= len(self._free)

    def free_block_ids(self) -> list[int]:
        """The free queue, in the order blocks will be handed out (for inspection and tests)."""
        return list(self._free)

    def ref_count(self, block: int) -> int:
        self._check_block(block)
        return self._ref[block]

    def key_of(self, block: int) -> BlockKey | None:
        self._check_block(block)
        return self._key[block]

    def get_cached_block(self, key: BlockKey) -> int | None:
        """The block named ``key``, in use or free, or None."""
        return self._cached.get(key)

    # ------------------------------------------------------------------ changes
    @renamed_keyword("n", "num_blocks")
    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the front of the free queue (each with ref count 1).

        A taken block that still carried a key is evicted: its contents are about to be
        overwritten. Raises :class:`NoFreeBlocksError`, taking nothing, if fewer are free.
        """
        free = self._free
        if num_blocks > len(free):
            raise NoFreeBlocksError(f"need {num_blocks} KV blocks but only {len(free)} of "
                                    f"{self.num_blocks} are free")
        out = []
        for _ in range(num_blocks):
            block, _ = free.popitem(last=False)
            key = self._key[block]
            if key is not None:
                if self.on_evict is not None:
                    self.on_evict(block, key)
                del self._cached[key]
                self._key[block] = None
            self._ref[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """One more holder of each block (a fork, a shared prefix).

        A free block can be taken back only if it carries a key: then its contents are a cached
        prefix and it leaves the free queue. A free block without a key holds nothing anyone may
        read, so touching it is a bug and raises.
        """
        for block in blocks:
            self._check_block(block)
            if self._ref[block] == 0:
                if self._key[block] is None:
                    raise ValueError(f"block {block} is free and holds no cached prefix; only an "
                                     "allocated or cached block can be shared")
                del self._free[block]
            self._ref[block] += 1

    def free_blocks(self, blocks: Iterable[int]) -> None:
        """One holder fewer for each block, in order; a block nobody holds joins the free queue.

        Callers pass a table's blocks last first, so that the tail of a sequence is evicted before
        its prefix (the prefix is the part other requests are likely to share).
        """
        ref, free, num_blocks = self._ref, self._free, self.num_blocks
        for block in blocks:
            if not 0 <= block < num_blocks or ref[block] <= 0:
                self._check_block(block)
                raise ValueError(f"block {block} is already free (double free)")
            ref[block] -= 1
            if ref[block] == 0:
                free[block] = None
                if not self.enable_caching and self._key[block] is not None:
                    self._forget(block)

    def copy_on_write(self, block: int) -> int:
        """A private block for one holder of shared ``block``: a new block is taken, that holder's
        reference to ``block`` is given back (the others keep theirs), and the new block is
        returned. The caller puts it in its table and copies the contents ``block -> new`` before
        the next write (a partly filled last block shared after a fork)."""
        (new,) = self.get_new_blocks(1)
        self.free_blocks([block])
        return new

    def return_unwritten(self, blocks: Sequence[int]) -> None:
        """Give back blocks just taken with :meth:`get_new_blocks` and not kept (speculative
        decoding's rejected lookahead): each goes to the *front* of the free queue, in the order
        it was handed out, so the pool hands them out next as if they had never left."""
        ref, free = self._ref, self._free
        for block in reversed(blocks):
            if ref[block] != 1 or self._key[block] is not None:
                raise ValueError(f"block {block} is shared or named; it cannot be handed back")
            ref[block] = 0
            free[block] = None
            free.move_to_end(block, last=False)

    def cache_block(self, block: int, key: BlockKey) -> bool:
        """Name the full, in-use ``block`` by ``key``; False if the key or the block is taken."""
        if not self.enable_caching or self._key[block] is not None or key in self._cached:
            return False
        if self._ref[block] == 0:
            raise ValueError(f"block {block} is free; only a block in use can be named")
        self._cached[key] = block
        self._key[block] = key
        return True

    def _forget(self, block: int) -> None:
        key = self._key[block]
        assert key is not None, f"block {block} has no name to forget"
        del self._cached[key]
        self._key[block] = None

    def _check_block(self, block: int) -> None:
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or not (
            0 <= block < self.num_blocks
        ):
            raise ValueError(f"block {block!r} is outside the pool of {self.num_blocks} blocks")


class BlockManager:
    """Per-sequence block tables on top of a :class:`BlockPool` (Chapter 3).

    It only does bookkeeping; the tensors live in the cache. The vocabulary is vLLM's:
    :meth:`allocate_slots` makes a sequence's table cover ``num_new`` more tokens (creating the
    table, possibly over ``computed_blocks`` shared with another sequence), :meth:`free` gives it
    back. Where a shared block must be copied before a sequence writes into it (copy-on-write),
    :meth:`allocate_slots` returns the ``(src, dst)`` block pairs and the caller copies them
    (``PagedKVCache.copy_blocks``).
    """

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        self.block_size = check_positive_int("block_size", block_size)
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self._tables: dict[SeqId, list[int]] = {}
        self._num_tokens: dict[SeqId, int] = {}

    # ------------------------------------------------------------------ queries
    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._tables

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_table(self, seq_id: SeqId) -> list[int]:
        """The blocks holding ``seq_id``'s tokens, in order (a copy)."""
        return list(self._table(seq_id))

    def num_tokens(self, seq_id: SeqId) -> int:
        """Token slots reserved for ``seq_id`` so far."""
        self._table(seq_id)
        return self._num_tokens[seq_id]

    def seq_ids(self) -> list[SeqId]:
        return list(self._tables)

    def num_blocks_needed(
        self, seq_id: SeqId, num_new: int = 1, computed_blocks: Sequence[int] = ()
    ) -> int:
        """Fresh blocks that :meth:`allocate_slots` with these arguments takes (copy included)."""
        if seq_id not in self._tables:
            return cdiv(len(computed_blocks) * self.block_size + num_new, self.block_size) - len(
                computed_blocks)
        table, used = self._tables[seq_id], self._num_tokens[seq_id]
        needed = cdiv(used + num_new, self.block_size) - len(table)
        if num_new > 0 and self._last_block_shared_and_partial(seq_id):
            needed += 1
        return needed

    def can_allocate(
        self, seq_id: SeqId, num_new: int = 1, computed_blocks: Sequence[int] = ()
    ) -> bool:
        return self.pool.can_allocate(self.num_blocks_needed(seq_id, num_new, computed_blocks))

    # ------------------------------------------------------------------ changes
    def allocate_slots(
        self, seq_id: SeqId, num_new: int, computed_blocks: Sequence[int] = ()
    ) -> list[tuple[int, int]]:
        """Reserve slots for ``num_new`` more tokens of ``seq_id``; returns the block copies to do.

        A sequence not seen before gets a table; ``computed_blocks`` are existing *full* blocks
        that already hold its first ``len(computed_blocks) * block_size`` tokens (a shared prompt
        prefix): they are shared by reference count instead of being allocated and recomputed, and
        ``num_new`` counts only the tokens after them.

        A new block is allocated when the last one is full. When the last block is partly filled
        and shared (after :meth:`fork`), this sequence gets its own copy first (copy-on-write),
        because its next token would otherwise overwrite a slot another sequence will write.
        """
        check_positive_int("num_new", num_new)
        if seq_id not in self._tables:
            return self._new_table(seq_id, num_new, computed_blocks)
        if computed_blocks:
            raise ValueError(f"sequence {seq_id!r} already has blocks; computed blocks can only "
                             "start a new table")
        table = self._tables[seq_id]
        self._require(self.num_blocks_needed(seq_id, num_new))
        copies = []
        if self._last_block_shared_and_partial(seq_id):
            src = table[-1]
            table[-1] = self.pool.copy_on_write(src)
            copies.append((src, table[-1]))
        self._num_tokens[seq_id] += num_new
        fresh = cdiv(self._num_tokens[seq_id], self.block_size) - len(table)
        table += self.pool.get_new_blocks(fresh)
        return copies

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """``child_id`` shares every block of ``parent_id`` (parallel sampling, beam search)."""
        table = self._table(parent_id)
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id!r} already has blocks")
        self.pool.touch(table)
        self._tables[child_id] = list(table)
        self._num_tokens[child_id] = self._num_tokens[parent_id]

    def free(self, seq_id: SeqId) -> None:
        """Release ``seq_id``'s blocks (shared ones stay with their other holders)."""
        table = self._table(seq_id)
        self.pool.free_blocks(reversed(table))
        del self._tables[seq_id], self._num_tokens[seq_id]

    # ------------------------------------------------------------------ slots
    def slot(self, seq_id: SeqId, position: int) -> int:
        """Flat cache slot of the token at ``position``: block_id * block_size + offset."""
        used = self.num_tokens(seq_id)
        if not 0 <= position < used:
            raise ValueError(f"position {position} is outside the {used} slots of sequence "
                             f"{seq_id!r}")
        return self.slot_mapping(seq_id, position, position + 1)[0]

    def slot_mapping(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        """Slots of the tokens at positions ``start .. end-1`` (where their K/V are written)."""
        table, used = self._table(seq_id), self._num_tokens[seq_id]
        if not 0 <= start <= end <= used:
            raise ValueError(
                f"positions {start}..{end - 1} are outside the {used} slots of sequence {seq_id!r}"
            )
        rows = np.zeros(end - start, np.int64)
        return slot_mapping(np.asarray([table], np.int64), rows, np.arange(start, end),
                            self.block_size).tolist()

    # ------------------------------------------------------------------ internals
    def _new_table(self, seq_id: SeqId, num_new: int, computed: Sequence[int]) -> list:
        for block in computed:
            if self.pool.ref_count(block) == 0:
                raise ValueError(f"computed block {block} is free, so it holds no prefix")
        self._require(self.num_blocks_needed(seq_id, num_new, computed))
        self.pool.touch(computed)
        fresh = self.num_blocks_needed(seq_id, num_new, computed)
        self._tables[seq_id] = list(computed) + self.pool.get_new_blocks(fresh)
        self._num_tokens[seq_id] = len(computed) * self.block_size + num_new
        return []

    def _table(self, seq_id: SeqId) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def _last_block_shared_and_partial(self, seq_id: SeqId) -> bool:
        table = self._tables[seq_id]
        partial = self._num_tokens[seq_id] % self.block_size != 0
        return bool(table) and partial and self.pool.ref_count(table[-1]) > 1

    def _require(self, num_blocks: int) -> None:
        if not self.pool.can_allocate(num_blocks):
            raise NoFreeBlocksError(
                f"need {num_blocks} KV blocks but only {self.pool.num_free_blocks} of "
                f"{self.pool.num_blocks} are free"
            )


def slot_mapping(
    block_tables: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """Cache slot of each token: in row ``rows[i]`` of ``block_tables``, the block that holds
    position ``positions[i]``, at the offset of that position inside its block."""
    return block_tables[rows, positions // block_size] * block_size + positions % block_size
