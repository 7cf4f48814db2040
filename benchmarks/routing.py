"""Replicas behind a production router: how much the routing policy changes prefix-cache hits.

Starts copies of ``infer-lab serve`` (the bundled model, CPU) and ``vllm-router``
in front of them, all on loopback, then sends a multi-tenant workload through the router once
per policy: each of T tenants has its own long system prompt, every request is that prompt plus
a short question; each request's tenant is drawn at random (seeded); a fixed concurrency.

Three workloads, all seeded:
- **overflow**: 12 tenants x ~512-token prefixes; one replica's KV pool holds about 8 prefixes
  beside the running requests, so one replica cannot keep every tenant's prefix cached, but two
  replicas can if each tenant always lands on the same one. This is where routing matters.
- **fits**: 4 tenants; every prefix fits every pool, so after the first visits all policies hit
  the cache and converge.
- **wide**: 16 tenants over 4 replicas whose pools hold ~6 prefixes each. Routing that ignores the
  cache finds a tenant's prefix on a replica about as often as that replica's pool holds a share
  of all tenants (pool / tenants); routing that keeps each tenant on one replica needs a pool of
  only tenants / replicas. With 2 replicas that gap is at most 2x; with 4 it is wider.

Per policy: the prefix-cache hit rate (tokens found cached / tokens looked up, summed over the
replicas' ``/metrics`` counters ``infer_lab:prefix_cache_hits`` and ``..._queries``), TTFT
p50/p99 with bootstrap intervals, and output throughput.

    pip install -e '.[scale]'       # vllm-router, a Rust binary in a wheel
    python -m benchmarks.routing    # ~10 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks._common import RESULTS, print_table, provenance, write_results
from benchmarks.serve_sweep import child_process, exit_on_sigterm, free_port, served
from infer_lab.measure.loadgen import Endpoint, run_closed_loop, run_sync
from infer_lab.measure.stats import bootstrap_ci, summarize, ttft
from infer_lab.measure.workloads import RequestSpec
from infer_lab.model.tokenizer import Tokenizer

POLICIES = ("round_robin", "power_of_two", "cache_aware")
BLOCK_SIZE = 16  # the server's default


@dataclass(frozen=True)
class TenantWorkload:
    """``tenants`` system prompts of ~``prefix_tokens`` tokens; each request's tenant is drawn
    at random (seeded).

    Token ids, not text: vllm-router 0.1.17 matches prefixes on token ids, and for a text prompt
    it needs a tokenizer that it would fetch from a model hub; offline it counts the request as
    ``missing_tokens`` and falls back to load balancing, which would make every policy alike.

    Random, not round-robin, order: with tenants sent in turn, an even number of tenants and two
    replicas, round-robin *routing* would send each tenant to the same replica every time by
    accident, and measure a coincidence instead of a policy.
    """

    name: str
    tenants: int
    replicas: int = 2
    num_kv_blocks: int = 320  # per replica: ~8 prefixes of 512 tokens (32 blocks) plus room
    prefix_tokens: int = 512
    question_tokens: int = 24
    output_tokens: int = 16
    requests: int = 384
    seed: int = 0

    def specs(self, vocab_size: int) -> list[RequestSpec]:
        """Token-id prompts: a tenant's fixed prefix, then a fresh question."""
        rng = np.random.default_rng(self.seed)
        prefixes = [rng.integers(300, vocab_size, self.prefix_tokens).tolist()
                    for _ in range(self.tenants)]
        out = []
        for tenant in rng.integers(0, self.tenants, self.requests):
            prompt = prefixes[tenant] + rng.integers(300, vocab_size,
                                                     self.question_tokens).tolist()
            out.append(RequestSpec(len(prompt), self.output_tokens, prompt=prompt))
        return out


WORKLOADS = {
    "overflow": TenantWorkload("overflow", tenants=12),
    "fits": TenantWorkload("fits", tenants=4),
    "wide": TenantWorkload("wide", tenants=16, replicas=4, num_kv_blocks=192),
}


@contextlib.contextmanager
def router(workers: Sequence[str], policy: str, timeout: float = 60.0
           ) -> Iterator[tuple[str, str]]:
    """``vllm-router`` in front of ``workers``; yields its base URL and its metrics URL."""
    exe = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    port, prom = free_port(), free_port()
    cmd = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--worker-urls", *workers, "--log-level", "warning", "--prometheus-port", str(prom)]
    base = f"http://127.0.0.1:{port}"
    with child_process(cmd, f"{base}/v1/models", "vllm-router", timeout):
        yield base, f"http://127.0.0.1:{prom}/metrics"


def prefix_counters(base: str) -> tuple[float, float]:
    """(queries, hits) in tokens from one replica's Prometheus text."""
    text = httpx.get(f"{base}/metrics", timeout=10).text

    def total(name: str) -> float:
        pat = rf"^infer_lab:{name}_total(?:{{[^}}]*}})? ([0-9.e+-]+)$"
        return sum(float(m) for m in re.findall(pat, text, flags=re.M))

    return total("prefix_cache_queries"), total("prefix_cache_hits")


