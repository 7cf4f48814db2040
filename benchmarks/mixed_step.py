"""What a mixed step costs on the CPU: a long prefill chunk beside a few decodes, through the
torch paged-attention path as it is (unpadded: sequences grouped by query length) and as it was
(every sequence's query rows padded to the step's longest).

One model forward over a :class:`~infer_lab.cache.PagedAttentionContext` (the engine's step
without its scheduler and sampler; the batch is built outside the timed region, as a runner
builds it beside the previous step) for three steps on one paged cache:

- ``prefill``: a ``--chunk``-token prompt chunk alone (1,500 by default, from position 0);
- ``mixed``: the same chunk with four one-token decodes at ``--contexts`` (about 200 tokens);
- ``decodes``: the four decodes alone.

Each runs through both paths (``varlen``: the package's; ``padded``: the previous code, kept
here as :class:`PaddedAttentionContext`), interleaved round by round in a shuffled order (seeded,
so that no run always follows the same one) so that a noisy neighbour slows all alike; medians
and interquartile ranges over ``--rounds``, and the paired ratios padded / varlen of the mixed
step and, as a control, of the decode-only step, which runs the same code on both paths: its
ratio shows how far the order and the machine alone move a pair (a few-millisecond step that
follows a second-long one runs from colder caches, and the shuffle does not remove that; it
only spreads it over both paths). Beside the
times: the query rows the SDPA calls of one layer saw (the padding made visible) and the largest
logit difference between the paths. The bundled model by default (Chapter 13's opening step is
its), fp32, one torch thread. The load average before and after is recorded: the machine is
shared, so a run's figures are provisional until rerun on a quiet one.

    python -m benchmarks.mixed_step [--model bundled] [--chunk 1500] [--rounds 15]
                                    [--contexts 190 200 210 220] [--threads 1] [--out DIR]

writes ``benchmarks/results/mixed_step.json``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import infer_lab as il
from benchmarks._common import print_table, provenance, quartiles, write_results
from infer_lab.cache.paged import (
    PagedAttentionContext,
    PagedBatch,
    PagedKVCache,
    build_paged_batch,
    gather_blocks,
)
from infer_lab.model.transformer import Transformer
from infer_lab.utils import cdiv

BLOCK_SIZE = 16


class PaddedAttentionContext(PagedAttentionContext):
    """The torch path as it was before the unpadded one (commit 72d7e31): every sequence's query
    rows padded to ``[B, max_q]``, one gather and one SDPA call a layer, a mask hiding the
    padding. Tree masks are left out (this benchmark has none)."""

    _padded: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    _padded_masks: dict[int | None, torch.Tensor]

    def _layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._padded is None:
            b = self.batch
            cu, lens = b.cu_seqlens_q, b.context_lens
            q_lens = cu[1:] - cu[:-1]
            i = torch.arange(b.max_query_len, device=cu.device)
            valid = i[None, :] < q_lens[:, None]
            rows = (cu[:-1, None] + i[None, :]).clamp(max=b.num_tokens - 1)
            pos = torch.where(valid, lens[:, None] - q_lens[:, None] + i[None, :], 0)
            self._padded = (valid, rows, pos, b.block_tables.clamp(min=0))
            self._padded_masks = {}
        return self._padded

    def _attend_torch(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                      window: int | None) -> torch.Tensor:
        valid, rows, pos, tables = self._layout()
        if window not in self._padded_masks:
            keys = torch.arange(tables.shape[1] * self.batch.block_size, device=pos.device)
            allowed = keys[None, None, :] <= pos[:, :, None]
            if window is not None:
                allowed &= keys[None, None, :] > pos[:, :, None] - window
            self._padded_masks[window] = allowed[:, None]
        keys_, values = gather_blocks(kc, tables), gather_blocks(vc, tables)
        if keys_.dtype != q.dtype:
            keys_, values = keys_.to(q.dtype), values.to(q.dtype)
        one_each = self.batch.max_query_len == 1
        qb = q.unsqueeze(2) if one_each else q[rows].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            qb, keys_.transpose(1, 2), values.transpose(1, 2),
            attn_mask=self._padded_masks[window], enable_gqa=qb.shape[1] != keys_.shape[2])
        return out[:, :, 0] if one_each else out.transpose(1, 2)[valid]


PATHS: dict[str, type[PagedAttentionContext]] = {
    "varlen": PagedAttentionContext, "padded": PaddedAttentionContext}


class QueryRows(TorchDispatchMode):
    """Query rows (batch x query length) of every SDPA call inside."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),  # noqa: ANN401
                           kwargs: Any = None) -> Any:  # noqa: ANN401
        if "scaled_dot_product" in str(func):
            self.rows.append(args[0].shape[0] * args[0].shape[2])
        return func(*args, **(kwargs or {}))


def make_steps(model: Transformer, chunk: int, contexts: list[int]
               ) -> tuple[PagedKVCache, dict[str, PagedBatch]]:
    """A cache (random K/V everywhere, blocks in a shuffled order) and the three steps' batches:
    the decodes first, as the scheduler puts running sequences before a new prompt."""
    gen = torch.Generator().manual_seed(0)
    needs = [cdiv(n, BLOCK_SIZE) for n in contexts] + [cdiv(chunk, BLOCK_SIZE)]
    num_blocks = 2 * sum(needs)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(n)] for n in needs]
    cache = PagedKVCache(model.config, num_blocks, BLOCK_SIZE, dtype=model.dtype)
    cache.kv.normal_(generator=gen)
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (chunk,), generator=gen).tolist()
    decodes = [([int(torch.randint(3, vocab, (), generator=gen))], n - 1, t)
               for n, t in zip(contexts, tables, strict=False)]
    prefill = (prompt, 0, tables[-1])
    steps = {"prefill": [prefill], "mixed": [*decodes, prefill], "decodes": decodes}
    return cache, {name: build_paged_batch(chunks, BLOCK_SIZE, num_blocks)
                   for name, chunks in steps.items()}


