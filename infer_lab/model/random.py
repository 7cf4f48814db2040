"""Random-weight models of real shapes, for timing what a real model of that size would do.

The bundled model is small enough to sit in a CPU's caches, which hides the memory-bandwidth
limit that governs decode; a random-weight model with a real model's shapes does not.
"""

from __future__ import annotations

from typing import Any

import torch

from infer_lab.device import default_device, resolve_dtype
from infer_lab.model.config import ModelConfig
from infer_lab.model.transformer import Transformer


def llama_config(**overrides: Any) -> ModelConfig:
    """A Llama-shaped config; defaults give ~170 M parameters (0.7 GB in fp32, 0.34 GB in bf16)."""
    raw = dict(
        model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
        num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
        max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False,
    )
    raw.update(overrides)
    return ModelConfig.from_dict(raw)


@torch.no_grad()
def random_model(
    cfg: ModelConfig,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    seed: int = 0,
    std: float = 0.02,
) -> Transformer:
    """A :class:`Transformer` on ``device`` with normal(0, std) weights and unit norm weights."""
    device = torch.device(device) if device is not None else default_device()
    dtype = resolve_dtype(dtype, device)
    model = Transformer.empty(cfg, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)
    return model.eval().requires_grad_(False)
