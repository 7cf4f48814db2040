"""The KV cache: its size, the contiguous cache, the block allocator and the paged cache.

Memory and attention backends only: the generation loops that drive them (``generate_cached``,
``generate_paged``) live in :mod:`infer_lab.model.baselines` beside ``generate_naive``. They are
still reachable here, imported on first use, so that ``infer_lab.cache`` imports nothing of the
model but its configuration and the attention mask.
"""

from typing import Any

from infer_lab.cache.batch import PagedBatch, build_paged_batch, flatten_batch, slot_mapping
from infer_lab.cache.block_pool import (
    BlockKey,
    BlockManager,
    BlockPool,
    NoFreeBlocksError,
    block_key,
)
from infer_lab.cache.contiguous import ContiguousAttentionContext, ContiguousKVCache
from infer_lab.cache.paged import PagedAttentionContext, PagedKVCache, paged_attention_ref
from infer_lab.cache.planner import MemoryPlan, plan_memory
from infer_lab.cache.published import PUBLISHED, attention_kind
from infer_lab.cache.sizing import kv_bytes_per_token, kv_cache_bytes, model_kv_cache_bytes
from infer_lab.cache.waste import KVUsage, kv_usage

_BASELINES = ("generate_cached", "generate_paged")


def __getattr__(name: str) -> Any:
    if name in _BASELINES:
        from infer_lab.model import baselines

        return getattr(baselines, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "PUBLISHED",
    "BlockKey",
    "BlockManager",
    "BlockPool",
    "ContiguousAttentionContext",
    "ContiguousKVCache",
    "KVUsage",
    "MemoryPlan",
    "NoFreeBlocksError",
    "PagedAttentionContext",
    "PagedBatch",
    "PagedKVCache",
    "attention_kind",
    "block_key",
    "build_paged_batch",
    "flatten_batch",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "kv_usage",
    "model_kv_cache_bytes",
    "paged_attention_ref",
    "plan_memory",
    "slot_mapping",
    *_BASELINES,
]
