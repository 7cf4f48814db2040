"""What a mixture of experts does to decode, counted (Chapter 12).

A decode step reads every weight a token in the batch uses. For a dense model that is all of
them at any batch size; for an MoE it is the shared part plus only the experts that the batch's
``B k`` (token, expert) pairs touch. With routing uniform and independent, expert ``e`` escapes
one token with probability ``1 - k/E`` and the whole batch with ``(1 - k/E)^B``, so

    distinct experts per layer = E (1 - (1 - k/E)^B):

``k`` at batch 1, nearly ``E`` by the time ``B`` is a few times ``E/k``. Bytes read grow with that
curve while FLOPs grow with ``B`` times the *active* parameters, so the arithmetic intensity of
a decode step (FLOPs per byte) sits at about the dense model's at batch 1, then falls behind it
by the ratio of total to active expert parameters once every expert is read.

Routing statistics (tokens per expert, the busiest expert's excess, tokens a capacity factor
would drop) come from hooks on the model's routers; nothing here changes the forward.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from infer_lab.model.config import ModelConfig

# The published config.json of MoE models, the fields that set their size (from their model cards
# on the Hugging Face hub). tests/test_moe_models.py checks that they give the published totals.
_PUBLISHED: dict[str, dict[str, Any]] = {
    "Mixtral-8x7B": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2),
    "Mixtral-8x22B": dict(model_type="mixtral", vocab_size=32768, hidden_size=6144,
                          intermediate_size=16384, num_hidden_layers=56, num_attention_heads=48,
                          num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2),
    "Qwen1.5-MoE-A2.7B": dict(model_type="qwen2_moe", vocab_size=151936, hidden_size=2048,
                              intermediate_size=5632, num_hidden_layers=24,
                              num_attention_heads=16, num_key_value_heads=16, num_experts=60,
                              num_experts_per_tok=4, moe_intermediate_size=1408,
                              shared_expert_intermediate_size=5632),
    "Qwen3-30B-A3B": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                          intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    "Qwen3-235B-A22B": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=4096,
                            intermediate_size=12288, num_hidden_layers=94,
                            num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536,
                            norm_topk_prob=True),
}
PUBLISHED_MOE: dict[str, ModelConfig] = {
    name: ModelConfig.from_dict(raw) for name, raw in _PUBLISHED.items()}


def expected_distinct_experts(num_experts: int, top_k: int, batch: int | np.ndarray
                              ) -> float | np.ndarray:
    """Expected number of distinct experts ``batch`` tokens touch in one layer, each token
    choosing ``top_k`` distinct experts uniformly at random."""
    return num_experts * (1 - (1 - top_k / num_experts) ** np.asarray(batch, dtype=float))


def sampled_distinct_experts(topk_ids: torch.Tensor, batch: int, samples: int = 200,
                             seed: int = 0) -> float:
    """Mean distinct experts over ``samples`` random batches of ``batch`` rows of ``topk_ids``
    ``[N, k]`` (the routing of N real tokens): a decode batch of independent sequences."""
    gen = torch.Generator().manual_seed(seed)
    n = topk_ids.shape[0]
    total = 0
    for _ in range(samples):
        rows = torch.randperm(n, generator=gen)[:batch]
        total += int(topk_ids[rows].unique().numel())
    return total / samples


def expert_parameters(cfg: ModelConfig) -> int:
    """Parameters of one routed expert (gate, up and down projections)."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


def decode_weight_bytes(cfg: ModelConfig, distinct_experts: float, dtype_bytes: float = 2
                        ) -> float:
    """Bytes of weights one decode step reads when each MoE layer touches ``distinct_experts``
    experts: everything but the experts, plus those (the embedding table is not read, only a
    row per token; an untied LM head is, whole)."""
    cfg_experts = len(cfg.moe_layers) * cfg.num_experts * expert_parameters(cfg)
    embedding = cfg.vocab_size * cfg.hidden_size
    head = embedding if cfg.tie_word_embeddings else 0  # tied: the table is read as the head
    rest = cfg.num_parameters() - cfg_experts - embedding + head
    read = rest + len(cfg.moe_layers) * distinct_experts * expert_parameters(cfg)
    return read * dtype_bytes


def decode_flops(cfg: ModelConfig, batch: int) -> float:
    """FLOPs of one decode step's matmuls at a short context: 2 per active parameter per
    token (the embedding lookup does no arithmetic; the LM head does)."""
    embedding = cfg.vocab_size * cfg.hidden_size
    head = embedding if cfg.tie_word_embeddings else 0
    return 2.0 * batch * (cfg.num_active_parameters() - embedding + head)


def decode_intensity(cfg: ModelConfig, batch: int, distinct_experts: float | None = None,
                     dtype_bytes: float = 2) -> float:
    """FLOPs per byte of weights in a decode step at ``batch`` (distinct experts: the uniform
    expectation unless given, e.g. measured on real text)."""
    if distinct_experts is None:
        distinct_experts = float(expected_distinct_experts(cfg.num_experts,
                                                           cfg.num_experts_per_tok, batch))
    return decode_flops(cfg, batch) / decode_weight_bytes(cfg, distinct_experts, dtype_bytes)


# ----------------------------------------------------------------------------- routing on real text
@contextmanager
def record_routing(model: nn.Module) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Inside the block, every MoE layer's chosen experts ``[T, k]`` are appended, per layer, to
    the dict this yields (through each block's ``router_hook``)."""
    seen: dict[int, list[torch.Tensor]] = {}
    # the sparse blocks, found by their hook (measure reads models, it does not import them)
    blocks = [m for m in model.modules() if hasattr(m, "router_hook")]

    def hook(layer: int, topk_ids: torch.Tensor, logits: torch.Tensor) -> None:
        seen.setdefault(layer, []).append(topk_ids.detach().cpu())

    for b in blocks:
        b.router_hook = hook
    try:
        yield seen
    finally:
        for b in blocks:
            b.router_hook = None


@torch.inference_mode()
def routing_on(model: nn.Module, sequences: Sequence[Sequence[int]]) -> dict[int, torch.Tensor]:
    """Each MoE layer's choices for every token of ``sequences`` (one forward each, no cache):
    ``{layer: topk_ids [N, k]}``."""
    with record_routing(model) as seen:
        for ids in sequences:
            model(torch.tensor([list(ids)], device=model.device))
    return {layer: torch.cat(ids) for layer, ids in sorted(seen.items())}


def tokens_per_expert(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many (token, expert) pairs each expert received."""
    return torch.bincount(topk_ids.flatten(), minlength=num_experts)


def imbalance(counts: torch.Tensor) -> float:
    """The busiest expert's load over the mean (1 = perfectly even): the factor by which the
    slowest expert (or expert-parallel rank) stretches a step over a balanced one."""
    return float(counts.max() / counts.float().mean())


def expert_capacity(num_tokens: int, num_experts: int, top_k: int,
                    capacity_factor: float) -> int:
    """Training's fixed buffer per expert (GShard, Switch): ``capacity_factor`` times an even
    share of the batch's ``T k`` pairs, rounded up."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def dropped_pairs(counts: torch.Tensor, capacity: int) -> int:
    """(token, expert) pairs past each expert's capacity: training drops them (the token skips
    that expert); an inference engine computes them all."""
    return int((counts - capacity).clamp_min(0).sum())