def forward(model: Transformer, cache: PagedKVCache, batch: PagedBatch,
            path: type[PagedAttentionContext]) -> torch.Tensor:
    return model(batch.input_ids, batch.positions, path(cache, batch, backend="torch"))


@torch.inference_mode()
def measure(model: Transformer, chunk: int, contexts: list[int], rounds: int
            ) -> dict[str, Any]:
    cache, batches = make_steps(model, chunk, contexts)
    runs: dict[tuple[str, str], Callable[[], torch.Tensor]] = {
        (step, path): (lambda b=batch, p=cls: forward(model, cache, b, p))
        for step, batch in batches.items() for path, cls in PATHS.items()}
    rows_seen, differences = {}, {}
    for step in batches:
        logits = {}
        for path in PATHS:
            with QueryRows() as seen:
                logits[path] = runs[step, path]()  # also the warm-up
            rows_seen[step, path] = seen.rows[: len(seen.rows) // model.config.num_hidden_layers]
        differences[step] = float((logits["varlen"] - logits["padded"]).abs().max())
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    order = random.Random(0)
    for _ in range(rounds):
        keys = list(runs)
        order.shuffle(keys)  # a fixed cycle would give each run the same predecessor
        for key in keys:
            start = time.perf_counter()
            runs[key]()
            samples[key].append((time.perf_counter() - start) * 1e3)
    table = []
    for (step, path), ms in samples.items():
        batch = batches[step]
        table.append({"step": step, "path": path, "tokens": batch.num_tokens,
                      "sequences": batch.num_seqs, "median_ms": statistics.median(ms),
                      "iqr_ms": quartiles(ms), "min_ms": min(ms),
                      "sdpa_query_rows_per_layer": sum(rows_seen[step, path]),
                      "sdpa_calls_per_layer": len(rows_seen[step, path]), "samples_ms": ms})
    paired = [p / v for p, v in zip(samples["mixed", "padded"], samples["mixed", "varlen"],
                                    strict=True)]
    over_prefill = {path: statistics.median(
        m / p for m, p in zip(samples["mixed", path], samples["prefill", path], strict=True))
        for path in PATHS}
    control = [p / v for p, v in zip(samples["decodes", "padded"], samples["decodes", "varlen"],
                                     strict=True)]
    over_prefill_iqr = {path: quartiles(
        [m / p for m, p in zip(samples["mixed", path], samples["prefill", path], strict=True)])
        for path in PATHS}
    return {"rows": table, "mixed_padded_over_varlen": statistics.median(paired),
            "mixed_padded_over_varlen_iqr": quartiles(paired),
            "decodes_padded_over_varlen": statistics.median(control),  # same code: the floor
            "decodes_padded_over_varlen_iqr": quartiles(control),
            "mixed_over_prefill": over_prefill, "mixed_over_prefill_iqr": over_prefill_iqr,
            "max_logit_difference": differences}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bundled",
                        help="'bundled' (Chapter 13's) or a name il.load takes")
    parser.add_argument("--chunk", type=int, default=1500)
    parser.add_argument("--contexts", type=int, nargs="+", default=[190, 200, 210, 220])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, _ = il.load(None if args.model == "bundled" else args.model, device="cpu",
                       dtype=torch.float32)
    load_before = os.getloadavg()
    result = measure(model, args.chunk, args.contexts, args.rounds)
    load_after = os.getloadavg()
    print_table(result["rows"], ["step", "path", "tokens", "median_ms", "min_ms",
                                 "sdpa_query_rows_per_layer", "sdpa_calls_per_layer"])
    print(f"mixed step, padded / varlen (paired, median): "
          f"{result['mixed_padded_over_varlen']:.2f} "
          f"[IQR {result['mixed_padded_over_varlen_iqr'][0]:.2f}-"
          f"{result['mixed_padded_over_varlen_iqr'][1]:.2f}]; mixed / prefill alone: "
          + ", ".join(f"{p} {x:.2f}" for p, x in result["mixed_over_prefill"].items())
          + f"; control (decode-only, the same code): "
          f"{result['decodes_padded_over_varlen']:.2f} [IQR "
          f"{result['decodes_padded_over_varlen_iqr'][0]:.2f}-"
          f"{result['decodes_padded_over_varlen_iqr'][1]:.2f}]"
          + f"; largest logit difference {max(result['max_logit_difference'].values()):.1e}"
          + f"; load average {load_before[0]:.2f} -> {load_after[0]:.2f}")
    payload = {**provenance("cpu"), "model": args.model, "dtype": "float32",
               "layers": model.config.num_hidden_layers, "chunk": args.chunk,
               "decode_contexts": args.contexts, "block_size": BLOCK_SIZE,
               "rounds": args.rounds, "load_average_before": list(load_before),
               "load_average_after": list(load_after), **result}
    print(f"wrote {write_results('mixed_step', payload, args.out)}")


if __name__ == "__main__":
    main()
