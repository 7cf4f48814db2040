"""Megatron-style tensor parallelism: one model's weights split across ``tp`` processes.

Each rank keeps a slice of every large matrix and the ranks meet twice per layer:

- **column-parallel** ``qkv_proj`` and ``gate_up_proj``: rank ``r`` holds the rows that produce its
  attention heads (and its share of the MLP's hidden units), so each rank attends with its own
  heads and keeps only *their* K/V in its cache;
- **row-parallel** ``o_proj`` and ``down_proj``: rank ``r`` holds the matching input columns, so
  each produces a partial sum of the full output and one ``all_reduce`` adds them up;
- **vocabulary-parallel** embedding and LM head: rank ``r`` holds a range of token rows; a lookup
  is an all-reduce of the rows each rank has, the logits an all-gather of each rank's range.

When there are fewer KV heads than ranks (``tp`` a multiple of ``num_key_value_heads``), each KV
head is replicated on the ``tp / kv_heads`` ranks whose query heads use it.

The collectives are ``torch.distributed``'s (gloo on CPU, NCCL on GPU); this module only decides
which slice each rank keeps and where the sums happen. :func:`shard_model` turns a full model into
rank ``r``'s part in place.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from infer_lab.model.config import ModelConfig
from infer_lab.model.expert_parallel import parallel_size_problem, shard_moe_block_tp
from infer_lab.model.moe import SparseMoeBlock
from infer_lab.model.transformer import Attention, Transformer
from infer_lab.utils import cdiv


class TensorParallelError(ValueError):
    """A tensor-parallel size that the model's shapes do not allow."""


def tp_size_problem(cfg: ModelConfig, tp: int) -> str | None:
    """Why ``tp`` ranks cannot split ``cfg`` (None if they can)."""
    if tp < 1:
        return "the size must be at least 1"
    heads, kv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    if heads % tp:
        return f"{heads} query heads do not divide into {tp}"
    if kv % tp and tp % kv:
        return f"{kv} KV heads neither divide into {tp} nor into a whole number of copies"
    if inter % tp:
        return f"the MLP's {inter} hidden units do not divide into {tp}"
    if cfg.moe_layers:  # Chapter 12: every expert is split by its hidden units too
        return parallel_size_problem(cfg, tp, "tp")
    return None


def valid_tp_sizes(cfg: ModelConfig, most: int = 16) -> list[int]:
    return [t for t in range(1, most + 1) if tp_size_problem(cfg, t) is None]


