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

On CUDA, decode-only steps replay CUDA graphs captured once per batch size
(:mod:`~infer_lab.engine.cuda_graphs`): a graph launches the whole forward's hundreds of kernels
in one call.

Speculative decoding adds two things. A sequence's proposals are extra rows with logits; when
they form a draft tree (``seq.spec_parents``), each node gets the position of its depth and the
batch a tree attention mask (:func:`~infer_lab.engine.draft_tree.tree_mask`). And an EAGLE head
sets :attr:`ModelRunner.hidden_states_hook`: the forward then also returns its last hidden
states through the attention context, and the hook gets them with the step and its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from infer_lab.cache.batch import PagedBatch, flatten_batch
from infer_lab.cache.kv_quant import attention_backend_for, make_paged_kv_cache
from infer_lab.cache.paged import PagedAttentionContext
from infer_lab.engine.config import EngineConfig
from infer_lab.engine.cuda_graphs import CUDAGraphs, graph_batch_sizes
from infer_lab.engine.draft_tree import DraftTree, tree_mask
from infer_lab.engine.prompt_logprobs import (
    PromptChunk,
    logits_rows,
    record_prompt_logprobs,
    wants_prompt_logprobs,
)
from infer_lab.engine.scheduler import SchedulerOutput
from infer_lab.engine.sequence import Sequence
from infer_lab.model.transformer import Transformer
from infer_lab.utils import cdiv

Forward = Callable[[torch.Tensor, torch.Tensor, PagedAttentionContext], torch.Tensor]
HiddenStatesHook = Callable[[SchedulerOutput, PagedBatch, torch.Tensor], Any]


