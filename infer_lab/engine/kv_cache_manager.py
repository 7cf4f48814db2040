"""KV blocks for the engine: a free list, reference counts, and the prefix cache.

Chapter 3's :class:`~infer_lab.cache.BlockManager` keeps block tables in its own dictionaries and
forgets a block the moment it is freed. The engine needs two things more, so it keeps its own
small manager (same ideas, same names where they carry over):

- **Prefix caching.** A *full* block is named by its tokens and by everything before it (the key
  of block i is ``(hash of key i-1, tokens of block i)``). When the last user of a named block
  lets go, the block goes to the back of the free list but keeps its name and contents; a later
  request whose prompt starts with the same tokens takes it back instead of recomputing it. A free
  block loses its name only when it is handed out for something else (least recently freed
  first). The free list is an ordered dict, so taking a cached block back out of it is O(1).
- **A cheap hot path.** A decode step appends one slot to each of hundreds of sequences; here that
  is an integer comparison unless a block boundary is crossed. Block tables live on the
  :class:`~infer_lab.engine.sequence.Sequence` itself.

Forked sequences (parallel samples) share every block; a sequence about to write into a shared,
partly filled last block first gets its own copy (copy-on-write). The copies are collected in
``pending_copies`` for the runner to perform before the next forward.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq

from infer_lab.cache.block_pool import cdiv
from infer_lab.engine.sequence import Sequence

BlockKey = tuple[int, tuple[int, ...]]


class KVCacheManager:
    """``num_blocks`` blocks of ``block_size`` token slots, handed out to sequences."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, "
                             f"{block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref = [0] * num_blocks
        self._key: list[BlockKey | None] = [None] * num_blocks
        self._cached: dict[BlockKey, int] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def block_keys(self, seq: Sequence, upto: int) -> list[BlockKey]:
        """Keys of ``seq``'s first ``upto`` full blocks (computed once, kept on the sequence)."""
        keys, bs, tokens = seq.block_hashes, self.block_size, seq.token_ids
        while len(keys) < upto:
            i = len(keys)
            parent = hash(keys[i - 1]) if i else 0
            keys.append((parent, tuple(tokens[i * bs : (i + 1) * bs])))
        return keys

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of ``seq``'s tokens.

        At least one token is always left to compute: the forward that follows must produce the
        logits of the last token.
        """
        if not self.enable_prefix_caching:
            return []
        upto = (seq.num_tokens - 1) // self.block_size
        blocks = []
        for key in self.block_keys(seq, upto):
            block = self._cached.get(key)
            if block is None:
                break
            blocks.append(block)
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += len(blocks) * self.block_size
        return blocks

    # ------------------------------------------------------------------ changes
    def allocate_slots(
        self, seq: Sequence, num_new: int, cached: Seq[int] = (), reserve: int = 0
    ) -> bool:
        """Make ``seq``'s block table cover its computed tokens plus ``num_new`` more.

        ``cached`` (only for a sequence holding no blocks) are prefix-cache blocks that become
        the table's first blocks. Returns False, changing nothing, when the free blocks (less
        ``reserve``) do not suffice.
        """
        table, bs = seq.block_table, self.block_size
        if cached:
            if table:
                raise ValueError("cached prefix blocks can only start an empty block table")
            computed = len(cached) * bs
            revive = sum(1 for b in cached if self._ref[b] == 0)
        else:
            computed, revive = seq.num_computed, 0
        fresh = cdiv(computed + num_new, bs) - max(len(table), len(cached))
        cow = seq.shared_tail and computed % bs != 0 and self._ref[table[-1]] > 1
        if fresh <= 0 and not cow:
            return True  # the hot path of a decode step: room in the last block
        if max(fresh, 0) + cow + revive + reserve > len(self._free):
            return False
        for block in cached:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1
            table.append(block)
        if cow:
            src = table[-1]
            dst = self._take_free()
            self._ref[src] -= 1
            table[-1] = dst
            self.pending_copies.append((src, dst))
            seq.synced_blocks = min(seq.synced_blocks, len(table) - 1)
        seq.shared_tail = False
        for _ in range(fresh):
            table.append(self._take_free())
        return True

    def free(self, seq: Sequence) -> None:
        """Give back ``seq``'s blocks, last first (so a shared prefix stays cached longest)."""
        for block in reversed(seq.block_table):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.synced_blocks = 0
        seq.shared_tail = False

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares all of ``parent``'s blocks (parallel samples of one prompt)."""
        for block in parent.block_table:
            self._ref[block] += 1
        child.block_table = list(parent.block_table)
        child.num_computed = parent.num_computed
        child.block_hashes = list(parent.block_hashes)
        child.num_hashed_blocks = parent.num_hashed_blocks
        parent.shared_tail = child.shared_tail = True

    def commit(self, seq: Sequence) -> None:
        """Name ``seq``'s newly completed full blocks so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed // self.block_size
        if seq.num_hashed_blocks >= full:
            return
        keys = self.block_keys(seq, full)
        for i in range(seq.num_hashed_blocks, full):
            block = seq.block_table[i]
            if self._key[block] is None and keys[i] not in self._cached:
                self._cached[keys[i]] = block
                self._key[block] = keys[i]
        seq.num_hashed_blocks = full

    def reset_prefix_cache(self) -> None:
        """Forget every name (the blocks' contents are no longer trusted, e.g. new weights)."""
        for key, block in self._cached.items():
            if self._key[block] == key:
                self._key[block] = None
        self._cached.clear()

    def _take_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        key = self._key[block]
        if key is not None:  # evict: its contents are about to be overwritten
            del self._cached[key]
            self._key[block] = None
        self._ref[block] = 1
        return block
