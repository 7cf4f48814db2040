"""The flattened ragged batch: one step's new tokens of every sequence, end to end, no padding.

:class:`PagedBatch` is what a model forward over the paged cache reads, and :func:`flatten_batch`
is the one place that builds it: Chapter 3's :func:`build_paged_batch` (lists in, for teaching and
tests) and the engine's model runner (a persistent block-table array, on the hot path) both call
it. The slot formula, ``table[p // block_size] * block_size + p % block_size``, is written once,
in :func:`~infer_lab.cache.block_pool.slot_mapping`.

Everything here is computed on the host with a handful of numpy vector operations, once per step:
the attention backends never need to ask the device for a maximum (``max_query_len``,
``max_context_len`` are plain ints), and every index tensor is a contiguous int32 tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from infer_lab.cache.block_pool import slot_mapping
from infer_lab.utils import cdiv

PAD_BLOCK = -1  # block-table padding in build_paged_batch; never read (context_lens bounds it)


@dataclass
class PagedBatch:
    """One step's flattened ragged batch: ``T`` new tokens from ``B`` sequences.

    - ``input_ids``, ``positions``: ``[T]`` int64; the token and its position in its sequence.
    - ``slot_mapping``: ``[T]`` int32, the cache slot (block_id * block_size + offset) its K/V
      is written to.
    - ``block_tables``: ``[B, max_blocks]`` int32, each sequence's blocks; entries past its
      ``cdiv(context_lens[b], block_size)`` blocks are padding and never read.
    - ``context_lens``: ``[B]`` int32, tokens of each sequence after this step (cached + new).
    - ``cu_seqlens_q``: ``[B + 1]`` int32, sequence b's queries are rows ``cu[b] .. cu[b+1]-1``.
    - ``logits_indices``: int64, the rows whose logits are computed (the last of each chunk
      that completes its sequence's known tokens).
    - ``max_query_len``, ``max_context_len``: host ints, the longest chunk and context.
    - ``tree_mask``: None (every chunk causal), or bool ``[T, W]`` for tree speculation
      (Chapter 9): query row t sees the key at index j of its sequence's last W keys iff
      ``tree_mask[t, j - (context_len - W)]``; earlier keys stay causal. Rows that are not a
      tree's hold the causal rule, so one mask serves a mixed batch.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    logits_indices: torch.Tensor
    block_size: int
    max_query_len: int
    max_context_len: int
    tree_mask: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def flatten_batch(
    input_ids: Sequence[int],
    starts: np.ndarray,
    lens: np.ndarray,
    block_tables: np.ndarray,
    rows: np.ndarray,
    block_size: int,
    device: torch.device | str = "cpu",
    wants_logits: np.ndarray | None = None,
) -> PagedBatch:
    """The :class:`PagedBatch` of ``B`` chunks; chunk b is ``lens[b]`` tokens starting at
    position ``starts[b]`` of the sequence whose blocks are row ``rows[b]`` of ``block_tables``.

    ``input_ids`` are the chunks' tokens end to end; ``wants_logits`` (default: all) says which
    chunks get a logits row. Arrays are int64 numpy; nothing is checked here (the callers own
    the checks, and the runner's hot path cannot afford them twice).
    """
    num_seqs = len(lens)
    cu = np.zeros(num_seqs + 1, np.int64)
    np.cumsum(lens, out=cu[1:])
    num_tokens = int(cu[-1])
    ctx_lens = starts + lens
    if num_tokens == num_seqs:  # every chunk is one token: a decode step
        positions, token_rows = starts, rows
    else:
        positions = np.arange(num_tokens) - np.repeat(cu[:-1] - starts, lens)
        token_rows = np.repeat(rows, lens)
    slots = slot_mapping(block_tables, token_rows, positions, block_size)
    max_context_len = int(ctx_lens.max())
    width = cdiv(max_context_len, block_size)
    tables = block_tables[rows, :width]
    last = cu[1:] - 1
    logits_idx = last if wants_logits is None else last[wants_logits]
    # Two host buffers (int32 indices; int64 ids, positions and logits rows), so a step is two
    # tensors (two copies to the device) instead of seven; each field is a contiguous view.
    o1, o2, o3 = num_tokens, num_tokens + num_seqs, num_tokens + 2 * num_seqs + 1
    buf32 = np.empty(o3 + tables.size, np.int32)
    buf32[:o1] = slots
    buf32[o1:o2] = ctx_lens
    buf32[o2:o3] = cu
    buf32[o3:].reshape(tables.shape)[...] = tables
    buf64 = np.empty(2 * num_tokens + len(logits_idx), np.int64)
    buf64[:num_tokens] = input_ids
    buf64[num_tokens : 2 * num_tokens] = positions
    buf64[2 * num_tokens :] = logits_idx
    t32 = torch.from_numpy(buf32).to(device)
    t64 = torch.from_numpy(buf64).to(device)
    return PagedBatch(
        input_ids=t64[:num_tokens], positions=t64[num_tokens : 2 * num_tokens],
        slot_mapping=t32[:o1], block_tables=t32[o3:].view(num_seqs, width),
        context_lens=t32[o1:o2], cu_seqlens_q=t32[o2:o3], logits_indices=t64[2 * num_tokens :],
        block_size=block_size, max_query_len=int(lens.max()), max_context_len=max_context_len,
    )


def build_paged_batch(
    chunks: Sequence[tuple[Sequence[int], int, Sequence[int]]],
    block_size: int,
    num_blocks: int,
    device: torch.device | str = "cpu",
) -> PagedBatch:
    """Flatten ``(token_ids, start_position, block_table)`` chunks, one per sequence.

    ``start_position`` is how many of the sequence's tokens are already cached; the block table
    must cover ``start_position + len(token_ids)`` tokens with blocks inside the pool. Every chunk
    gets a logits row.
    """
    if not chunks:
        raise ValueError("a batch needs at least one sequence")
    ids: list[int] = []
    starts, lens, tables = [], [], []
    for b, (tokens, start, table) in enumerate(chunks):
        n = len(tokens)
        if n == 0 or start < 0:
            raise ValueError(f"sequence {b}: empty chunk or negative start ({n} tokens at {start})")
        used = cdiv(start + n, block_size)
        if len(table) < used:
            raise ValueError(f"sequence {b}: {start + n} tokens need {used} blocks, the table "
                             f"has {len(table)}")
        check_blocks(table[:used], num_blocks, b)
        ids += [int(t) for t in tokens]
        starts.append(start)
        lens.append(n)
        tables.append([int(x) for x in table[:used]])
    width = max(map(len, tables))
    padded = np.full((len(tables), width), PAD_BLOCK, np.int64)
    for b, t in enumerate(tables):
        padded[b, : len(t)] = t
    return flatten_batch(ids, np.asarray(starts, np.int64), np.asarray(lens, np.int64), padded,
                         np.arange(len(tables)), block_size, device)


def check_blocks(blocks: Sequence[int], num_blocks: int, seq: int) -> None:
    bad = [blk for blk in blocks if not 0 <= blk < num_blocks]
    if bad:
        raise ValueError(f"sequence {seq}: block table entries {bad} are outside the pool of "
                         f"{num_blocks} blocks")


Chunk = tuple[list[int], int, list[int]]  # a draft's (tokens, first position, block table)


def flatten_chunks(chunks: list[Chunk], max_blocks: int, scratch: int, block_size: int,
                   device: torch.device | str, wants: list[bool] | None = None) -> PagedBatch:
    """The flattened batch of a draft's own forward: one row per chunk, its table padded with
    the scratch block; logits for the ``wants`` chunks (None: every chunk)."""
    tables = np.full((len(chunks), max_blocks), scratch, np.int64)
    ids: list[int] = []
    for r, (toks, _, table) in enumerate(chunks):
        tables[r, : len(table)] = table
        ids += toks
    return flatten_batch(
        ids, np.asarray([c[1] for c in chunks], np.int64),
        np.asarray([len(c[0]) for c in chunks], np.int64), tables,
        np.arange(len(chunks), dtype=np.int64), block_size, device,
        None if wants is None else np.asarray(wants, bool))