class ModelRunner:
    """Owns the paged KV cache and turns a :class:`SchedulerOutput` into logits.

    Sizes come from ``config`` (``num_kv_blocks``, ``block_size``, ``max_num_seqs``,
    ``max_model_len``, all resolved by the engine, and ``use_cuda_graphs``).
    """

    def __init__(self, model: Transformer, config: EngineConfig) -> None:
        if config.num_kv_blocks is None or config.max_model_len is None:
            raise ValueError("the runner needs a resolved config (num_kv_blocks, max_model_len)")
        self.model, self.device, self.config = model, model.device, config
        num_blocks, block_size = config.num_kv_blocks, config.block_size
        max_num_seqs = config.max_num_seqs
        # One extra block past the pool: a scratch block where filler rows (static batching's
        # padding, CUDA-graph padding) write K/V nobody reads.
        self.cache = make_paged_kv_cache(model.config, num_blocks + 1, block_size, self.device,
                                         model.dtype, config.kv_cache_dtype)  # 8-bit: Ch. 8
        self.attn_backend = attention_backend_for(self.cache, None)
        self.scratch = num_blocks
        self.max_blocks = cdiv(config.max_model_len, block_size)
        self.filler_row = max_num_seqs
        self.block_table = np.full((max_num_seqs + 1, self.max_blocks), self.scratch, np.int64)
        # Per row: the table list last copied into it, and how many of its entries.
        self._row_tables: list[list[int] | None] = [None] * (max_num_seqs + 1)
        self._row_synced = [0] * (max_num_seqs + 1)
        self.forward: Forward = model  # replaceable, e.g. by a no-op to time the CPU side
        # Called after each forward with the last hidden states of every row (EAGLE's features);
        # while set, the forward computes them, and CUDA graphs (which would not) are not used.
        self.hidden_states_hook: HiddenStatesHook | None = None
        self._prompt_chunks: list[PromptChunk] = []  # this step's (prompt_logprobs)
        use_cuda_graphs = config.use_cuda_graphs
        if use_cuda_graphs is None:
            use_cuda_graphs = self.device.type == "cuda"
        self.cuda_graphs: CUDAGraphs | None = None
        if use_cuda_graphs:
            self.cuda_graphs = CUDAGraphs(model, self.cache, self.attn_backend, block_size,
                                          self.scratch, self.max_blocks, config.max_model_len)
            self.cuda_graphs.capture(graph_batch_sizes(max_num_seqs), self.device)

    @property
    def graphs(self) -> dict:
        """The captured decode graphs by batch size (empty: eager)."""
        return self.cuda_graphs.graphs if self.cuda_graphs is not None else {}

    @property
    def graph_error(self) -> str | None:
        """Why capture failed, if it did."""
        return self.cuda_graphs.error if self.cuda_graphs is not None else None

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
        trees: dict[int, tuple[int, int, DraftTree]] = {}  # chunk -> first row, start, tree
        prompt: dict[int, Sequence] = {}  # chunk -> its sequence, when every row gets logits
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
                if seq.spec_parents:
                    tree = DraftTree(tuple(spec), tuple(seq.spec_parents))
                    trees[len(wants)] = (len(ids) - 1, start, tree)
                ids += spec
                spec_rows[len(wants)] = len(spec)
            else:
                ids += seq.token_ids[start : start + n]
            complete = start + n - len(spec) == len(seq.token_ids)
            if wants_prompt_logprobs(seq, start):
                prompt[len(wants)] = seq
            wants.append(complete)
            if complete:
                sampled.append(seq)
        lens = list(out.num_new)
        self._add_fillers(out, starts, rows, lens, ids, wants)
        batch = flatten_batch(
            ids, np.asarray(starts, np.int64), np.asarray(lens, np.int64), bt,
            np.asarray(rows, np.int64), self.config.block_size, self.device,
            None if len(sampled) == len(wants) else np.asarray(wants, bool),
        )
        if spec_rows:  # logits at every proposed position too, not only the chunk's last
            batch.logits_indices = self._spec_logits_indices(lens, wants, spec_rows)
        if trees:
            self._lay_out_trees(batch, lens, trees)
        self._prompt_chunks = []
        if prompt:  # and at every position of a chunk whose prompt log-probabilities are asked
            batch.logits_indices, self._prompt_chunks = logits_rows(
                lens, wants, spec_rows, prompt, starts, self.device)
        return batch, sampled

    def _lay_out_trees(self, batch: PagedBatch, lens: list[int],
                       trees: dict[int, tuple[int, int, DraftTree]]) -> None:
        """Each tree node at the position of its depth, and the batch's tree attention mask."""
        rows: list[int] = []
        positions: list[int] = []
        regions: dict[int, np.ndarray] = {}
        for b, (first, start, tree) in trees.items():
            rows += range(first + 1, first + 1 + len(tree.tokens))
            positions += [start + d for d in tree.depths()]
            regions[b] = tree.ancestor_mask()
        index = torch.tensor(rows, device=self.device)
        batch.positions[index] = torch.tensor(positions, device=self.device)
        cu = np.concatenate([[0], np.cumsum(lens)])
        batch.tree_mask = tree_mask(cu, regions, self.device)

    def _add_fillers(self, out: SchedulerOutput, starts: list[int], rows: list[int],
                     lens: list[int], ids: list[int], wants: list[bool]) -> None:
        """Static batching's rows that compute nothing anyone reads: prefill padding, and the
        slots of finished requests in a decode step. They write to the scratch block."""
        fillers = [p for p in out.pad_tokens if p > 0] + ([out.num_idle] if out.num_idle else [])
        if fillers:
            starts += [0] * len(fillers)
            rows += [self.filler_row] * len(fillers)
            lens += fillers
            ids += [0] * sum(fillers)
            wants += [False] * len(fillers)

    def _spec_logits_indices(self, lens: list[int], wants: list[bool],
                             spec_rows: dict[int, int]) -> torch.Tensor:
        """Logits rows: the last token of each wanted chunk, and each proposal before it."""
        ends = np.cumsum(lens)
        idx: list[int] = []
        for b, want in enumerate(wants):
            if want:
                k = spec_rows.get(b, 0)
                idx += range(int(ends[b]) - 1 - k, int(ends[b]))
        return torch.tensor(idx, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one step; returns logits ``[rows, vocab]`` and the sampled sequences.

        The block copies the step owes (``out.block_copies``) are the executor's to perform
        first (:meth:`copy_blocks`), so that tensor-parallel ranks copy theirs too.
        """
        batch, sampled = self.prepare(out)
        graphs, hook = self.cuda_graphs, self.hidden_states_hook
        if (graphs is not None and hook is None and not self._prompt_chunks
                and graphs.can_replay(batch, len(sampled))):
            return graphs.replay(batch), sampled
        ctx = PagedAttentionContext(self.cache, batch, backend=self.attn_backend)
        ctx.want_hidden_states = hook is not None
        logits = self.forward(batch.input_ids, batch.positions, ctx)
        if hook is not None and ctx.hidden_states is not None:
            hook(out, batch, ctx.hidden_states)
        if self._prompt_chunks:  # into the requests; the sampler gets its rows only
            logits = record_prompt_logprobs(logits, self._prompt_chunks)
        return logits, sampled

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: each ``(src, dst)`` block's K/V into ``dst`` before the forward."""
        self.cache.copy_blocks(pairs)
