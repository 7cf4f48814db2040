"""The paged KV cache of Chapter 3 and its plain-torch attention backend.

The cache is a pool of blocks ``[num_blocks, block_size, kv_heads, head_dim]`` per layer. A step of
the engine is one *flattened ragged batch* (:mod:`infer_lab.cache.batch`): every sequence's new
tokens end to end, no padding, described by a :class:`PagedBatch` — where each new token's K/V
goes (``slot_mapping``), which blocks hold each sequence (``block_tables``), how long each
sequence is after the step (``context_lens``) and where each sequence's query chunk sits in the
flat batch (``cu_seqlens_q``).

A query chunk is always the *last* ``q_len`` tokens of its sequence: it starts at position
``context_len - q_len``, which may be in the middle of the sequence (chunked prefill, a prefix
cache hit), and attends to the cached K/V before it and to itself, causally.

:func:`paged_attention_ref` is the reference every later kernel (Chapter 4) is tested against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from infer_lab import kernels
from infer_lab.cache.batch import PAD_BLOCK, PagedBatch, build_paged_batch, check_blocks
from infer_lab.kernels.dispatch import triton_module
from infer_lab.model.attention import causal_mask
from infer_lab.model.config import ModelConfig
from infer_lab.utils import cdiv

__all__ = ["PAD_BLOCK", "PagedAttentionContext", "PagedBatch", "PagedKVCache",
           "build_paged_batch", "paged_attention_ref"]


class PagedKVCache:
    """K and V blocks for every layer, carved out of one tensor so a block copy is one index op.

    ``k_caches[layer]`` / ``v_caches[layer]`` are ``[num_blocks, block_size, kv_heads, head_dim]``
    views; token slot ``s`` of a layer is ``k_caches[layer].view(-1, kv_heads, head_dim)[s]``.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int = 16,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (cfg.num_hidden_layers, 2, num_blocks, block_size,
                 cfg.num_key_value_heads, cfg.head_dim)
        self.kv = torch.zeros(shape, device=device, dtype=dtype)
        self.kv_cache_dtype = "auto"  # what the KV is stored as (make_paged_kv_cache sets it)
        self.k_caches: list[torch.Tensor] = [self.kv[i, 0] for i in range(cfg.num_hidden_layers)]
        self.v_caches: list[torch.Tensor] = [self.kv[i, 1] for i in range(cfg.num_hidden_layers)]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (the copy-on-write of a fork)."""
        if pairs:
            src, dst = (torch.tensor(x, device=self.kv.device) for x in zip(*pairs, strict=True))
            self.kv[:, :, dst] = self.kv[:, :, src]

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy single token slots ``src -> dst`` in every layer (a draft tree's accepted path
        moved to where its sequence continues)."""
        if src:
            s, d = (torch.tensor(x, device=self.kv.device) for x in (src, dst))
            flat = self.kv.flatten(2, 3)  # [layers, 2, slots, Hkv, D], a view
            flat[:, :, d] = flat[:, :, s]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a flattened ragged batch over a paged cache, in plain torch.

    ``q`` is ``[T, Hq, D]``; ``k_cache``/``v_cache`` are ``[num_blocks, block_size, Hkv, D]`` and
    already hold every key up to ``context_lens[b]``. Sequence b's queries (rows
    ``cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1``) sit at positions ``context_lens[b] - q_len ..
    context_lens[b] - 1``; the query at p sees keys at p - window < j <= p. Returns ``[T, Hq, D]``.

    ``tree_mask`` (bool ``[T, W]``, see :class:`PagedBatch`) replaces the causal rule over each
    sequence's last W keys: a draft tree's node sees its ancestors, not its siblings.
    """
    num_blocks, block_size = k_cache.shape[:2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    cu, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    if len(cu) != len(lens) + 1 or cu[0] != 0 or cu[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens_q {cu} does not describe {q.shape[0]} query rows of "
                         f"{len(lens)} sequences")
    out = torch.empty_like(q)
    for b, ctx_len in enumerate(lens):
        q_len = cu[b + 1] - cu[b]
        if not 0 < q_len <= ctx_len:
            raise ValueError(f"sequence {b}: {q_len} queries but a context of {ctx_len} tokens")
        used = cdiv(ctx_len, block_size)
        if used > block_tables.shape[1]:
            raise ValueError(f"sequence {b}: {ctx_len} tokens need {used} blocks, the table has "
                             f"{block_tables.shape[1]}")
        blocks = block_tables[b, :used]
        check_blocks(blocks.tolist(), num_blocks, b)
        keys = k_cache[blocks].flatten(0, 1)[:ctx_len].to(q.dtype)  # [ctx_len, Hkv, D]
        values = v_cache[blocks].flatten(0, 1)[:ctx_len].to(q.dtype)
        qb = q[cu[b] : cu[b + 1]]
        mask = None
        if q_len > 1 or (window is not None and window < ctx_len) or tree_mask is not None:
            mask = causal_mask(q_len, ctx_len, window, q.device)
        if tree_mask is not None and mask is not None:
            width = tree_mask.shape[1]
            keep = min(width, ctx_len)  # the region's columns that are real keys
            region = tree_mask[cu[b] : cu[b + 1], width - keep :].clone()
            if window is not None:  # the window still applies, by index
                qi = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
                kj = torch.arange(ctx_len - keep, ctx_len, device=q.device)[None, :]
                region &= kj > qi - window
            mask[:, ctx_len - keep :] = region
        o = F.scaled_dot_product_attention(
            qb.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask,
            scale=scale, enable_gqa=qb.shape[1] != keys.shape[1],
        )
        out[cu[b] : cu[b + 1]] = o.transpose(0, 1)
    return out


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor, flat: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """``cache[tables]`` with each row's blocks end to end: ``[B, W * block_size, ...]``.

    ``index_select`` on the block dimension copies whole blocks; advanced indexing computes
    the same copy element by element and took 2-2.6x as long here (a 176- and a 1,000-token
    context, one thread), once per layer for keys and once for values. ``flat`` is
    ``tables.reshape(-1)`` when the caller already has it (every layer of a step gathers the
    same blocks)."""
    picked = cache.index_select(0, tables.reshape(-1) if flat is None else flat)
    return picked.view(tables.shape[0], -1, *cache.shape[2:])


class PagedAttentionContext:
    """The model's attention backend for one :class:`PagedBatch` over a :class:`PagedKVCache`.

    ``backend`` picks the kernels as :mod:`infer_lab.kernels` does (None: the global setting,
    which is Triton on CUDA and torch elsewhere). The torch path computes the same thing as
    :func:`paged_attention_ref` but batched: what depends only on the step (padded query rows,
    positions, the mask) is built once and shared by every layer, and each layer does one gather
    through the block tables and one attention call instead of a Python loop over sequences.
    """

    def __init__(self, cache: PagedKVCache, batch: PagedBatch, *, backend: str | None = None
                 ) -> None:
        if batch.block_size != cache.block_size:
            raise ValueError(f"batch built for block size {batch.block_size}, cache has "
                             f"{cache.block_size}")
        self.cache, self.batch, self.backend = cache, batch, backend
        self.logits_indices = batch.logits_indices
        self._step: tuple[torch.Tensor, ...] | None = None
        self._masks: dict[int | None, torch.Tensor] = {}
        self._slots: torch.Tensor | None = None  # slot_mapping as int64 (the torch store's)
        self._flat_tables: torch.Tensor | None = None  # the gather's block ids, end to end
        # Set to ask the model for its last hidden states (an EAGLE draft's features, Ch. 9).
        self.want_hidden_states = False
        self.hidden_states: torch.Tensor | None = None

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
    ) -> torch.Tensor:
        kc, vc = self.cache.k_caches[layer], self.cache.v_caches[layer]
        b = self.batch
        backend = kernels.resolve_backend(self.backend, q)
        if backend == "torch":
            self._store_torch(layer, k, v)
        else:
            kernels.store_kv(k, v, kc, vc, b.slot_mapping, backend=backend)
        if backend == "triton" and getattr(b, "tree_mask", None) is not None:
            return triton_module("triton_attention").paged_attention_triton(
                q, kc, vc, b.block_tables, b.context_lens, b.cu_seqlens_q, window=window,
                max_query_len=b.max_query_len, tree_mask=b.tree_mask)
        if backend == "triton":
            return kernels.paged_attention_triton(
                q, kc, vc, b.block_tables, b.context_lens, b.cu_seqlens_q, window=window,
                max_query_len=getattr(b, "max_query_len", None))  # a host int: no sync
        return self._attend_torch(q, kc, vc, window)

    def _step_layout(self) -> tuple[torch.Tensor, ...]:
        """Per-step tensors: query rows padded to ``[B, max_q]``, their validity and positions."""
        if self._step is None:
            b = self.batch
            cu, lens = b.cu_seqlens_q, b.context_lens
            q_lens = cu[1:] - cu[:-1]
            i = torch.arange(b.max_query_len, device=cu.device)
            valid = i[None, :] < q_lens[:, None]
            rows = (cu[:-1, None] + i[None, :]).clamp(max=b.num_tokens - 1)
            pos = torch.where(valid, lens[:, None] - q_lens[:, None] + i[None, :], 0)
            tables = b.block_tables.clamp(min=0)  # padding (-1) is masked out below
            keys = torch.arange(tables.shape[1] * b.block_size, device=cu.device)
            self._step = (valid, rows, pos, tables, keys)
        return self._step

    def _store_torch(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """:func:`~infer_lab.kernels.reference.store_kv_ref`'s writes in one op per tensor.

        A one-token step stores two rows per layer, so the indexing's cost is all overhead:
        ``index_copy_`` into a slot-indexed view, with the slots made int64 once per step, is
        one op where the reference's view, cast and ``index_put_`` are several. Caches that
        are not plain tensors (the 8-bit ones, which quantize as they store), or not of the
        new K/V's dtype, take the reference's path.
        """
        kc, vc = self.cache.k_caches[layer], self.cache.v_caches[layer]
        if not (isinstance(kc, torch.Tensor) and kc.dtype == k.dtype == v.dtype):
            kernels.store_kv(k, v, kc, vc, self.batch.slot_mapping, backend="torch")
            return
        if self._slots is None:
            self._slots = self.batch.slot_mapping.long()
        kc.view(-1, *kc.shape[2:]).index_copy_(0, self._slots, k)
        vc.view(-1, *vc.shape[2:]).index_copy_(0, self._slots, v)

    def _mask(self, window: int | None) -> torch.Tensor:
        """``[B, 1, max_q, keys]``: causal by position, within the window, never past the end."""
        if window not in self._masks:
            _, _, pos, _, keys = self._step_layout()
            allowed = keys[None, None, :] <= pos[:, :, None]
            if self.batch.tree_mask is not None:
                allowed = self._tree(allowed, keys)
            if window is not None:
                allowed &= keys[None, None, :] > pos[:, :, None] - window
            self._masks[window] = allowed[:, None]
        return self._masks[window]

    def _tree(self, allowed: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``allowed`` with each sequence's last W keys as ``tree_mask`` says."""
        _, rows, _, _, _ = self._step_layout()
        tree, lens = self.batch.tree_mask, self.batch.context_lens
        assert tree is not None  # only called for a batch with a tree
        width = tree.shape[1]
        col = keys[None, :] - (lens[:, None] - width)  # [B, keys]: column in the region
        inside = (col >= 0) & (keys[None, :] < lens[:, None])
        picked = tree[rows].gather(2, col.clamp(0, width - 1)[:, None, :].expand(
            -1, rows.shape[1], -1))  # [B, max_q, keys]
        return torch.where(inside[:, None, :], picked, allowed)

    def _attend_torch(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                      window: int | None) -> torch.Tensor:
        valid, rows, _, tables, _ = self._step_layout()
        if self._flat_tables is None:
            self._flat_tables = tables.reshape(-1)
        keys = gather_blocks(kc, tables, self._flat_tables)  # [B, blocks * block_size, Hkv, D]
        values = gather_blocks(vc, tables, self._flat_tables)
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        # a decode-only step has one query per sequence, in order: the padding is a view
        one_each = self.batch.max_query_len == 1
        qb = q.unsqueeze(2) if one_each else q[rows].transpose(1, 2)  # [B, Hq, max_q, D]
        out = F.scaled_dot_product_attention(
            qb, keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=self._mask(window), enable_gqa=qb.shape[1] != keys.shape[2],
        )
        return out[:, :, 0] if one_each else out.transpose(1, 2)[valid]
