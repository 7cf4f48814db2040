"""Tiny random-weight mixture-of-experts checkpoints made with transformers (Chapter 12's tests).

CI sizes: 2 layers, 4 experts, hidden 64. Each family switches on its peculiarities: Mixtral's
renormalised top-2; Qwen2-MoE's shared expert with its sigmoid gate, q/k/v bias, top-k weights
*not* renormalised and a dense first layer (``decoder_sparse_step=2``); Qwen3-MoE's q/k norm,
explicit ``head_dim``, renormalised top-k and a dense last layer (``mlp_only_layers``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.helpers import BASE, save_tokenizer

MOE_FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, decoder_sparse_step=2, norm_topk_prob=False,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        head_dim=32, norm_topk_prob=True, mlp_only_layers=[1],
    ),
}


def make_moe_checkpoint(path: Path, family: str, seed: int = 0, **overrides: Any) -> Any:
    """Save a random-weight transformers MoE model of ``family`` (and a tokenizer) to ``path``.

    As ``tests.helpers.make_checkpoint``: weights redrawn with a large spread so the logits are
    well separated. Router rows are drawn wider still, so that routing is decisive (a near-tie
    between two experts would make the comparison a coin flip, not a test).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {**BASE, **MOE_FAMILIES[family], **overrides}
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)
            else:
                p.normal_(0, 0.3 if p.dim() > 1 else 0.1)
    model.save_pretrained(path)
    save_tokenizer(path)
    return model
