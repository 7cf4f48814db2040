"""Counting the work of one forward step: FLOPs, bytes moved, and their ratio.

These are first-order counts — the matmuls, the attention over the cache, and the bytes of weights
and KV cache that must come from memory — which is what decides whether a step is limited by
compute or by memory bandwidth. Element-wise ops and activations are left out: they are small
next to the matmuls for every model in this book.
"""

from __future__ import annotations

from infer_lab.cache.sizing import kv_bytes_per_token
from infer_lab.model.config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that every token multiplies through (all layers' projections, not the embedding)."""
    h = cfg.hidden_size
    per_layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * cfg.intermediate_size
    return cfg.num_hidden_layers * per_layer


def attended_pairs(new_tokens: int, context: int) -> int:
    """(query, key) pairs when ``new_tokens`` queries follow ``context`` cached keys, causally."""
    return new_tokens * context + new_tokens * (new_tokens + 1) // 2


def step_flops(cfg: ModelConfig, batch: int, new_tokens: int, context: int = 0) -> int:
    """FLOPs of one forward step.

    ``batch`` sequences each process ``new_tokens`` new tokens after ``context`` tokens that are
    already cached; logits are computed for the last token of each sequence only. A prefill of n
    tokens is ``(new_tokens=n, context=0)``; a decode step is ``(new_tokens=1, context=n)``.
    """
    tokens = batch * new_tokens
    linear = 2 * matmul_params(cfg) * tokens
    # QK^T and PV: 2 FLOPs per multiply-add, 2 matmuls, every query head, every pair.
    attention = (
        4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
        * batch * attended_pairs(new_tokens, context)
    )
    head = 2 * cfg.hidden_size * cfg.vocab_size * batch
    return linear + attention + head


def step_bytes(
    cfg: ModelConfig,
    batch: int,
    new_tokens: int,
    context: int = 0,
    dtype_bytes: int = 2,
    kv_dtype_bytes: int | None = None,
) -> int:
    """Bytes that one forward step must move to or from memory, at the least.

    Every weight is read once (the batch shares the read), the embedding rows of the new tokens
    are read, the cached K/V of ``context`` tokens is read and the new tokens' K/V written.
    """
    kv_dtype_bytes = kv_dtype_bytes or dtype_bytes
    h = cfg.hidden_size
    norms = (2 * cfg.num_hidden_layers + 1) * h
    weights = (matmul_params(cfg) + norms + cfg.vocab_size * h) * dtype_bytes
    embed_rows = batch * new_tokens * h * dtype_bytes
    per_token = kv_bytes_per_token(cfg, kv_dtype_bytes)
    kv = batch * (context + new_tokens) * per_token
    return weights + embed_rows + kv


def arithmetic_intensity(
    cfg: ModelConfig, batch: int, new_tokens: int, context: int = 0, dtype_bytes: int = 2
) -> float:
    """FLOPs per byte moved: compare with a device's FLOP/s ÷ bytes/s (its ridge point)."""
    return step_flops(cfg, batch, new_tokens, context) / step_bytes(
        cfg, batch, new_tokens, context, dtype_bytes
    )
