"""How the model hands attention to a backend.

The model computes q, k and v and then asks for attention; *how* it is computed (no cache, a
contiguous cache, a paged cache, a Triton kernel) is the business of the context object passed
in. That is the seam every later chapter upgrades.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F


@runtime_checkable
class AttentionContext(Protocol):
    """What the model needs from a backend when it runs a flattened ragged batch.

    ``attend`` receives this step's new tokens for one layer, ``q`` ``[T, Hq, D]`` and ``k``/``v``
    ``[T, Hkv, D]`` (RoPE already applied), stores k/v wherever the backend keeps its cache and
    returns the attention output ``[T, Hq, D]``. ``logits_indices`` picks the rows whose logits
    are wanted (usually the last token of each sequence); None means all rows.
    """

    logits_indices: torch.Tensor | None

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
    ) -> torch.Tensor: ...


def causal_mask(
    q_len: int, kv_len: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """Boolean ``[q_len, kv_len]`` mask (True = may attend) for queries at the end of the keys."""
    qi = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    kj = torch.arange(kv_len, device=device)[None, :]
    allowed = kj <= qi
    if window is not None:
        allowed &= kj > qi - window
    return allowed


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """Full-sequence causal attention, ``[B, S, H, D]`` in and out, GQA by head groups.

    This is the no-cache path of Chapter 1: every call sees the whole prefix.
    """
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if window is None or window >= k.shape[2]:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        mask = causal_mask(q.shape[2], k.shape[2], window, q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return out.transpose(1, 2)
