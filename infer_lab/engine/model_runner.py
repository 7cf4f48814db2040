"""Fill DESIGN.md's flattened ragged batch for one step and run the model once.

The scheduler says "compute ``n`` tokens of this sequence" for each sequence; the runner lays all
those tokens end to end (no padding), works out each token's position and cache slot, and hands
the model a :class:`~infer_lab.cache.PagedBatch`. Only rows whose sequence completes its tokens
this step (a decode, or the last chunk of a prompt) get logits.

The per-step CPU cost matters: with hundreds of sequences in a batch, Python loops over tokens
would cost more than a small model's forward. So each running sequence owns a *slot*, a row of a
persistent block-table array; a row is written only when its sequence gains a block, and the
rest (positions, slot mapping, sequence offsets) is computed with numpy in a few vector ops.

On CUDA, decode-only steps replay CUDA graphs captured once per batch size (1, 2, 4, 8, 16, ...;
a batch is padded up to the next captured size with rows that write into a scratch block): a
graph launches the whole forward's hundreds of kernels in one call.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch

from infer_lab.cache.block_pool import cdiv
from infer_lab.cache.paged import PagedAttentionContext, PagedBatch, PagedKVCache
from infer_lab.engine.scheduler import SchedulerOutput
from infer_lab.engine.sequence import Sequence
from infer_lab.model.transformer import Transformer

Forward = Callable[[torch.Tensor, torch.Tensor, PagedAttentionContext], torch.Tensor]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to ``max_num_seqs`` (the sizes vLLM captures, roughly)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class ModelRunner:
    """Owns the paged KV cache and turns a :class:`SchedulerOutput` into logits."""

    def __init__(
        self,
        model: Transformer,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        use_cuda_graphs: bool | None = None,
    ) -> None:
        self.model, self.device = model, model.device
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        # One extra block past the pool: a scratch block where filler rows (static batching's
        # padding, CUDA-graph padding) write K/V nobody reads.
        self.cache = PagedKVCache(model.config, num_blocks + 1, block_size, self.device,
                                  model.dtype)
        self.scratch = num_blocks
        self.max_blocks = cdiv(max_model_len, block_size)
        self.filler_row = max_num_seqs
        self.block_table = np.full((max_num_seqs + 1, self.max_blocks), self.scratch, np.int64)
        self.forward: Forward = model  # replaceable, e.g. by a no-op to time the CPU side
        if use_cuda_graphs is None:
            use_cuda_graphs = self.device.type == "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_error: str | None = None
        if use_cuda_graphs:
            self.capture_cuda_graphs(graph_batch_sizes(max_num_seqs))

    # ------------------------------------------------------------------ inputs
    def prepare(self, out: SchedulerOutput) -> tuple[PagedBatch, list[Sequence]]:
        """The flattened batch of ``out`` and the sequences whose logits it computes, in order."""
        bt, bs = self.block_table, self.block_size
        starts: list[int] = []
        rows: list[int] = []
        ids: list[int] = []
        sampled: list[Sequence] = []
        wants: list[bool] = []
        for seq, n in zip(out.seqs, out.num_new):
            table, synced = seq.block_table, seq.synced_blocks
            if synced != len(table):
                bt[seq.slot, synced : len(table)] = table[synced:]
                seq.synced_blocks = len(table)
            start = seq.num_computed
            starts.append(start)
            rows.append(seq.slot)
            if n == 1:
                ids.append(seq.token_ids[start])
            else:
                ids += seq.token_ids[start : start + n]
            done = start + n == len(seq.token_ids)
            wants.append(done)
            if done:
                sampled.append(seq)
        lens = list(out.num_new)
        fillers = [p for p in out.pad_tokens if p > 0] + ([out.num_idle] if out.num_idle else [])
        if fillers:
            starts += [0] * len(fillers)
            rows += [self.filler_row] * len(fillers)
            lens += fillers
            ids += [0] * sum(fillers)
            wants += [False] * len(fillers)
        lens_np = np.asarray(lens, np.int64)
        starts_np = np.asarray(starts, np.int64)
        rows_np = np.asarray(rows, np.int64)
        cu = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(lens_np, out=cu[1:])
        num_tokens = int(cu[-1])
        ctx_lens = starts_np + lens_np
        if num_tokens == len(lens):  # every chunk is one token: a decode step
            positions, token_rows = starts_np, rows_np
        else:
            positions = np.arange(num_tokens) - np.repeat(cu[:-1] - starts_np, lens_np)
            token_rows = np.repeat(rows_np, lens_np)
        slots = bt[token_rows, positions // bs] * bs + positions % bs
        width = cdiv(int(ctx_lens.max()), bs)
        logits_idx = cu[1:][np.asarray(wants, bool)] - 1
        dev = self.device

        def t(x: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(x)).to(dev)

        batch = PagedBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev), positions=t(positions),
            slot_mapping=t(slots), block_tables=t(bt[rows_np, :width]), context_lens=t(ctx_lens),
            cu_seqlens_q=t(cu), logits_indices=t(logits_idx), block_size=bs,
        )
        return batch, sampled

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one step; returns logits ``[len(sampled), vocab]`` and the sampled sequences."""
        if out.block_copies:
            self.cache.copy_blocks(out.block_copies)
        batch, sampled = self.prepare(out)
        n = batch.num_seqs
        if self.graphs and batch.num_tokens == n and len(sampled) == n and n <= max(self.graphs):
            return self._replay(batch), sampled
        ctx = PagedAttentionContext(self.cache, batch)
        return self.forward(batch.input_ids, batch.positions, ctx), sampled

    # ------------------------------------------------------------------ CUDA graphs
    def capture_cuda_graphs(self, sizes: list[int]) -> None:
        """Capture one decode forward per batch size; on failure, stay eager and say why."""
        dev, biggest = self.device, max(sizes)
        scratch_slot = self.scratch * self.block_size
        self._g_ids = torch.zeros(biggest, dtype=torch.long, device=dev)
        self._g_pos = torch.zeros(biggest, dtype=torch.long, device=dev)
        self._g_slots = torch.full((biggest,), scratch_slot, dtype=torch.long, device=dev)
        self._g_ctx = torch.ones(biggest, dtype=torch.long, device=dev)
        self._g_bt = torch.full((biggest, self.max_blocks), self.scratch, dtype=torch.long,
                                device=dev)
        self._g_cu = torch.arange(biggest + 1, dtype=torch.long, device=dev)
        pool = None
        try:
            for b in sorted(sizes, reverse=True):
                batch = PagedBatch(self._g_ids[:b], self._g_pos[:b], self._g_slots[:b],
                                   self._g_bt[:b], self._g_ctx[:b], self._g_cu[: b + 1],
                                   self._g_cu[:b], self.block_size)
                ctx = PagedAttentionContext(self.cache, batch)
                with torch.inference_mode():
                    self.model(batch.input_ids, batch.positions, ctx)  # warm-up, outside capture
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        logits = self.model(batch.input_ids, batch.positions, ctx)
                pool = graph.pool()
                self.graphs[b] = (graph, logits)
        except Exception as e:  # an attention backend that syncs with the host cannot be captured
            self.graphs.clear()
            self.graph_error = f"{type(e).__name__}: {e}"
            warnings.warn(f"CUDA graphs disabled, decode runs eagerly ({self.graph_error})",
                          stacklevel=2)

    def _replay(self, batch: PagedBatch) -> torch.Tensor:
        n = batch.num_seqs
        size = min(b for b in self.graphs if b >= n)
        width = batch.block_tables.shape[1]
        self._g_ids[:n].copy_(batch.input_ids)
        self._g_pos[:n].copy_(batch.positions)
        self._g_slots[:n].copy_(batch.slot_mapping)
        self._g_ctx[:n].copy_(batch.context_lens)
        self._g_bt[:n, :width].copy_(batch.block_tables)
        if size > n:  # padding rows: one token at position 0, written to the scratch block
            self._g_ids[n:size].zero_()
            self._g_pos[n:size].zero_()
            self._g_slots[n:size].fill_(self.scratch * self.block_size)
            self._g_ctx[n:size].fill_(1)
            self._g_bt[n:size].fill_(self.scratch)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]
