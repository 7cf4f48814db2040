"""What naming a KV block by a cryptographic digest costs (issue 24): microseconds per block.

The prefix cache names every full block by a key chained from the previous block's key. Three
ways, side by side in one run, at block size 16:

- ``hash()``: the old key, ``(hash(parent), tuple(tokens))``, plus the hash the dict takes of it
  (unseeded, invertible: a client can make two prompts share a block; see ``block_key``);
- ``sha256``: the package's :func:`~infer_lab.cache.block_key` (the token ids packed as
  little-endian uint32 after the parent's 32-byte digest);
- ``blake2b``: the same bytes through BLAKE2b with a 32-byte digest (what a keyed variant would
  cost).

    python -m benchmarks.block_hash [--blocks 20000] [--repeats 7]

prints a table and writes ``benchmarks/results/block_hash.json`` (median of the repeats, with the
load average: the numbers are CPU time of one thread, noisy on a shared machine, and only their
ratios taken side by side mean much). For scale it also times the forward pass (the prefill) of
a 2,048-token prompt on the bundled model, which the keys of its 128 blocks accompany.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import struct
import time
from collections.abc import Callable
from statistics import median

import numpy as np

from infer_lab.cache.block_pool import NONE_KEY, block_key

BLOCK_SIZE = 16


def old_key(parent: object, tokens: list[int]) -> object:
    key = (0 if parent is None else hash(parent), tuple(tokens))
    hash(key)  # what the dict lookup pays
    return key


def blake2b_key(parent: bytes | None, tokens: list[int]) -> bytes:
    data = struct.pack(f"<{len(tokens)}I", *tokens)
    return hashlib.blake2b((NONE_KEY if parent is None else parent) + data,
                           digest_size=32).digest()


def sha256_key(parent: bytes | None, tokens: list[int]) -> bytes:
    key = block_key(parent, tokens)
    hash(key)  # bytes cache their hash; the dict pays this once
    return key


def per_block_us(fn: Callable, blocks: list[list[int]], repeats: int) -> float:
    """Median over ``repeats`` of the time to key the chain of ``blocks``, per block, in µs."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        parent = None
        for tokens in blocks:
            parent = fn(parent, tokens)
        times.append((time.perf_counter() - start) / len(blocks) * 1e6)
    return median(times)


def main() -> None:
    from benchmarks._common import print_table, provenance, write_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 49_152, (args.blocks, BLOCK_SIZE)).tolist()  # SmolLM2's vocabulary
    load_before = os.getloadavg()[0]
    rows = [{"key": name, "us_per_block": round(per_block_us(fn, blocks, args.repeats), 3)}
            for name, fn in (("hash()", old_key), ("sha256", sha256_key),
                             ("blake2b", blake2b_key))]
    base = rows[0]["us_per_block"]
    for row in rows:
        row["vs_hash"] = round(row["us_per_block"] / base, 2)
        # a 2,048-token prompt is 128 full blocks: what naming all of them costs
        row["us_per_2048_token_prompt"] = round(row["us_per_block"] * 2048 / BLOCK_SIZE, 1)
    prefill_ms = prefill_2048_ms(args.repeats)
    for row in rows:
        row["share_of_prefill"] = round(row["us_per_2048_token_prompt"] / 1e3 / prefill_ms, 5)
    print_table(rows, ["key", "us_per_block", "vs_hash", "us_per_2048_token_prompt",
                       "share_of_prefill"])
    print(f"prefill of 2,048 tokens (bundled model, 1 thread): {prefill_ms:.0f} ms")
    write_results("block_hash", {
        **provenance("cpu"), "block_size": BLOCK_SIZE, "blocks": args.blocks,
        "repeats": args.repeats, "load_average_1min": [load_before, os.getloadavg()[0]],
        "rows": rows, "prefill_2048_tokens_ms_bundled_model": round(prefill_ms, 1),
        "command": "python -m benchmarks.block_hash",
    })


def prefill_2048_ms(repeats: int) -> float:
    """Median ms of one forward pass over 2,048 tokens of the bundled model (1 thread)."""
    import torch

    import infer_lab as il

    torch.set_num_threads(1)
    model, _ = il.load(device="cpu")
    ids = torch.randint(0, model.config.vocab_size, (1, 2048))
    times = []
    with torch.inference_mode():
        for _ in range(max(3, repeats // 2)):
            start = time.perf_counter()
            model(ids, last_only=True)
            times.append((time.perf_counter() - start) * 1e3)
    return median(times)


if __name__ == "__main__":
    main()
