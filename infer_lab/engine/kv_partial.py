"""A prompt's partial last KV block received from another engine, kept for its one request.

Chapter 13's transfer moves a prompt's K/V from the engine that computed it to another: full
blocks are named by their keys and go into the receiver's pool like any cached prefix, but the
partial last block has no key (a key names a full block) and is nobody's prefix but its
request's, which goes on writing its next tokens into it. It travels as a :class:`PartialBlock`
(its tokens and the key of the block before it) and waits here, by request id, until the KV
manager's prefix lookup (:meth:`~.kv_cache_manager.KVCacheManager.get_computed_tokens`) counts
its tokens and :meth:`~.kv_cache_manager.KVCacheManager.allocate_slots` writes it into the
request's first fresh block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from infer_lab.cache.block_pool import BlockKey
from infer_lab.cache.kv_tier import write_block
from infer_lab.cache.paged import PagedKVCache

if TYPE_CHECKING:
    from infer_lab.engine.sequence import Sequence


@dataclass
class PartialBlock:
    """A prompt's partial last block as it travels: the K/V of ``tokens`` (fewer than a block),
    which follow the full blocks ending with the one keyed ``parent`` (``NONE_KEY``: none)."""

    tokens: list[int]
    parent: BlockKey
    payload: bytes


class ReceivedPartialBlocks:
    """Partial last prompt blocks received for requests not started yet, by request id.

    Not in the pool: a partial block is nobody's prefix but its request's, and the request
    writes its next tokens into it. :meth:`match` (from the KV manager's prefix lookup) says how
    many tokens one covers, only right after the full blocks its parent key names and only if
    its tokens are the request's own; :meth:`load` writes it into the block the KV manager took
    for them. Bounded: past ``capacity`` requests the oldest is dropped (its request computes
    those tokens), and a request that ends (finished, aborted, preempted) drops its own.
    """

    def __init__(self, cache: PagedKVCache, block_size: int, capacity: int = 64) -> None:
        self.cache, self.block_size, self.capacity = cache, block_size, capacity
        self._staged: OrderedDict[str, tuple[int, PartialBlock]] = OrderedDict()
        self.loaded = 0

    def __len__(self) -> int:
        return len(self._staged)

    def stage(self, request_id: str, start: int, tail: PartialBlock) -> None:
        """Keep ``tail`` for ``request_id``: its tokens start block ``start``."""
        self._staged.pop(request_id, None)
        self._staged[request_id] = (start, tail)
        while len(self._staged) > self.capacity:
            self._staged.popitem(last=False)

    def match(self, seq: Sequence, num_full: int) -> int:
        """Tokens the staged block of ``seq``'s request adds after its ``num_full`` full blocks
        (0 if none, or if it does not follow them, or does not hold ``seq``'s own tokens)."""
        staged = self._staged.get(seq.request.request_id)
        if staged is None or seq.num_output_tokens or staged[0] != num_full:
            return 0
        begin = num_full * self.block_size
        tokens = staged[1].tokens
        if begin + len(tokens) > seq.num_tokens - 1 or seq.token_ids[begin : begin + len(tokens)] \
                != tokens:
            return 0
        return len(tokens)

    def load(self, seq: Sequence, block: int) -> None:
        """Write the staged block of ``seq``'s request into ``block`` (and forget it)."""
        _, tail = self._staged.pop(seq.request.request_id)
        write_block(self.cache, block, tail.payload)
        self.loaded += 1

    def discard(self, request_id: str) -> None:
        self._staged.pop(request_id, None)
