"""How many bytes the KV cache holds: the number that usually runs a GPU out of memory first."""

from __future__ import annotations

from infer_lab.model.config import ModelConfig


def kv_cache_bytes(
    layers: int, kv_heads: int, head_dim: int, seq_len: int, batch: int, dtype_bytes: int = 2
) -> int:
    """Bytes of keys and values for ``batch`` sequences of ``seq_len`` tokens.

    2 (a key and a value) · layers · KV heads · head_dim · tokens · sequences · bytes per element.
    Llama-3-8B (32 layers, 8 KV heads, head_dim 128) at 8192 tokens, batch 32, fp16: 32.0 GiB.
    """
    sizes = dict(
        layers=layers, kv_heads=kv_heads, head_dim=head_dim, seq_len=seq_len, batch=batch,
        dtype_bytes=dtype_bytes,
    )
    for name, value in sizes.items():
        if int(value) != value or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return 2 * layers * kv_heads * head_dim * seq_len * batch * dtype_bytes


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """Cache bytes that one token of one sequence costs, across all layers."""
    return kv_cache_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 1, 1,
                          dtype_bytes)


def model_kv_cache_bytes(cfg: ModelConfig, seq_len: int, batch: int, dtype_bytes: int = 2) -> int:
    """:func:`kv_cache_bytes` with the shape read from a model config."""
    return kv_cache_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, seq_len,
                          batch, dtype_bytes)
