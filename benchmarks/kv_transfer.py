"""What moving KV between two engine processes over TCP costs, against recomputing it.

Two processes on this machine, each one thread and pinned to its own core (``taskset``): a
*sender* engine that prefills a prompt and holds its blocks
(:class:`~infer_lab.engine.kv_transfer.KVTransferServer`), and a *receiver* engine that, at
several prompt lengths, either

- ``recompute``: prefills the whole prompt itself (time to first token), or
- ``transfer``: pulls the blocks over loopback TCP (the full ones and the partial last one),
  writes them into its own pool, and computes only the last prompt token (pull + inject + first
  token), with ``pull`` alone beside it;
- ``transfer_full``: the same with the full blocks only (the tokens of the partial last block
  computed here, as before the partial block travelled), to show what sending it saves.

Bytes per token are the payload bytes over the token slots of the blocks sent (a partial block
is sent whole). Medians of ``--repeats``; the
load average is recorded before and after (the machine is shared: ratios side by side only).

    python -m benchmarks.kv_transfer [--model smollm2-135m-instruct] [--repeats 5]
        [--lengths 64 128 256 512 1024] [--out kv_transfer]

writes ``benchmarks/results/kv_transfer.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from statistics import median
from typing import Any

import torch

import infer_lab as il
from benchmarks._common import print_table, provenance, write_results
from infer_lab.engine import LLMEngine, SamplingParams
from infer_lab.engine.kv_connector import engine_namespace, inject_blocks, stage_partial_block
from infer_lab.engine.kv_transfer import KVTransferServer, pull_blocks, release_blocks

LENGTHS = (64, 128, 256, 512, 1024)
TOKEN = "bench"


def prompt_for(length: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed * 100_003 + length)
    return [rng.randrange(3, vocab) for _ in range(length)]


def first_token(engine: LLMEngine, prompt: list[int], rid: str) -> None:
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                   ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def make_engine(model_name: str, dtype: str) -> LLMEngine:
    model, tok = il.load(model_name, device="cpu", dtype=dtype)
    return LLMEngine(model, tok, num_kv_blocks=200, block_size=16, max_num_seqs=4,
                     max_num_batched_tokens=2048)


def evict_all(engine: LLMEngine) -> None:
    pool = engine.kv.pool
    pool.free_blocks(pool.get_new_blocks(pool.num_free_blocks))


def sender(args: argparse.Namespace) -> None:
    """The sender process: prefill what stdin names, holding its blocks as it finishes; print
    the block ids (the partial last one, if any, last) and how many are full."""
    torch.set_num_threads(1)
    engine = make_engine(args.model, args.dtype)
    server = KVTransferServer(engine, TOKEN, pin_timeout_s=120)
    print(json.dumps({"port": server.port}), flush=True)
    vocab = engine.model.config.vocab_size
    for line in sys.stdin:
        length, seed = map(int, line.split())
        server.poll()
        evict_all(engine)
        prompt = prompt_for(length, seed, vocab)
        rid = f"p{length}-{seed}"
        server.expect(rid)
        first_token(engine, prompt, rid)
        pinned = server.pinned(rid)
        print(json.dumps({"request_id": rid, "block_ids": pinned.block_ids,
                          "full": len(pinned.keys)}), flush=True)


def receiver(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    cores = sorted(os.sched_getaffinity(0))
    pin = len(cores) >= 2
    cmd = [sys.executable, "-m", "benchmarks.kv_transfer", "--sender", "--model", args.model,
           "--dtype", args.dtype]
    if pin:
        cmd = ["taskset", "-c", str(cores[0]), *cmd]
        os.sched_setaffinity(0, {cores[1]})
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    engine = make_engine(args.model, args.dtype)
    port = json.loads(proc.stdout.readline())["port"]
    vocab, ns = engine.model.config.vocab_size, engine_namespace(engine)
    rows = []
    cpu0 = time.process_time()
    for length in args.lengths:
        times: dict[str, list[float]] = {"recompute": [], "transfer": [], "pull": [],
                                         "transfer_full": []}
        nbytes = blocks = computed = 0
        for seed in range(args.repeats):
            prompt = prompt_for(length, seed, vocab)
            proc.stdin.write(f"{length} {seed}\n")
            proc.stdin.flush()
            reply = json.loads(proc.stdout.readline())
            rid, ids, full = reply["request_id"], reply["block_ids"], reply["full"]
            evict_all(engine)
            t0 = time.perf_counter()
            first_token(engine, prompt, f"rc{length}-{seed}")
            times["recompute"].append(time.perf_counter() - t0)
            evict_all(engine)
            hits = engine.kv.prefix_hits
            t0 = time.perf_counter()
            got = pull_blocks("127.0.0.1", port, TOKEN, rid, ids, ns)
            times["pull"].append(time.perf_counter() - t0)
            assert inject_blocks(engine, prompt, got.blocks) == full
            if got.tail is not None:
                req = f"tx{length}-{seed}"
                assert stage_partial_block(engine, req, prompt, full, got.tail)
            first_token(engine, prompt, f"tx{length}-{seed}")
            times["transfer"].append(time.perf_counter() - t0)
            computed = length - (engine.kv.prefix_hits - hits)
            evict_all(engine)
            t0 = time.perf_counter()  # the full blocks only: the partial one computed here
            got_full = pull_blocks("127.0.0.1", port, TOKEN, rid, ids[:full], ns)
            assert inject_blocks(engine, prompt, got_full.blocks) == full
            first_token(engine, prompt, f"tf{length}-{seed}")
            times["transfer_full"].append(time.perf_counter() - t0)
            release_blocks("127.0.0.1", port, TOKEN, rid)
            nbytes, blocks = got.nbytes, len(ids)
        row: dict[str, Any] = {"prompt_tokens": length, "blocks": blocks,
                               "full_blocks": full, "computed_after_transfer": computed,
                               "bytes_per_token": nbytes / max(1, blocks * 16)}
        for name, values in times.items():
            row[f"{name}_ms"] = 1e3 * median(values)
        row["pull_us_per_token"] = 1e3 * row["pull_ms"] / max(1, blocks * 16)
        row["recompute_us_per_token"] = 1e3 * row["recompute_ms"] / length
        row["speedup"] = row["recompute_ms"] / row["transfer_ms"]
        row["partial_block_saving"] = row["transfer_full_ms"] / row["transfer_ms"]
        rows.append(row)
    receiver_cpu = time.process_time() - cpu0
    proc.stdin.close()
    proc.wait(timeout=60)
    print_table(rows, ["prompt_tokens", "recompute_ms", "transfer_ms", "transfer_full_ms",
                       "pull_ms", "computed_after_transfer", "bytes_per_token",
                       "pull_us_per_token", "speedup", "partial_block_saving"])
    payload = {"provenance": provenance("cpu"), "model": args.model, "dtype": args.dtype,
               "repeats": args.repeats, "pinned_to_cores": pin, "threads_per_process": 1,
               "receiver_cpu_seconds": receiver_cpu,
               "load_average_before": load_before, "load_average_after": os.getloadavg(),
               "rows": rows}
    print("wrote", write_results(args.out, payload))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--out", default="kv_transfer")
    parser.add_argument("--sender", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    (sender if args.sender else receiver)(args)


if __name__ == "__main__":
    main()
