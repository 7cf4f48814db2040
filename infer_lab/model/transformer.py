"""The Llama-family transformer, written once for every supported checkpoint.

Llama, Mistral, Qwen2 and Qwen3 differ by a few switches in :class:`ModelConfig` (biases, q/k norms,
sliding windows, RoPE scaling, tied embeddings); the computation is the same. Projections that read
the same input are fused (q/k/v into one matrix, gate/up into another) so each layer does fewer,
larger matmuls; the loader splices the checkpoint's separate tensors into them.
"""

from __future__ import annotations

import torch
from torch import nn

from infer_lab.kernels import apply_rope, rms_norm, silu_and_mul
from infer_lab.kernels.linear import linear
from infer_lab.model.attention import AttentionContext, causal_attention
from infer_lab.model.config import ModelConfig
from infer_lab.model.linear import Linear
from infer_lab.model.moe import SparseMoeBlock
from infer_lab.model.rope import rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.window = cfg.window(layer)
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.qkv_split = [cfg.q_size, cfg.kv_size, cfg.kv_size]
        self.qkv_proj = Linear(cfg.hidden_size, sum(self.qkv_split), bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        ctx: AttentionContext | None,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_split, dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, k, positions, inv_freq)
        if ctx is None:
            out = causal_attention(q, k, v, self.window)
        else:
            out = ctx.attend(self.layer, q, k, v, self.window)
        return self.o_proj(out.flatten(-2))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(
            cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias
        )
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Chapter 12: a router and experts in a mixture-of-experts model's sparse layers.
        self.mlp = SparseMoeBlock(cfg, layer) if cfg.is_moe_layer(layer) else MLP(cfg)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        ctx: AttentionContext | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is fused into the norm: (norm(h + r), h + r) in one pass.
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, positions, inv_freq, ctx)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Transformer(nn.Module):
    """A decoder-only Llama-family language model.

    ``model(input_ids)`` with ``ctx=None`` is the plain full-sequence forward: ``[B, S]`` token ids
    in, ``[B, S, vocab]`` logits out, no cache. With a ``ctx``, ``input_ids`` and ``positions`` are
    one flattened ragged batch ``[T]`` and the context's backend does attention.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False)
        )
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)
        self.reset_rope()

    @classmethod
    def empty(cls, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> Transformer:
        """Allocate on ``device`` without initialising: the weights are about to be overwritten.

        Building on the meta device first skips the random init a 70 B model would take minutes
        over, and never holds the weights twice.
        """
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to(dtype).to_empty(device=device)
        model.reset_rope()
        return model

    def reset_rope(self) -> None:
        """(Re)compute the RoPE frequencies; needed after the module is materialised from meta."""
        cfg = self.config
        inv = rope_inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
        self.inv_freq = inv.to(self.inv_freq.device)

    # The final norm, never quantized, tells the model's device and compute dtype (Chapter 8
    # replaces the embedding by a quantized table).
    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        ctx: AttentionContext | None = None,
        *,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits for ``input_ids``; ``last_only`` keeps only the last position (plain path)."""
        if ctx is None:
            if input_ids.dim() == 1:
                input_ids = input_ids[None]
            seq = input_ids.shape[-1]
            if seq > self.config.max_position_embeddings:
                raise ValueError(
                    f"sequence of {seq} tokens is longer than the model's context of "
                    f"{self.config.max_position_embeddings} tokens"
                )
            if positions is None:
                positions = torch.arange(seq, device=input_ids.device).expand_as(input_ids)
        elif positions is None:
            raise ValueError("a flattened batch (ctx given) needs explicit positions")
        h = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, positions, self.inv_freq, ctx)
        if getattr(ctx, "want_hidden_states", False):  # an EAGLE draft reads them (Ch. 9)
            ctx.hidden_states = self.norm(h, residual)[0]  # every row: what the LM head reads
        if ctx is not None and ctx.logits_indices is not None:
            h, residual = h[ctx.logits_indices], residual[ctx.logits_indices]
        elif last_only:
            h, residual = h[..., -1:, :], residual[..., -1:, :]
        h, _ = self.norm(h, residual)
        return self.compute_logits(h)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return linear(h, self.embed_tokens.weight)
        return self.lm_head(h)  # nn.Linear, or a quantized head (Chapter 8)
