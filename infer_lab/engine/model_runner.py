"""Fill the flattened ragged batch of one step and run the model once.

The scheduler says "compute ``n`` tokens of this sequence" for each sequence; the runner lays all
those tokens end to end (no padding) and hands the model a :class:`~infer_lab.cache.PagedBatch`
built by :func:`~infer_lab.cache.flatten_batch`, the same builder Chapter 3 uses. Only rows whose
sequence completes its tokens this step (a decode, or the last chunk of a prompt) get logits.

The per-step CPU cost matters: with hundreds of sequences in a batch, Python loops over tokens
would cost more than a small model's forward. So each running sequence's batch *slot* (given by
the scheduler) is a row of a persistent block-table array that the runner alone maintains: it
remembers which table list it copied into each row and how much of it, and writes only what is
new. A table's entries are only ever appended (the KV manager puts a new list on the sequence for
any other change), so "same list, same length" means "row up to date". The rest (positions,
slot mapping, sequence offsets) is a few numpy vector ops in the builder.

On CUDA, decode-only steps replay CUDA graphs captured once per batch size (1, 2, 4, 8, 16, ...;
a batch is padded up to the next captured size with rows that write into a scratch block): a
graph launches the whole forward's hundreds of kernels in one call.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch

from infer_lab.cache.batch import PagedBatch, flatten_batch
from infer_lab.cache.kv_quant import attention_backend_for, make_paged_kv_cache
from infer_lab.cache.paged import PagedAttentionContext
from infer_lab.engine.config import EngineConfig
from infer_lab.engine.scheduler import SchedulerOutput
from infer_lab.engine.sequence import Sequence
from infer_lab.model.transformer import Transformer
from infer_lab.utils import cdiv

Forward = Callable[[torch.Tensor, torch.Tensor, PagedAttentionContext], torch.Tensor]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to ``max_num_seqs`` (the sizes vLLM captures, roughly)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class ModelRunner:
    """Owns the paged KV cache and turns a :class:`SchedulerOutput` into logits.

    Sizes come from ``config`` (``num_kv_blocks``, ``block_size``, ``max_num_seqs``,
    ``max_model_len``, all resolved by the engine, and ``use_cuda_graphs``).
    """

    def __init__(self, model: Transformer, config: EngineConfig) -> None:
        if config.num_kv_blocks is None or config.max_model_len is None:
            raise ValueError("the runner needs a resolved config (num_kv_blocks, max_model_len)")
        self.model, self.device, self.config = model, model.device, config
        num_blocks, bs, max_num_seqs = (config.num_kv_blocks, config.block_size,
                                        config.max_num_seqs)
        # One extra block past the pool: a scratch block where filler rows (static batching's
        # padding, CUDA-graph padding) write K/V nobody reads.
        self.cache = make_paged_kv_cache(model.config, num_blocks + 1, bs, self.device,
                                         model.dtype, config.kv_cache_dtype)  # 8-bit: Ch. 8
        self.attn_backend = attention_backend_for(self.cache, None)
        self.scratch = num_blocks
        self.max_blocks = cdiv(config.max_model_len, bs)
        self.filler_row = max_num_seqs
        self.block_table = np.full((max_num_seqs + 1, self.max_blocks), self.scratch, np.int64)
        # Per row: the table list last copied into it, and how many of its entries.
        self._row_tables: list[list[int] | None] = [None] * (max_num_seqs + 1)
        self._row_synced = [0] * (max_num_seqs + 1)
        self.forward: Forward = model  # replaceable, e.g. by a no-op to time the CPU side
        use_cuda_graphs = config.use_cuda_graphs
        if use_cuda_graphs is None:
            use_cuda_graphs = self.device.type == "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_error: str | None = None
        if use_cuda_graphs:
            self.capture_cuda_graphs(graph_batch_sizes(max_num_seqs))

    # ------------------------------------------------------------------ inputs
    def prepare(self, out: SchedulerOutput) -> tuple[PagedBatch, list[Sequence]]:
        """The flattened batch of ``out`` and the sequences whose logits it computes, in order."""
        bt, row_tables, row_synced = self.block_table, self._row_tables, self._row_synced
        starts: list[int] = []
        rows: list[int] = []
        ids: list[int] = []
        sampled: list[Sequence] = []
        wants: list[bool] = []
        spec_rows: dict[int, int] = {}  # chunk -> proposals in it (they all get logits rows)
        for seq, n in zip(out.seqs, out.num_new):
            table, slot = seq.block_table, seq.slot
            if row_tables[slot] is not table:
                bt[slot, : len(table)] = table
                row_tables[slot], row_synced[slot] = table, len(table)
            elif row_synced[slot] != len(table):
                done = row_synced[slot]
                bt[slot, done : len(table)] = table[done:]
                row_synced[slot] = len(table)
            start = seq.num_computed
            starts.append(start)
            rows.append(slot)
            spec = seq.spec_token_ids
            if n == 1:
                ids.append(seq.token_ids[start])
            elif spec:  # speculative: the last real token, then the proposals
                ids += seq.token_ids[start:]
                ids += spec
                spec_rows[len(wants)] = len(spec)
            else:
                ids += seq.token_ids[start : start + n]
            complete = start + n - len(spec) == len(seq.token_ids)
            wants.append(complete)
            if complete:
                sampled.append(seq)
        lens = list(out.num_new)
        fillers = [p for p in out.pad_tokens if p > 0] + ([out.num_idle] if out.num_idle else [])
        if fillers:
            starts += [0] * len(fillers)
            rows += [self.filler_row] * len(fillers)
            lens += fillers
            ids += [0] * sum(fillers)
            wants += [False] * len(fillers)
        batch = flatten_batch(
            ids, np.asarray(starts, np.int64), np.asarray(lens, np.int64), bt,
            np.asarray(rows, np.int64), self.config.block_size, self.device,
            None if len(sampled) == len(wants) else np.asarray(wants, bool),
        )
        if spec_rows:  # logits at every proposed position too, not only the chunk's last
            ends = np.cumsum(lens)
            idx: list[int] = []
            for b, want in enumerate(wants):
                if want:
                    k = spec_rows.get(b, 0)
                    idx += range(int(ends[b]) - 1 - k, int(ends[b]))
            batch.logits_indices = torch.tensor(idx, dtype=torch.long, device=self.device)
        return batch, sampled

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one step; returns logits ``[len(sampled), vocab]`` and the sampled sequences."""
        if out.block_copies:
            self.cache.copy_blocks(out.block_copies)
            workers = getattr(self.model, "tp_workers", None)  # tensor parallel: the other ranks
            if workers is not None:
                workers.copy_blocks(self.cache, out.block_copies)
        batch, sampled = self.prepare(out)
        n = batch.num_seqs
        if self.graphs and batch.num_tokens == n and len(sampled) == n and n <= max(self.graphs):
            return self._replay(batch), sampled
        ctx = PagedAttentionContext(self.cache, batch, backend=self.attn_backend)
        return self.forward(batch.input_ids, batch.positions, ctx), sampled

    # ------------------------------------------------------------------ CUDA graphs
    def capture_cuda_graphs(self, sizes: list[int]) -> None:
        """Capture one decode forward per batch size; on failure, stay eager and say why.

        A captured batch reads its index tensors from fixed buffers (int32, as the builder makes
        them); its host-side ``max_context_len`` is ``max_model_len``, an upper bound that holds
        for every batch the graph will replay.
        """
        dev, biggest, bs = self.device, max(sizes), self.config.block_size
        i32 = torch.int32
        self._g_ids = torch.zeros(biggest, dtype=torch.long, device=dev)
        self._g_pos = torch.zeros(biggest, dtype=torch.long, device=dev)
        self._g_slots = torch.full((biggest,), self.scratch * bs, dtype=i32, device=dev)
        self._g_ctx = torch.ones(biggest, dtype=i32, device=dev)
        self._g_bt = torch.full((biggest, self.max_blocks), self.scratch, dtype=i32, device=dev)
        self._g_cu = torch.arange(biggest + 1, dtype=i32, device=dev)
        self._g_logits = torch.arange(biggest, dtype=torch.long, device=dev)
        pool = None
        try:
            for b in sorted(sizes, reverse=True):
                batch = PagedBatch(self._g_ids[:b], self._g_pos[:b], self._g_slots[:b],
                                   self._g_bt[:b], self._g_ctx[:b], self._g_cu[: b + 1],
                                   self._g_logits[:b], bs, max_query_len=1,
                                   max_context_len=self.config.max_model_len)
                ctx = PagedAttentionContext(self.cache, batch, backend=self.attn_backend)
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
            self._g_slots[n:size].fill_(self.scratch * self.config.block_size)
            self._g_ctx[n:size].fill_(1)
            self._g_bt[n:size].fill_(self.scratch)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]
