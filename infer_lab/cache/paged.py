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
from typing import NamedTuple

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


class _Group(NamedTuple):
    """Sequences of a step with the same query length, attended by one SDPA call.

    ``rows`` are their query rows in the flat batch: None (the whole batch, in order), a slice
    (consecutive sequences) or an int64 index. Query lengths are equal inside a group, so no
    query row is padding; only the keys are padded, to the group's longest block table, and
    masked."""

    rows: slice | torch.Tensor | None
    q_len: int
    tables: torch.Tensor  # [G, W] block ids, padding (-1) clamped to 0 and masked
    flat: torch.Tensor  # tables.reshape(-1): the gather's index
    pos: torch.Tensor  # [G, q_len] the queries' positions
    qrows: torch.Tensor | None  # [G, q_len] the queries' rows, where needed (tree mask rows)
    lens: torch.Tensor  # [G] context lengths after the step


class PagedAttentionContext:
    """The model's attention backend for one :class:`PagedBatch` over a :class:`PagedKVCache`.

    ``backend`` picks the kernels as :mod:`infer_lab.kernels` does (None: the global setting,
    which is Triton on CUDA and torch elsewhere). The torch path computes the same thing as
    :func:`paged_attention_ref`, grouped instead of one sequence at a time: the step's sequences
    are split by query length, and each group is one gather through its block tables and one
    attention call a layer. What depends only on the step (the groups, their positions and masks)
    is built once and shared by every layer.

    Grouping by query length is what keeps the work unpadded: a decode-only step is one group
    (one query each, the padding a view), and a mixed step (a 1,500-token prefill chunk beside
    four decodes) is two calls, the decodes together and the chunk alone, where one padded call
    would compute 1,500 query rows for every decode too. Keys are still padded, to the longest
    block table of a group, and masked; tree batches (Chapter 9) take the same path, with the
    tree's rows looked up per group.
    """

    def __init__(self, cache: PagedKVCache, batch: PagedBatch, *, backend: str | None = None
                 ) -> None:
        if batch.block_size != cache.block_size:
            raise ValueError(f"batch built for block size {batch.block_size}, cache has "
                             f"{cache.block_size}")
        self.cache, self.batch, self.backend = cache, batch, backend
        self.logits_indices = batch.logits_indices
        self._groups: list[_Group] | None = None
        self._masks: dict[tuple[int, int | None], torch.Tensor] = {}
        self._slots: torch.Tensor | None = None  # slot_mapping as int64 (the torch store's)
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

    def _step_groups(self) -> list[_Group]:
        """The step's sequences grouped by query length, built once for every layer.

        A decode-only step is one group read straight from the batch (no host sync). Otherwise
        the query and context lengths come to the host once a step (free for CPU tensors; one sync a
        step for a GPU batch forced onto this path) and each
        distinct query length becomes a group: its sequences' block tables cut to the group's
        own longest, and the rows its queries occupy."""
        if self._groups is not None:
            return self._groups
        b = self.batch
        cu, lens = b.cu_seqlens_q, b.context_lens
        if b.max_query_len == 1:
            tables = b.block_tables.clamp(min=0)  # padding (-1) is masked out
            qrows = torch.arange(b.num_seqs, device=cu.device)[:, None] \
                if b.tree_mask is not None else None
            self._groups = [_Group(None, 1, tables, tables.reshape(-1), (lens - 1)[:, None],
                                   qrows, lens)]
            return self._groups
        cu_host, lens_host = cu.tolist(), lens.tolist()
        by_len: dict[int, list[int]] = {}
        for s in range(b.num_seqs):
            by_len.setdefault(cu_host[s + 1] - cu_host[s], []).append(s)
        groups = []
        for q_len, seqs in by_len.items():
            first, last = seqs[0], seqs[-1]
            consecutive = last - first + 1 == len(seqs)
            pick = slice(first, last + 1) if consecutive else torch.tensor(seqs, device=cu.device)
            offsets = torch.arange(q_len, device=cu.device)
            row_ids = None  # [G, q_len], for an index or a tree's rows
            if not consecutive or b.tree_mask is not None:
                starts = torch.tensor([cu_host[s] for s in seqs], device=cu.device)
                row_ids = starts[:, None] + offsets
            rows: slice | torch.Tensor | None = None  # one group: the batch's rows as they are
            if consecutive and len(seqs) < b.num_seqs:
                rows = slice(cu_host[first], cu_host[last + 1])
            elif not consecutive and row_ids is not None:
                rows = row_ids.reshape(-1)
            width = cdiv(max(lens_host[s] for s in seqs), b.block_size)
            tables = b.block_tables[pick, :width].clamp(min=0)
            group_lens = lens[pick]
            pos = group_lens[:, None] - q_len + offsets
            groups.append(_Group(rows, q_len, tables, tables.reshape(-1), pos, row_ids,
                                 group_lens))
        self._groups = groups
        return groups

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

    def _mask(self, index: int, window: int | None) -> torch.Tensor:
        """Group ``index``'s ``[G, 1, q_len, keys]``: causal by position, within the window,
        never past the end (a tree's region as its mask says)."""
        if (index, window) not in self._masks:
            g = self._step_groups()[index]
            keys = torch.arange(g.tables.shape[1] * self.batch.block_size, device=g.pos.device)
            allowed = keys[None, None, :] <= g.pos[:, :, None]
            if self.batch.tree_mask is not None:
                allowed = self._tree(g, allowed, keys)
            if window is not None:
                allowed &= keys[None, None, :] > g.pos[:, :, None] - window
            self._masks[index, window] = allowed[:, None]
        return self._masks[index, window]

    def _tree(self, g: _Group, allowed: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``allowed`` with each of the group's sequences' last W keys as ``tree_mask`` says."""
        tree = self.batch.tree_mask
        assert tree is not None and g.qrows is not None  # only called for a batch with a tree
        width = tree.shape[1]
        col = keys[None, :] - (g.lens[:, None] - width)  # [G, keys]: column in the region
        inside = (col >= 0) & (keys[None, :] < g.lens[:, None])
        picked = tree[g.qrows].gather(2, col.clamp(0, width - 1)[:, None, :].expand(
            -1, g.q_len, -1))  # [G, q_len, keys]
        return torch.where(inside[:, None, :], picked, allowed)

    def _attend_torch(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                      window: int | None) -> torch.Tensor:
        groups = self._step_groups()
        if len(groups) == 1:  # every sequence the same query length (a decode-only step, say)
            return self._attend_group(0, groups[0], q, kc, vc, window)
        out = torch.empty_like(q)
        for index, g in enumerate(groups):
            o = self._attend_group(index, g, q, kc, vc, window)
            if isinstance(g.rows, slice):
                out[g.rows] = o
            else:
                assert g.rows is not None  # a group over all rows is the only group
                out.index_copy_(0, g.rows, o)
        return out

    def _attend_group(self, index: int, g: _Group, q: torch.Tensor, kc: torch.Tensor,
                      vc: torch.Tensor, window: int | None) -> torch.Tensor:
        """One group's attention, ``[G * q_len, Hq, D]`` in its rows' order."""
        keys = gather_blocks(kc, g.tables, g.flat)  # [G, blocks * block_size, Hkv, D]
        values = gather_blocks(vc, g.tables, g.flat)
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        mine = q if g.rows is None else q[g.rows] if isinstance(g.rows, slice) else \
            q.index_select(0, g.rows)
        # one query per sequence, in order: the padding to [G, Hq, 1, D] is a view
        qb = mine.unsqueeze(2) if g.q_len == 1 else \
            mine.view(-1, g.q_len, *q.shape[1:]).transpose(1, 2)  # [G, Hq, q_len, D]
        o = F.scaled_dot_product_attention(
            qb, keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=self._mask(index, window), enable_gqa=qb.shape[1] != keys.shape[2],
        )
        return o[:, :, 0] if g.q_len == 1 else o.transpose(1, 2).reshape(mine.shape)
