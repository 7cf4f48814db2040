"""The KV cache: its size, the contiguous cache, the block allocator and the paged cache.

Memory and attention backends only: the generation loops that drive them (``generate_cached``,
``generate_paged``) live in :mod:`infer_lab.model.baselines` beside ``generate_naive``, and are
still reachable here. Every name is imported on first use (:mod:`infer_lab.lazy`), so that
``import infer_lab.cache.block_pool`` loads the allocator and nothing of torch or the model.
"""

from infer_lab.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    ".batch": ("PagedBatch", "build_paged_batch", "flatten_batch"),
    ".block_pool": (
        "BlockKey", "BlockManager", "BlockPool", "NoFreeBlocksError", "block_key", "slot_mapping",
    ),
    ".contiguous": ("ContiguousAttentionContext", "ContiguousKVCache"),
    ".paged": ("PagedAttentionContext", "PagedKVCache", "paged_attention_ref"),
    ".planner": ("MemoryPlan", "plan_memory"),
    ".published": ("PUBLISHED", "attention_kind"),
    ".sizing": ("kv_bytes_per_token", "kv_cache_bytes", "model_kv_cache_bytes"),
    ".waste": ("KVUsage", "kv_usage"),
    "infer_lab.model.baselines": ("generate_cached", "generate_paged"),
})
