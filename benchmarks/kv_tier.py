"""What Chapter 13's second KV tier buys: reload an evicted prefix, or recompute it?

For each prefix length L, one engine with a KV tier (files under a temporary folder, on the page
cache in practice, so what ``tier`` pays is hashing and copying, not a disk) times the time to
first token of a prompt of L + 1 tokens three ways, side by side, each the median of ``--repeats``:

- ``recompute``: nothing cached (the pool and the tier empty): the whole prompt is prefilled;
- ``tier``: the prefix's blocks were evicted from the pool to the tier: they are read back,
  checked (SHA-256 of each file) and written into fresh blocks; only the last token is computed;
- ``pool``: the blocks are still in the pool (the floor: nothing to move).

The crossover is the shortest prefix at which ``tier`` beats ``recompute``. A returning
conversation (its earlier turns evicted, a new turn of 16 tokens) is timed with and without the
tier. Bytes per token are the tier's file bytes over the tokens they hold (header included).

    python -m benchmarks.kv_tier [--model smollm2-135m-instruct] [--repeats 5]

writes ``benchmarks/results/kv_tier.json`` with the load average before and after: this machine
is shared, and only ratios taken side by side in one run mean much (the committed file came from
``--repeats 3``; its returning-conversation rows are medians of 3 as well, and noisy).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from statistics import median
from typing import Any

import torch

import infer_lab as il
from benchmarks._common import print_table, provenance, write_results
from infer_lab.cache.kv_tier import block_nbytes
from infer_lab.engine import LLMEngine, SamplingParams
from infer_lab.engine.kv_connector import attach_kv_tier

LENGTHS = (16, 32, 64, 128, 256, 512, 1024)


def ttft(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds from adding ``prompt`` to its first token (the request alone in the engine)."""
    rid = f"r{engine.num_steps}"
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                   ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def evict_all(engine: LLMEngine) -> None:
    """Hand every free block out and back: each named one is evicted (to the tier, if any)."""
    pool = engine.kv.pool
    blocks = pool.get_new_blocks(pool.num_free_blocks)
    pool.free_blocks(blocks)


def forget_tier(engine: LLMEngine) -> None:
    store = engine.kv.tier.store
    for key in list(store._lru):
        store.discard(key)


def measure(engine: LLMEngine, length: int, repeats: int, rng: random.Random,
            vocab: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {"recompute": [], "tier": [], "pool": []}
    for _ in range(repeats):
        prompt = [rng.randrange(3, vocab) for _ in range(length + 1)]
        evict_all(engine)
        forget_tier(engine)
        times["recompute"].append(ttft(engine, prompt))
        times["pool"].append(ttft(engine, prompt))
        evict_all(engine)
        before = engine.kv.tier.reloaded_blocks
        times["tier"].append(ttft(engine, prompt))
        assert engine.kv.tier.reloaded_blocks - before == length // engine.config.block_size
    row: dict[str, Any] = {"prefix_tokens": length}
    for name, values in times.items():
        row[f"{name}_ms"] = 1e3 * median(values)
    row["tier_speedup"] = row["recompute_ms"] / row["tier_ms"]
    return row


def returning_conversation(engine: LLMEngine, turns: int, rng: random.Random, vocab: int,
                           use_tier: bool) -> float:
    """TTFT of the next turn of a conversation whose earlier turns were evicted."""
    history = [rng.randrange(3, vocab) for _ in range(turns * 128)]
    ttft(engine, history + [5])
    evict_all(engine)
    if not use_tier:
        forget_tier(engine)
    return ttft(engine, history + [rng.randrange(3, vocab) for _ in range(16)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="kv_tier")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    model, tok = il.load(args.model, device="cpu", dtype=args.dtype)
    vocab = model.config.vocab_size
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as root:
        engine = LLMEngine(model, tok, num_kv_blocks=160, block_size=16, max_num_seqs=4,
                           max_num_batched_tokens=2048)
        tier = attach_kv_tier(engine, root, capacity_bytes=4 << 30)
        ttft(engine, [rng.randrange(3, vocab) for _ in range(64)])  # warm up
        rows = [measure(engine, n, args.repeats, rng, vocab) for n in LENGTHS]
        convo = []
        for turns in (2, 4, 8):
            without = median(returning_conversation(engine, turns, rng, vocab, False)
                             for _ in range(args.repeats))
            with_tier = median(returning_conversation(engine, turns, rng, vocab, True)
                               for _ in range(args.repeats))
            convo.append({"history_tokens": turns * 128, "ttft_without_ms": 1e3 * without,
                          "ttft_with_tier_ms": 1e3 * with_tier, "speedup": without / with_tier})
        file_bytes = tier.store.bytes_used / max(1, len(tier.store))
        stats = vars(tier.store.stats)
    crossover = next((r["prefix_tokens"] for r in rows if r["tier_ms"] < r["recompute_ms"]),
                     None)
    print_table(rows, ["prefix_tokens", "recompute_ms", "tier_ms", "pool_ms", "tier_speedup"])
    print_table(convo, ["history_tokens", "ttft_without_ms", "ttft_with_tier_ms", "speedup"])
    per_block = block_nbytes(engine.runner.cache)
    payload = {
        "provenance": provenance("cpu"), "model": args.model, "dtype": args.dtype,
        "threads": args.threads, "block_size": 16, "repeats": args.repeats,
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "crossover_prefix_tokens": crossover, "rows": rows, "returning_conversation": convo,
        "bytes_per_token_pool": per_block / 16, "bytes_per_token_tier_file": file_bytes / 16,
        "store_stats": stats,
    }
    print(f"crossover: {crossover} tokens; {per_block / 16:.0f} B/token in the pool, "
          f"{file_bytes / 16:.0f} B/token on disk")
    print("wrote", write_results(args.out, payload))


if __name__ == "__main__":
    main()
