"""Shapes of well-known published models, for sizing the KV cache without downloading anything.

The numbers are those of each model's published ``config.json``; only the shape matters here (no
weights are involved), which is all that Chapter 2's "how much fits" arithmetic needs.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from infer_lab.model.config import ModelConfig

AttentionKind = Literal["MHA", "GQA", "MQA"]


class PublishedModel(NamedTuple):
    config: ModelConfig
    attention: AttentionKind


def attention_kind(cfg: ModelConfig) -> AttentionKind:
    """MHA: one KV head per query head; MQA: a single KV head; GQA: anything in between."""
    if cfg.num_key_value_heads == cfg.num_attention_heads:
        return "MHA"
    return "MQA" if cfg.num_key_value_heads == 1 else "GQA"


LLAMA_2_7B = ModelConfig.from_dict(dict(
    model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
    max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="float16",
))

LLAMA_3_8B = ModelConfig.from_dict(dict(
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
    tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16",
))

MISTRAL_7B_V01 = ModelConfig.from_dict(dict(
    model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
))

QWEN2_5_7B = ModelConfig.from_dict(dict(
    model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
    num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0,
    sliding_window=131072, use_sliding_window=False, max_window_layers=28,
    tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643, torch_dtype="bfloat16",
))

# Falcon-7B is not an architecture this engine loads (parallel attention + MLP, LayerNorm, a plain
# 4h GELU MLP), so it is written as a llama-typed config with Falcon's attention shape: 71 query
# heads of head_dim 64 sharing ONE KV head (MQA), 32 layers, hidden 4544, tied embeddings. The
# intermediate size 12117 makes the gated MLP's 3·h·i (165.18 M) match Falcon's 2·h·4h (165.18 M),
# so the parameter count comes out at Falcon's real 6.92 B (the name says "7B").
FALCON_7B = ModelConfig.from_dict(dict(
    model_type="llama", vocab_size=65024, hidden_size=4544, intermediate_size=12117,
    num_hidden_layers=32, num_attention_heads=71, num_key_value_heads=1, head_dim=64,
    max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
    bos_token_id=11, eos_token_id=11, torch_dtype="bfloat16",
))

LLAMA_3_70B = ModelConfig.from_dict(dict(
    model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
    num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
    tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16",
))

PUBLISHED: dict[str, PublishedModel] = {
    name: PublishedModel(cfg, attention_kind(cfg))
    for name, cfg in {
        "Llama-2-7B": LLAMA_2_7B,
        "Llama-3-8B": LLAMA_3_8B,
        "Mistral-7B-v0.1": MISTRAL_7B_V01,
        "Qwen2.5-7B": QWEN2_5_7B,
        "Falcon-7B": FALCON_7B,
        "Llama-3-70B": LLAMA_3_70B,
    }.items()
}