def router_decisions(url: str) -> dict[str, float]:
    """The router's own count of prefix decisions by outcome (hit, miss, missing_tokens)."""
    text = httpx.get(url, timeout=10).text
    pat = r'^vllm_router_prefix_routing_decisions_total\{[^}]*outcome="(\w+)"[^}]*\} ([0-9.e+]+)$'
    out: dict[str, float] = {}
    for outcome, value in re.findall(pat, text, flags=re.M):
        out[outcome] = out.get(outcome, 0.0) + float(value)
    return out


def run_policy(workload: TenantWorkload, specs: list[RequestSpec], policy: str,
               concurrency: int) -> dict[str, Any]:
    replicas = workload.replicas
    args = ["--num-kv-blocks", str(workload.num_kv_blocks),
            "--max-num-seqs", str(concurrency), "--served-model-name", "tiny-kjv"]
    with contextlib.ExitStack() as stack:
        bases = [stack.enter_context(served(args)) for _ in range(replicas)]
        base, router_metrics = stack.enter_context(router(bases, policy))
        endpoint = Endpoint(base_url=base, model="tiny-kjv", ignore_eos=True, timeout=600)
        result = run_sync(run_closed_loop(endpoint, specs, concurrency))
        counters = [prefix_counters(b) for b in bases]
        decisions = router_decisions(router_metrics)
    failed = [r for r in result.results if r.error]
    queries = sum(q for q, _ in counters)
    hits = sum(h for _, h in counters)
    summary = summarize(result.results, result.duration)
    ttfts = np.array([t for r in result.results if (t := ttft(r)) is not None])
    ci = bootstrap_ci(ttfts, ps=(50, 99))
    return {
        "workload": workload.name, "policy": policy, "requests": len(specs),
        "replicas": replicas, "tenants": workload.tenants,
        "failed": len(failed), "errors": sorted({str(r.error) for r in failed})[:3],
        "prefix_hit_rate": hits / queries if queries else float("nan"),
        "prefix_queries_tokens": queries, "prefix_hits_tokens": hits,
        "per_replica_queries": [q for q, _ in counters],
        "router_prefix_decisions": decisions,
        "ttft_p50_ms": float(np.percentile(ttfts, 50)) * 1e3,
        "ttft_p50_ci_ms": [x * 1e3 for x in ci["p50"]],
        "ttft_p99_ms": float(np.percentile(ttfts, 99)) * 1e3,
        "ttft_p99_ci_ms": [x * 1e3 for x in ci["p99"]],
        "output_tok_s": summary.output_throughput,
        "duration_s": result.duration,
    }


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``old`` with ``new``'s workloads replacing its rows of the same workloads."""
    redone = {r["workload"] for r in new["rows"]}
    provenance = old["provenance"] if isinstance(old["provenance"], list) else [old["provenance"]]
    return {
        "provenance": [*provenance, new["provenance"]],
        "setup": {**old["setup"], "workloads": {**old["setup"]["workloads"],
                                                 **new["setup"]["workloads"]}},
        "rows": [r for r in old["rows"] if r["workload"] not in redone] + new["rows"],
        "ratios": {**old["ratios"], **new["ratios"]},
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=None, help="override the workloads' 384")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--out", default=None)
    p.add_argument("--append", action="store_true",
                   help="keep the other workloads' rows already in the JSON (a run per workload)")
    args = p.parse_args(argv)
    exit_on_sigterm()
    from infer_lab.model.loader import resolve_model_path

    vocab = Tokenizer.from_dir(resolve_model_path(None)).vocab_size
    rows = []
    for name in args.workloads:
        wl = WORKLOADS[name]
        if args.requests:
            wl = dataclasses.replace(wl, requests=args.requests)
        specs = wl.specs(vocab)
        for policy in args.policies:
            row = run_policy(wl, specs, policy, args.concurrency)
            rows.append(row)
            print_table([row], ["workload", "policy", "failed", "prefix_hit_rate",
                                "ttft_p50_ms", "ttft_p99_ms", "output_tok_s"])
    by = {(r["workload"], r["policy"]): r for r in rows}
    ratios = {}
    for name in args.workloads:
        rr, ca = by.get((name, "round_robin")), by.get((name, "cache_aware"))
        if rr and ca:
            ratios[name] = {
                "hit_rate_cache_aware_over_round_robin":
                    ca["prefix_hit_rate"] / rr["prefix_hit_rate"] if rr["prefix_hit_rate"]
                    else float("inf"),
                "ttft_p50_round_robin_over_cache_aware": rr["ttft_p50_ms"] / ca["ttft_p50_ms"],
            }
    print()
    print_table(rows, ["workload", "policy", "prefix_hit_rate", "ttft_p50_ms", "ttft_p99_ms",
                       "output_tok_s"])
    print("ratios:", ratios)
    payload = {
        "provenance": provenance("cpu"),
        "setup": {"concurrency": args.concurrency, "block_size": BLOCK_SIZE,
                  "model": "bundled tiny-kjv", "router": "vllm-router 0.1.17",
                  "workloads": {n: WORKLOADS[n].__dict__ for n in args.workloads},
                  "note": "2-core machine shared by the replicas, the router and the client; "
                          "compare policies by ratio, not absolute times"},
        "rows": rows, "ratios": ratios,
    }
    name = args.out or "routing"
    if args.append and (RESULTS / f"{name}.json").is_file():
        payload = merge(json.loads((RESULTS / f"{name}.json").read_text()), payload)
    else:
        payload["provenance"] = [payload["provenance"]]
    path = write_results(name, payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