def check_tp_size(cfg: ModelConfig, tp: int) -> None:
    """Raise a :class:`TensorParallelError` naming the sizes that work."""
    problem = tp_size_problem(cfg, tp)
    if problem is not None:
        raise TensorParallelError(
            f"tensor_parallel_size={tp} does not fit this model ({problem}); sizes that work: "
            f"{valid_tp_sizes(cfg)}")


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """What one rank's layers look like: its query heads, its KV heads, its MLP slice."""
    check_tp_size(cfg, tp)
    return dataclasses.replace(
        cfg, num_attention_heads=cfg.num_attention_heads // tp,
        num_key_value_heads=max(1, cfg.num_key_value_heads // tp),
        intermediate_size=cfg.intermediate_size // tp)


def kv_heads_of_rank(cfg: ModelConfig, rank: int, tp: int) -> range:
    """The global KV heads that rank ``rank`` keeps (one replicated head when kv < tp)."""
    kv = cfg.num_key_value_heads
    if kv >= tp:
        n = kv // tp
        return range(rank * n, (rank + 1) * n)
    first = rank * kv // tp
    return range(first, first + 1)


def vocab_range(vocab_size: int, rank: int, tp: int) -> tuple[int, int]:
    """Rank ``rank``'s token rows ``[start, end)``; the last range may be shorter."""
    per = cdiv(vocab_size, tp)
    return min(rank * per, vocab_size), min((rank + 1) * per, vocab_size)


class RowParallelLinear(nn.Module):
    """``x @ W[:, cols].T`` on each rank, then one all-reduce; the bias is added once, after."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, end)`` of the embedding; ids outside the range contribute zeros."""

    def __init__(self, weight: torch.Tensor, start: int, end: int, vocab_size: int,
                 group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.end, self.num_embeddings = start, end, vocab_size
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        dist.all_reduce(out, group=self.group)
        return out


class TensorParallelTransformer(Transformer):
    """A :class:`Transformer` whose LM head is vocabulary-parallel: logits are all-gathered."""

    tp_rank: int
    tp_size: int
    tp_group: dist.ProcessGroup | None
    full_config: ModelConfig

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        part = F.linear(h, weight)
        per = cdiv(self.full_config.vocab_size, self.tp_size)
        if part.shape[-1] < per:  # the short last range: pad so every rank sends one shape
            part = F.pad(part, (0, per - part.shape[-1]))
        parts = [torch.empty_like(part) for _ in range(self.tp_size)]
        dist.all_gather(parts, part.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)[..., : self.full_config.vocab_size]


@torch.no_grad()
def shard_model(model: Transformer, rank: int, tp: int,
                group: dist.ProcessGroup | None = None) -> TensorParallelTransformer:
    """Turn the full ``model`` into rank ``rank``'s part, in place (its class changes too).

    Needs an initialised ``torch.distributed`` process group of size ``tp`` for the forward.
    """
    full = model.config
    check_tp_size(full, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, {tp}), got {rank}")
    local = local_config(full, tp)
    for layer in model.layers:
        _shard_attention(layer.self_attn, full, rank, tp, group)
        if isinstance(layer.mlp, SparseMoeBlock):  # Chapter 12: experts split like an MLP
            shard_moe_block_tp(layer.mlp, rank, tp, group)
            continue
        mlp, inter = layer.mlp, full.intermediate_size
        n = inter // tp
        rows = torch.cat([torch.arange(rank * n, (rank + 1) * n),
                          torch.arange(inter + rank * n, inter + (rank + 1) * n)])
        mlp.gate_up_proj = _column_slice(mlp.gate_up_proj, rows)
        down = mlp.down_proj
        mlp.down_proj = RowParallelLinear(down.weight[:, rank * n:(rank + 1) * n].contiguous(),
                                          down.bias, group)
    start, end = vocab_range(full.vocab_size, rank, tp)
    model.embed_tokens = VocabParallelEmbedding(
        model.embed_tokens.weight[start:end].contiguous(), start, end, full.vocab_size, group)
    if model.lm_head is not None:
        head = nn.Linear(full.hidden_size, end - start, bias=False, device=model.device,
                         dtype=model.dtype)
        head.weight.copy_(model.lm_head.weight[start:end])
        model.lm_head = head
    model.__class__ = TensorParallelTransformer
    model.config, model.full_config = local, full
    model.tp_rank, model.tp_size, model.tp_group = rank, tp, group
    return model  # type: ignore[return-value]


def _shard_attention(attn: Attention, full: ModelConfig, rank: int, tp: int,
                     group: dist.ProcessGroup | None) -> None:
    d, hq = full.head_dim, full.num_attention_heads // tp
    q_rows = torch.arange(rank * hq * d, (rank + 1) * hq * d)
    kv_heads = kv_heads_of_rank(full, rank, tp)
    kv_rows = torch.arange(kv_heads.start * d, kv_heads.stop * d)
    rows = torch.cat([q_rows, full.q_size + kv_rows, full.q_size + full.kv_size + kv_rows])
    attn.qkv_proj = _column_slice(attn.qkv_proj, rows)
    attn.num_heads, attn.num_kv_heads = hq, len(kv_heads)
    attn.qkv_split = [hq * d, len(kv_heads) * d, len(kv_heads) * d]
    o = attn.o_proj
    attn.o_proj = RowParallelLinear(o.weight[:, q_rows].contiguous(), o.bias, group)


def _column_slice(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    rows = rows.to(linear.weight.device)
    out = nn.Linear(linear.in_features, len(rows), bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype)
    out.weight.copy_(linear.weight[rows])
    if linear.bias is not None:
        out.bias.copy_(linear.bias[rows])
    return out
