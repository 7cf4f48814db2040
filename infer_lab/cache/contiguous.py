"""The contiguous KV cache of Chapter 2: one ``[batch, max_len]`` slab per layer, padded batches.

Keeping each token's keys and values means a decode step computes one new token instead of the
whole prefix again. The simplest place to keep them is a tensor reserved up front for the longest
sequence the batch may reach; every sequence owns a row of ``max_len`` slots whether it uses them
or not. That reservation (and the padding of a static batch) is the waste Chapter 3 measures and
the paged cache removes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infer_lab.model.config import ModelConfig


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
