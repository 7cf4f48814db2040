"""The contiguous KV cache of Chapter 2: one ``[batch, max_len]`` slab per layer, padded batches.

Keeping each token's keys and values means a decode step computes one new token instead of the
whole prefix again. The simplest place to keep them is a tensor reserved up front for the longest
sequence the batch may reach; every sequence owns a row of ``max_len`` slots whether it uses them
or not. That reservation (and the padding of a static batch) is the waste Chapter 3 measures and
the paged cache removes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from infer_lab.model.config import ModelConfig
from infer_lab.model.generate import GenerationOutput, prepare_batch
from infer_lab.model.tokenizer import Tokenizer
from infer_lab.model.transformer import Transformer


class ContiguousKVCache:
    """Per-layer K and V tensors ``[batch, max_len, kv_heads, head_dim]``, allocated once."""

    def __init__(
        self,
        cfg: ModelConfig,
        batch: int,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if batch <= 0 or max_len <= 0:
            raise ValueError(f"batch and max_len must be positive, got {batch} and {max_len}")
        self.batch, self.max_len = batch, max_len
        shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        layers = range(cfg.num_hidden_layers)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in layers]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in layers]

    @property
    def nbytes(self) -> int:
        """Bytes reserved, used or not."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class ContiguousAttentionContext:
    """One step of a padded batch: ``B`` rows of ``q_len`` tokens, row ``b`` starting at
    ``start_pos[b]`` (the tokens it already has in the cache).

    The model sees the padded ``[B, q_len]`` batch flattened to ``[B * q_len]``; ``attend``
    reshapes it back, writes the new K/V at each row's own positions, and lets each query see its
    own row's keys up to its position (and inside the sliding window).
    """

    def __init__(
        self,
        cache: ContiguousKVCache,
        start_pos: torch.Tensor,
        q_len: int,
        logits_indices: torch.Tensor | None = None,
    ) -> None:
        self.cache, self.q_len = cache, q_len
        device = cache.k[0].device
        self.positions = start_pos.to(device)[:, None] + torch.arange(q_len, device=device)
        self.kv_len = int(self.positions.max()) + 1
        if self.kv_len > cache.max_len:
            raise ValueError(f"the step reaches position {self.kv_len - 1}, past the cache's "
                             f"{cache.max_len} slots")
        self.rows = torch.arange(len(start_pos), device=device)[:, None].expand_as(self.positions)
        self.logits_indices = logits_indices
        self._masks: dict[int | None, torch.Tensor] = {}

    def mask(self, window: int | None) -> torch.Tensor:
        """``[B, 1, q_len, kv_len]``: key j is visible to the query at p iff p - window < j <= p."""
        if window not in self._masks:
            p = self.positions[:, None, :, None]
            j = torch.arange(self.kv_len, device=p.device)
            allowed = j <= p
            if window is not None:
                allowed &= j > p - window
            self._masks[window] = allowed
        return self._masks[window]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
    ) -> torch.Tensor:
        batch = self.positions.shape[0]
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc[self.rows, self.positions] = k.unflatten(0, (batch, self.q_len)).to(kc.dtype)
        vc[self.rows, self.positions] = v.unflatten(0, (batch, self.q_len)).to(vc.dtype)
        qb = q.unflatten(0, (batch, self.q_len)).transpose(1, 2)
        keys = kc[:, : self.kv_len].transpose(1, 2).to(q.dtype)
        values = vc[:, : self.kv_len].transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(
            qb, keys, values, attn_mask=self.mask(window),
            enable_gqa=qb.shape[1] != keys.shape[1],
        )
        return out.transpose(1, 2).flatten(0, 1)


@torch.inference_mode()
def generate_cached(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: Sequence[str | Sequence[int]],
    max_tokens: int = 32,
    ignore_eos: bool = False,
) -> list[GenerationOutput]:
    """Greedy continuations of a static batch with a contiguous KV cache.

    Prompts are right-padded to the longest; one prefill step fills the cache, then every decode
    step runs all ``B`` rows, one token each, at each row's own length. Rows that have finished
    keep being computed (their output is ignored) until the last one finishes: that is the
    static-batching cost Chapter 5 removes.
    """
    cfg = model.config
    ids, budgets, stops = prepare_batch(model, tokenizer, prompts, max_tokens, ignore_eos)
    batch, lens = len(ids), [len(p) for p in ids]
    cache = ContiguousKVCache(cfg, batch, max(lens) + max_tokens, model.device, model.dtype)
    device = model.device

    # Prefill: the padded [B, S] prompt block, logits at each row's last real token.
    width = max(lens)
    padded = torch.zeros(batch, width, dtype=torch.long, device=device)
    for b, p in enumerate(ids):
        padded[b, : len(p)] = torch.tensor(p, device=device)
    last = torch.tensor([b * width + n - 1 for b, n in enumerate(lens)], device=device)
    ctx = ContiguousAttentionContext(cache, torch.zeros(batch, dtype=torch.long), width, last)
    logits = model(padded.flatten(), ctx.positions.flatten(), ctx)

    outs: list[list[int]] = [[] for _ in ids]
    done = [False] * batch
    while True:
        tokens = logits.argmax(-1).tolist()
        for b, t in enumerate(tokens):
            if done[b]:
                continue
            outs[b].append(t)
            done[b] = t in stops or len(outs[b]) >= budgets[b]
            if not done[b]:
                lens[b] += 1  # the new token will be written at position lens[b] - 1
        if all(done):
            break
        # Decode: row b feeds its last token at position lens[b] - 1; finished rows recompute
        # a dummy token in place (they no longer advance).
        feed = torch.tensor([o[-1] for o in outs], device=device)
        start = torch.tensor([n - 1 for n in lens])
        ctx = ContiguousAttentionContext(cache, start, 1)
        logits = model(feed, ctx.positions.flatten(), ctx)

    return [
        GenerationOutput(
            tokenizer.decode(o), o, p, "stop" if o and o[-1] in stops else "length"
        )
        for o, p in zip(outs, ids, strict=True)
    ]
