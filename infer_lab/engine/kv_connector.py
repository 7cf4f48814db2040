"""Where the engine's KV blocks meet Chapter 13's tier and transfer, without the engine knowing.

Both plug into the engine from outside, the way vLLM's KV connectors sit beside its scheduler:
:func:`attach_kv_tier` hangs a :class:`~infer_lab.cache.kv_tier.KVTier` under the engine's
block pool (the pool's eviction hook writes, the KV manager's prefix lookup reads), and
:func:`hold_finished_blocks` / :func:`inject_blocks` are the two ends of a transfer
(:mod:`infer_lab.engine.kv_transfer`): the sender holds the blocks of a finished prompt (the
full ones and the partial last one), the receiver writes the full blocks' payloads into blocks
of its own pool and names them, so that its ordinary prefix lookup finds them, and keeps the
partial block for that one request (:func:`stage_partial_block`): the KV manager writes it into
the request's first fresh block when the request starts. It computes only what is missing: the
last prompt token, whose logits give the first output token (vLLM's decode worker does the
same).

Every function here runs on the engine's thread (the pool is not thread-safe).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from infer_lab.cache.block_pool import NONE_KEY, BlockKey, block_key
from infer_lab.cache.kv_tier import (
    KVByteStore,
    KVTier,
    block_nbytes,
    cache_namespace,
    write_block,
)
from infer_lab.engine.engine import LLMEngine
from infer_lab.engine.kv_partial import PartialBlock, ReceivedPartialBlocks
from infer_lab.engine.sequence import Sequence as EngineSequence


def engine_namespace(engine: LLMEngine) -> bytes:
    """The digest that K/V of this engine is valid under (see ``cache_namespace``); cached."""
    ns = getattr(engine, "_kv_namespace", None)
    if ns is None:
        ns = cache_namespace(engine.model, engine.config.block_size, engine.config.kv_cache_dtype)
        engine._kv_namespace = ns  # type: ignore[attr-defined]
    return ns


def refuse_eagle(engine: LLMEngine, what: str) -> None:
    """Refuse K/V written from outside for an engine that drafts with EAGLE.

    The EAGLE proposer keeps the target's features per cache slot and fills them only from this
    engine's own forwards; a block written from bytes (a tier restore, a received prefix)
    carries K/V but no features, so the head would draft from stale ones: the output stays
    right (the target verifies), the acceptance silently drops. Refused, not degraded.
    """
    spec = engine.spec
    if spec is not None and spec.cfg.method == "eagle":
        raise ValueError(f"{what} is not supported with EAGLE speculation: blocks written from "
                         "outside carry K/V but not the target features the head drafts from")


def refuse_tensor_parallel(engine: LLMEngine, what: str) -> None:
    """Refuse K/V moved as bytes for an engine with tensor-parallel ranks.

    Each rank holds its own KV heads of every block in its own process; the bytes read or
    written here are rank 0's cache only. A tier or a transfer would carry part of each block
    and leave the other ranks' part stale: wrong K/V, silently. Refused, not degraded.
    """
    if engine.executor.is_tensor_parallel:
        raise ValueError(f"{what} is not supported with tensor parallelism "
                         f"(--tensor-parallel-size {engine.config.tensor_parallel_size}): each "
                         "rank holds its own KV heads of every block, and only rank 0's would "
                         "be moved")


def attach_kv_tier(engine: LLMEngine, root: str | os.PathLike, capacity_bytes: int) -> KVTier:
    """Give ``engine`` a second KV tier: files under ``root``, at most ``capacity_bytes``."""
    if not engine.kv.enable_prefix_caching:
        raise ValueError("a KV tier needs prefix caching (continuous policy, caching on)")
    refuse_tensor_parallel(engine, "a KV tier")
    refuse_eagle(engine, "a KV tier")
    store = KVByteStore(root, capacity_bytes, engine_namespace(engine))
    tier = KVTier(engine.kv.pool, engine.runner.cache, store)
    engine.kv.tier = tier
    return tier


def prompt_keys(engine: LLMEngine, token_ids: Sequence[int]) -> list[BlockKey]:
    """The keys of the full blocks of ``token_ids``, in order."""
    size = engine.config.block_size
    keys: list[BlockKey] = []
    for i in range(len(token_ids) // size):
        keys.append(block_key(keys[-1] if keys else None, token_ids[i * size : (i + 1) * size]))
    return keys


def pin_prompt_blocks(engine: LLMEngine, token_ids: Sequence[int],
                      max_blocks: int | None = None) -> tuple[list[int], list[BlockKey]]:
    """Hold (one more reference) the cached blocks of ``token_ids``'s longest cached prefix of
    full blocks; returns their ids and keys. The caller frees them with
    ``engine.kv.pool.free_blocks``. Blocks evicted since the prompt ran are simply not there:
    the receiver computes those tokens. The last prompt token is left out: the receiver must
    compute it anyway (its logits give the first token), so a last full block is never sent.
    This is for a prompt that already ran; :func:`hold_finished_blocks` also keeps the partial
    last block, which the pool forgets once its request is done."""
    pool, blocks, keys = engine.kv.pool, [], []
    for key in prompt_keys(engine, token_ids[:-1])[:max_blocks]:
        block = pool.get_cached_block(key)
        if block is None:
            break
        blocks.append(block)
        keys.append(key)
    pool.touch(blocks)
    return blocks, keys


def hold_finished_blocks(engine: LLMEngine, seq: EngineSequence, max_blocks: int
                         ) -> tuple[list[int], list[BlockKey], list[int]]:
    """Hold (one more reference) the blocks with the K/V of ``seq``'s prompt but its last token,
    as ``seq`` finishes (engine thread, before the scheduler frees them): the full blocks and
    the partial last one, at most ``max_blocks``. Returns the block ids, the full blocks' keys
    and the tokens of the partial block (empty: none; else it is the last id)."""
    kv, size = engine.kv, engine.config.block_size
    upto = min(seq.num_prompt_tokens - 1, seq.num_computed)  # the tokens the receiver can take
    full = min(upto // size, max_blocks, len(seq.block_table))
    whole = full == upto // size and full < max_blocks and len(seq.block_table) > full
    tail = seq.token_ids[full * size : upto] if whole else []
    blocks = seq.block_table[: full + (1 if tail else 0)]
    kv.pool.touch(blocks)
    return blocks, list(kv.block_keys(seq, full)[:full]), tail


def inject_blocks(engine: LLMEngine, token_ids: Sequence[int],
                  received: Sequence[tuple[BlockKey, bytes]]) -> int:
    """Write received ``(key, payload)`` blocks into this engine's pool as cached prefix blocks.

    Only the run of received blocks whose keys equal this prompt's own keys, in order, is
    taken: a block named for other tokens (or another request) stops the run. Blocks already
    cached here are kept as they are. Returns how many of the prompt's leading full blocks are
    cached here afterwards (the receiver computes the rest).
    """
    refuse_tensor_parallel(engine, "receiving KV blocks")
    refuse_eagle(engine, "receiving KV blocks")
    pool, cache = engine.kv.pool, engine.runner.cache
    if not pool.enable_caching:
        return 0
    mine = prompt_keys(engine, token_ids)
    held: list[int] = []
    try:
        for (key, payload), own in zip(received, mine):
            if key != own:
                break
            block = pool.get_cached_block(key)
            if block is not None:
                pool.touch([block])
            elif pool.num_free_blocks:
                (block,) = pool.get_new_blocks(1)
                try:
                    write_block(cache, block, payload)
                except ValueError:
                    pool.free_blocks([block])
                    break
                pool.cache_block(block, key)
            else:
                break
            held.append(block)
    finally:
        pool.free_blocks(reversed(held))
    return len(held)


def stage_partial_block(engine: LLMEngine, request_id: str, token_ids: Sequence[int],
                        num_full: int, tail: PartialBlock) -> int:
    """Keep a received partial block for ``request_id`` if it continues ``token_ids``'s first
    ``num_full`` full blocks (its parent key is the last of theirs) with the prompt's own tokens
    (compared one by one: a partial block has no key), and leaves the last token to compute.
    Returns the tokens it will cover (0: not taken)."""
    refuse_tensor_parallel(engine, "receiving KV blocks")
    refuse_eagle(engine, "receiving KV blocks")
    kv, size = engine.kv, engine.config.block_size
    if not kv.enable_prefix_caching:
        return 0
    mine = prompt_keys(engine, token_ids[: num_full * size])
    parent = mine[-1] if num_full else NONE_KEY
    begin, n = num_full * size, len(tail.tokens)
    if (len(mine) != num_full or tail.parent != parent or not 0 < n < size
            or begin + n > len(token_ids) - 1 or list(token_ids[begin : begin + n]) != tail.tokens
            or len(tail.payload) != block_nbytes(engine.runner.cache)):
        return 0
    if kv.partial is None:
        kv.partial = ReceivedPartialBlocks(engine.runner.cache, size,
                                           max(64, 2 * engine.config.max_num_seqs))
    kv.partial.stage(request_id, num_full, tail)
    return n
