"""The engine's KV manager: Chapter 3's block pool plus what a serving engine needs on top.

Blocks come from the same :class:`~infer_lab.cache.BlockPool` that Chapter 3's ``BlockManager``
uses (free queue in least-recently-freed order, reference counts, the prefix map, eviction when a
cached block is handed out again). This manager adds three things:

- **Prefix keys.** A *full* block is named by :func:`~infer_lab.cache.block_key`: its tokens and,
  chained through the previous block's key, everything before them. Keys are computed once per
  block and kept on the sequence (``Sequence.block_keys``). :meth:`get_computed_blocks` looks a new
  prompt's keys up in the pool; :meth:`cache_blocks` names the blocks a step has just filled.
- **Block tables on the sequence.** ``Sequence.block_table`` is the table itself, so the scheduler
  and the runner read it without a lookup. Entries are only ever appended: any other change
  (freeing, copy-on-write of the last block) puts a *new* list on the sequence, so whoever keeps a
  copy of a table can tell by identity whether its copy is still a prefix of the real one.
- **A cheap hot path.** A decode step appends one slot to each of hundreds of sequences; here that
  is an integer comparison unless a block boundary is crossed.

Forked sequences (parallel samples) share every block; a sequence about to write into a shared,
partly filled last block first gets its own copy (copy-on-write). The copies are collected in
``pending_copies``; the scheduler takes them (:meth:`take_pending_copies`) into the step's output,
and the executor performs them before the next forward.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from infer_lab.cache.block_pool import BlockKey, BlockPool, block_key
from infer_lab.engine.config import EngineConfig
from infer_lab.engine.sequence import Sequence
from infer_lab.utils import cdiv

if TYPE_CHECKING:
    from infer_lab.cache.kv_tier import KVTier
    from infer_lab.engine.kv_partial import ReceivedPartialBlocks


class KVCacheManager:
    """``config.num_kv_blocks`` blocks of ``config.block_size`` token slots, for sequences.

    Prefix caching is on when the config enables it and the policy is continuous (the static
    baseline reserves whole requests up front and never shares).
    """

    def __init__(self, config: EngineConfig) -> None:
        if config.num_kv_blocks is None:
            raise ValueError("the KV manager needs config.num_kv_blocks (the engine resolves it)")
        self.config = config
        self.block_size = config.block_size  # read on the hot path; the config is frozen
        self.enable_prefix_caching = (config.enable_prefix_caching
                                      and config.policy == "continuous")
        self.pool = BlockPool(config.num_kv_blocks, enable_caching=self.enable_prefix_caching)
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        self.tier: KVTier | None = None  # Chapter 13's second tier (``attach_kv_tier``)
        # Chapter 13's transfer: partial last prompt blocks received from another engine
        # (``stage_partial_block``), and a hook that sees a finished sequence before its blocks
        # go back (a prefill worker holds them for the decode worker: ``KVTransferServer``).
        self.partial: ReceivedPartialBlocks | None = None
        self.on_finished: Callable[[Sequence], None] | None = None

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached_blocks

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The ``(src, dst)`` block copies owed since the last call (and forget them)."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def ref_count(self, block: int) -> int:
        return self.pool.ref_count(block)

    def block_keys(self, seq: Sequence, upto: int) -> list[BlockKey]:
        """Keys of ``seq``'s first ``upto`` full blocks (computed once, kept on the sequence)."""
        keys, block_size, tokens = seq.block_keys, self.block_size, seq.token_ids
        while len(keys) < upto:
            i = len(keys)
            start = i * block_size
            keys.append(block_key(keys[i - 1] if i else None, tokens[start : start + block_size]))
        return keys

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of ``seq``'s tokens.

        At least one token is always left to compute: the forward that follows must produce the
        logits of the last token.
        """
        if not self._may_reuse(seq):
            return []
        upto = (seq.num_tokens - 1) // self.block_size
        blocks = []
        for key in self.block_keys(seq, upto):
            block = self.pool.get_cached_block(key)
            if block is None:
                break
            blocks.append(block)
        if self.tier is not None and len(blocks) < upto:  # the pool's hits end: try the tier
            blocks += self.tier.reload(seq.block_keys[len(blocks) : upto], blocks)
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += len(blocks) * self.block_size
        return blocks

    def get_computed_tokens(self, seq: Sequence) -> tuple[list[int], int]:
        """:meth:`get_computed_blocks`, and how many tokens they hold (vLLM's pair): more than
        theirs when a partial block received from another engine for this request follows them
        (Chapter 13). That block is not among those returned: :meth:`allocate_slots` writes it
        into the fresh block it takes for its tokens."""
        blocks = self.get_computed_blocks(seq)
        num = len(blocks) * self.block_size
        if self.partial is not None and self._may_reuse(seq):
            extra = self.partial.match(seq, len(blocks))
            self.prefix_hits += extra
            num += extra
        return blocks, num

    def _may_reuse(self, seq: Sequence) -> bool:
        # prompt log-probabilities need every prompt position's logits (vLLM recomputes too)
        return self.enable_prefix_caching and seq.request.params.prompt_logprobs is None

    # ------------------------------------------------------------------ changes
    def allocate_slots(
        self, seq: Sequence, num_new: int, computed_blocks: Seq[int] = (), reserve: int = 0,
        num_computed: int | None = None,
    ) -> bool:
        """Make ``seq``'s block table cover its computed tokens plus ``num_new`` more.

        ``computed_blocks`` (only for a sequence holding no blocks) are prefix-cache blocks that
        become the table's first blocks; ``num_computed`` (from :meth:`get_computed_tokens`) is
        the tokens they hold, more than theirs when a received partial block follows them (it is
        written into the first fresh block here). Returns False, changing nothing, when the free
        blocks (less ``reserve``) do not suffice.
        """
        table, block_size, pool = seq.block_table, self.block_size, self.pool
        if computed_blocks or num_computed:
            if table:
                raise ValueError("computed prefix blocks can only start an empty block table")
            computed = (len(computed_blocks) * block_size if num_computed is None
                        else num_computed)
            revive = sum(1 for b in computed_blocks if pool.ref_count(b) == 0)
        else:
            computed, revive = seq.num_computed, 0
        fresh = cdiv(computed + num_new, block_size) - max(len(table), len(computed_blocks))
        cow = seq.shared_tail and computed % block_size != 0 and pool.ref_count(table[-1]) > 1
        if fresh <= 0 and not cow:
            return True  # the hot path of a decode step: room in the last block
        if max(fresh, 0) + cow + revive + reserve > pool.num_free_blocks:
            return False
        if computed_blocks:
            pool.touch(computed_blocks)
            table += computed_blocks
        if cow:
            src, dst = table[-1], pool.copy_on_write(table[-1])
            table = seq.block_table = table[:-1] + [dst]  # a new list: an entry changed
            self.pending_copies.append((src, dst))
        seq.shared_tail = False
        if fresh > 0:
            table += pool.get_new_blocks(fresh)
        if num_computed and num_computed > len(computed_blocks) * block_size:
            assert self.partial is not None  # only a received partial block adds tokens
            self.partial.load(seq, table[len(computed_blocks)])
        return True

    def free_finished(self, seq: Sequence) -> None:
        """:meth:`free` for a sequence that finished normally, shown to ``on_finished`` first."""
        if self.on_finished is not None:
            self.on_finished(seq)
        self.free(seq)

    def free(self, seq: Sequence) -> None:
        """Give back ``seq``'s blocks, last first (so a shared prefix stays cached longest)."""
        if self.partial is not None:
            self.partial.discard(seq.request.request_id)
        self.pool.free_blocks(reversed(seq.block_table))
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.shared_tail = False

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Speculative rollback: keep the blocks ``seq``'s first ``num_tokens`` need, give back
        the rest (lookahead slots of rejected proposals) to the front of the free queue, so the
        table and the free blocks are what they would be had the proposals never been written."""
        keep = cdiv(num_tokens, self.block_size)
        table = seq.block_table
        if len(table) > keep:
            self.pool.return_unwritten(table[keep:])
            seq.block_table = table[:keep]  # a new list: the runner's copy is no longer a prefix

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares all of ``parent``'s blocks (parallel samples of one prompt)."""
        self.pool.touch(parent.block_table)
        child.block_table = list(parent.block_table)
        child.block_keys = list(parent.block_keys)
        child.num_cached_blocks = parent.num_cached_blocks
        parent.shared_tail = child.shared_tail = True

    def cache_blocks(self, seq: Sequence) -> None:
        """Name ``seq``'s newly completed full blocks so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed // self.block_size
        if seq.num_cached_blocks >= full:
            return
        keys = self.block_keys(seq, full)
        for i in range(seq.num_cached_blocks, full):
            self.pool.cache_block(seq.block_table[i], keys[i])
        seq.num_cached_blocks = full
