"""Where the engine's KV blocks meet Chapter 13's tier and transfer, without the engine knowing.

Both plug into the engine from outside, the way vLLM's KV connectors sit beside its scheduler:
:func:`attach_kv_tier` hangs a :class:`~infer_lab.cache.kv_tier.KVTier` under the engine's
block pool (the pool's eviction hook writes, the KV manager's prefix lookup reads), and
:func:`pin_prompt_blocks` / :func:`inject_blocks` are the two ends of a transfer
(:mod:`infer_lab.engine.kv_transfer`): the sender holds the full blocks of a finished prompt by
their keys, the receiver writes received payloads into blocks of its own pool and names them,
so that its ordinary prefix lookup finds them and computes only what is missing.

Every function here runs on the engine's thread (the pool is not thread-safe).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from infer_lab.cache.block_pool import BlockKey, block_key
from infer_lab.cache.kv_tier import KVByteStore, KVTier, cache_namespace, write_block
from infer_lab.engine.engine import LLMEngine


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


def attach_kv_tier(engine: LLMEngine, root: str | os.PathLike, capacity_bytes: int) -> KVTier:
    """Give ``engine`` a second KV tier: files under ``root``, at most ``capacity_bytes``."""
    if not engine.kv.enable_prefix_caching:
        raise ValueError("a KV tier needs prefix caching (continuous policy, caching on)")
    if engine.executor.is_tensor_parallel:
        raise ValueError("a KV tier is not supported with tensor parallelism (each rank holds "
                         "part of a block)")
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
    compute it anyway (its logits give the first token), so a last full block is never sent."""
    pool, blocks, keys = engine.kv.pool, [], []
    for key in prompt_keys(engine, token_ids[:-1])[:max_blocks]:
        block = pool.get_cached_block(key)
        if block is None:
            break
        blocks.append(block)
        keys.append(key)
    pool.touch(blocks)
    return blocks, keys


def inject_blocks(engine: LLMEngine, token_ids: Sequence[int],
                  received: Sequence[tuple[BlockKey, bytes]]) -> int:
    """Write received ``(key, payload)`` blocks into this engine's pool as cached prefix blocks.

    Only the run of received blocks whose keys equal this prompt's own keys, in order, is
    taken: a block named for other tokens (or another request) stops the run. Blocks already
    cached here are kept as they are. Returns how many of the prompt's leading full blocks are
    cached here afterwards (the receiver computes the rest).
    """
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
