"""The KV cache, measured: naive vs cached decode, and paged vs contiguous decode steps.

1. Greedy generation of ``--tokens`` tokens (512 by default) on the bundled model, with no cache
   (``il.generate_naive``: every step re-runs the whole prefix) and with the contiguous KV cache
   (``generate_cached``). Reports the end-to-end speedup and whether the tokens agree.
2. One decode step of ``B`` sequences at ``--context`` tokens each, through the contiguous cache
   (``ContiguousAttentionContext``) and through the paged cache (``PagedAttentionContext`` over
   block tables, blocks scattered through the pool). Same model, same batch, same tokens; reports
   paged / contiguous step time (paging's overhead). The batch metadata is built once, outside the
   timed step, as a runner would build it alongside the previous step; its cost is reported apart,
   and so is the gather alone (every layer's K and V copied out of the pool through the block
   tables, as the torch paged path does), to say how much of the difference the copy is.

The two timings of each pair are interleaved, repeat by repeat, so that a noisy neighbour slows
both alike; medians are reported, and each ratio is the median of the per-repeat ratios with
their interquartile range (naive/cached: their min and max, over few repeats). The load average
before and after the run is recorded: on a shared machine it says how loud the neighbours were.
On CPU it runs one torch thread unless told otherwise (``--threads``): small decode steps on
several threads are at the mercy of anything else running. Ratios are what to quote; absolute
times count on a GPU.

    python -m benchmarks.kv_cache [--tokens 512] [--batches 1 8 32] [--context 256] [--threads N]
                                  [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import infer_lab as il
from benchmarks._common import cpu_model, print_table, provenance, quartiles, write_results
from infer_lab.cache import (
    BlockManager,
    ContiguousAttentionContext,
    ContiguousKVCache,
    PagedAttentionContext,
    PagedKVCache,
    build_paged_batch,
)
from infer_lab.model.baselines import generate_cached
from infer_lab.model.transformer import Transformer

PROMPT = "And God said, Let there be light"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, device: str,
                warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each function, the calls alternating repeat by repeat."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            samples[name].append(time.perf_counter() - start)
    return samples


def paired_ratios(num: list[float], den: list[float]) -> list[float]:
    """num / den repeat by repeat: each pair ran back to back, under the same load."""
    return [n / d for n, d in zip(num, den)]


def spread(pair: list[float]) -> str:
    return f"{pair[0]:.2f}-{pair[1]:.2f}"


@torch.inference_mode()
def naive_vs_cached(model: Transformer, tok, tokens: int, repeats: int, device: str) -> dict:
    naive = il.generate_naive(model, tok, PROMPT, max_tokens=tokens, ignore_eos=True)
    cached = generate_cached(model, tok, [PROMPT], max_tokens=tokens, ignore_eos=True)[0]
    times = interleaved(
        {
            "naive": lambda: il.generate_naive(model, tok, PROMPT, max_tokens=tokens,
                                               ignore_eos=True),
            "cached": lambda: generate_cached(model, tok, [PROMPT], max_tokens=tokens,
                                              ignore_eos=True),
        },
        repeats, device, warmup=0,
    )
    naive_s, cached_s = (statistics.median(times[k]) for k in ("naive", "cached"))
    speedups = paired_ratios(times["naive"], times["cached"])
    return {
        "tokens": tokens,
        "repeats": repeats,
        "naive_s": naive_s,
        "cached_s": cached_s,
        "naive_ms_per_token": naive_s / tokens * 1e3,
        "cached_ms_per_token": cached_s / tokens * 1e3,
        "speedup": statistics.median(speedups),
        "speedup_min_max": [min(speedups), max(speedups)],
        "tokens_equal": naive.token_ids == cached.token_ids,
    }


@torch.inference_mode()
def paged_vs_contiguous(model: Transformer, batch: int, context: int, block_size: int,
                        repeats: int, device: str) -> dict:
    """One decode step: ``batch`` sequences, each with ``context`` tokens cached."""
    cfg, dtype = model.config, model.dtype
    gen = torch.Generator().manual_seed(batch)
    feed = torch.randint(0, cfg.vocab_size, (batch,), generator=gen).to(device)

    contiguous = ContiguousKVCache(cfg, batch, context + 1, device, dtype)
    start = torch.full((batch,), context, dtype=torch.long)

    def contiguous_step() -> torch.Tensor:
        ctx = ContiguousAttentionContext(contiguous, start, 1)
        return model(feed, ctx.positions.flatten(), ctx)

    # A pool with room to spare, blocks handed out in a shuffled order so that no sequence's
    # blocks are neighbours (what a pool looks like after a while of serving).
    blocks_each = -(-(context + 1) // block_size)
    num_blocks = 2 * batch * blocks_each
    mgr = BlockManager(num_blocks, block_size)
    for d in range(num_blocks):  # take every block, give them back in a random order
        mgr.allocate_slots(("dummy", d), 1)
    for d in torch.randperm(num_blocks, generator=gen).tolist():
        mgr.free(("dummy", d))
    for s in range(batch):
        mgr.allocate_slots(s, context + 1)
    paged = PagedKVCache(cfg, num_blocks, block_size, device, dtype)
    for i in range(cfg.num_hidden_layers):  # same (random) cache contents in both layouts
        contiguous.k[i].normal_()
        contiguous.v[i].normal_()
        for s in range(batch):
            slots = torch.tensor(mgr.slot_mapping(s, 0, context + 1), device=device)
            paged.k_caches[i].view(-1, *paged.k_caches[i].shape[2:])[slots] = contiguous.k[i][s]
            paged.v_caches[i].view(-1, *paged.v_caches[i].shape[2:])[slots] = contiguous.v[i][s]

    def build():
        return build_paged_batch(
            [([int(t)], context, mgr.block_table(s)) for s, t in enumerate(feed.tolist())],
            block_size, num_blocks, device,
        )

    meta = build()

    def paged_step() -> torch.Tensor:
        return model(meta.input_ids, meta.positions, PagedAttentionContext(paged, meta))

    tables = meta.block_tables.clamp(min=0)

    def gather() -> None:
        """The copy the torch paged path makes: every layer's K and V through the tables."""
        for kc, vc in zip(paged.k_caches, paged.v_caches):
            kc[tables]
            vc[tables]

    same = torch.allclose(contiguous_step(), paged_step(), atol=1e-4, rtol=1e-4)
    times = interleaved({"contiguous": contiguous_step, "paged": paged_step, "build": build,
                         "gather": gather}, repeats, device)
    ms = {name: statistics.median(s) * 1e3 for name, s in times.items()}
    ratios = paired_ratios(times["paged"], times["contiguous"])
    return {
        "batch": batch,
        "context": context,
        "block_size": block_size,
        "repeats": repeats,
        "contiguous_ms": ms["contiguous"],
        "paged_ms": ms["paged"],
        "build_ms": ms["build"],
        "gather_ms": ms["gather"],
        "paged_over_contiguous": statistics.median(ratios),
        "paged_over_contiguous_iqr": quartiles(ratios),
        "logits_close": bool(same),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--gen-repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (0: torch's choice). Default 1: a cached step is "
                             "many tiny ops, and on a CPU shared with other work several threads "
                             "wait on each other, slowing it up to 100x")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads and device == "cpu":
        torch.set_num_threads(args.threads)
    model, tok = il.load(device=device)  # fp32 on CPU, the device's default dtype elsewhere
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    started = time.perf_counter()
    torch.manual_seed(0)

    gen = naive_vs_cached(model, tok, args.tokens, args.gen_repeats, device)
    print("naive vs cached decode, bundled model:")
    print_table([{**gen, "min-max": spread(gen["speedup_min_max"])}],
                ["tokens", "naive_s", "cached_s", "speedup", "min-max", "tokens_equal"])

    steps = [paged_vs_contiguous(model, b, args.context, args.block_size, args.repeats, device)
             for b in args.batches]
    print("\npaged vs contiguous decode step, bundled model:")
    print_table([{**row, "iqr": spread(row["paged_over_contiguous_iqr"])} for row in steps],
                ["batch", "context", "contiguous_ms", "paged_ms", "paged_over_contiguous", "iqr",
                 "build_ms", "gather_ms", "logits_close"])
    load_after = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}")

    prov = provenance(device)
    if device == "cpu":  # the CPU's model, where provenance() names only the architecture
        prov["device_name"] = cpu_model() or prov["device_name"]
    payload = {"benchmark": "kv_cache", **prov, "cpu_count": os.cpu_count(),
               "load_average": {"before": load_before, "after": load_after},
               "run_s": time.perf_counter() - started, "dtype": str(model.dtype),
               "model": "bundled tiny-kjv", "prompt": PROMPT, "naive_vs_cached": gen,
               "paged_vs_contiguous": steps}
    print("wrote", write_results("kv_cache", payload, args.out))


if __name__ == "__main__":
    main()
