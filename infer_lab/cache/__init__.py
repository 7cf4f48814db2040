"""The KV cache: its size, the contiguous cache, and the paged cache."""

from infer_lab.cache.block_pool import BlockManager, BlockPool, NoFreeBlocksError
from infer_lab.cache.contiguous import (
    ContiguousAttentionContext,
    ContiguousKVCache,
    generate_cached,
)
from infer_lab.cache.paged import (
    PagedAttentionContext,
    PagedBatch,
    PagedKVCache,
    build_paged_batch,
    generate_paged,
    paged_attention_ref,
)
from infer_lab.cache.planner import MemoryPlan, plan_memory
from infer_lab.cache.published import PUBLISHED, attention_kind
from infer_lab.cache.sizing import kv_bytes_per_token, kv_cache_bytes, model_kv_cache_bytes
from infer_lab.cache.waste import KVUsage, kv_usage

__all__ = [
    "PUBLISHED",
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
    "build_paged_batch",
    "generate_cached",
    "generate_paged",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "kv_usage",
    "model_kv_cache_bytes",
    "paged_attention_ref",
    "plan_memory",
]
