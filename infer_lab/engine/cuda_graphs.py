"""CUDA graphs for decode steps: capture once per batch size, replay with new inputs.

A decode step of a small model launches hundreds of kernels, each costing the CPU a few
microseconds to launch: at batch 1 the GPU waits on the launcher. A CUDA graph records the
whole forward once and replays it in one call. A graph reads its inputs from the addresses it
was captured with, so every input lives in a fixed buffer (one object, :class:`CUDAGraphs`, owns
them all); a replay copies the step's batch into the buffers, pads it up to the next captured
size with rows that write into a scratch block, and replays.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from infer_lab.cache.batch import PagedBatch
from infer_lab.cache.paged import PagedAttentionContext, PagedKVCache


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to ``max_num_seqs`` (the sizes vLLM captures, roughly)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class CUDAGraphs:
    """The captured decode forwards and the fixed input buffers they read.

    ``scratch`` is the cache block padding rows write to; ``max_blocks`` the width of a block
    table; ``max_model_len`` the host-side ``max_context_len`` every replay may assume (an upper
    bound that holds for every batch a graph will replay).
    """

    def __init__(self, model: Callable[..., torch.Tensor], cache: PagedKVCache, backend: Any,
                 block_size: int, scratch: int, max_blocks: int, max_model_len: int) -> None:
        self.model, self.cache, self.backend = model, cache, backend
        self.block_size, self.scratch = block_size, scratch
        self.max_blocks, self.max_model_len = max_blocks, max_model_len
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.error: str | None = None

    def capture(self, sizes: list[int], device: torch.device) -> None:
        """Capture one decode forward per batch size; on failure, stay eager and say why."""
        biggest, block_size, i32 = max(sizes), self.block_size, torch.int32
        self.ids = torch.zeros(biggest, dtype=torch.long, device=device)
        self.pos = torch.zeros(biggest, dtype=torch.long, device=device)
        self.slots = torch.full((biggest,), self.scratch * block_size, dtype=i32, device=device)
        self.ctx = torch.ones(biggest, dtype=i32, device=device)
        self.tables = torch.full((biggest, self.max_blocks), self.scratch, dtype=i32,
                                 device=device)
        self.cu = torch.arange(biggest + 1, dtype=i32, device=device)
        self.logits_at = torch.arange(biggest, dtype=torch.long, device=device)
        pool = None
        try:
            for b in sorted(sizes, reverse=True):
                pool = self._capture_one(b, pool)
        except Exception as e:  # an attention backend that syncs with the host cannot be captured
            self.graphs.clear()
            self.error = f"{type(e).__name__}: {e}"
            warnings.warn(f"CUDA graphs disabled, decode runs eagerly ({self.error})",
                          stacklevel=3)

    def _capture_one(self, b: int, pool: Any) -> Any:
        batch = PagedBatch(self.ids[:b], self.pos[:b], self.slots[:b], self.tables[:b],
                           self.ctx[:b], self.cu[: b + 1], self.logits_at[:b], self.block_size,
                           max_query_len=1, max_context_len=self.max_model_len)
        ctx = PagedAttentionContext(self.cache, batch, backend=self.backend)
        with torch.inference_mode():
            self.model(batch.input_ids, batch.positions, ctx)  # warm-up, outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model(batch.input_ids, batch.positions, ctx)
        self.graphs[b] = (graph, logits)
        return graph.pool()

    def can_replay(self, batch: PagedBatch, num_sampled: int) -> bool:
        """A decode-only step (one token per sequence, every one sampled) of a captured size."""
        n = batch.num_seqs
        return (bool(self.graphs) and batch.num_tokens == n and num_sampled == n
                and n <= max(self.graphs))

    def replay(self, batch: PagedBatch) -> torch.Tensor:
        n = batch.num_seqs
        size = min(b for b in self.graphs if b >= n)
        width = batch.block_tables.shape[1]
        self.ids[:n].copy_(batch.input_ids)
        self.pos[:n].copy_(batch.positions)
        self.slots[:n].copy_(batch.slot_mapping)
        self.ctx[:n].copy_(batch.context_lens)
        self.tables[:n, :width].copy_(batch.block_tables)
        if size > n:  # padding rows: one token at position 0, written to the scratch block
            self.ids[n:size].zero_()
            self.pos[n:size].zero_()
            self.slots[n:size].fill_(self.scratch * self.block_size)
            self.ctx[n:size].fill_(1)
            self.tables[n:size].fill_(self.scratch)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]
