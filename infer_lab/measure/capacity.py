"""From a sweep and an SLO to a capacity answer and a price: replicas, and $ per million tokens.

A capacity answer read off point estimates flips with the noise: a p99 that rests on three
requests can pass at C = 32 and fail at C = 16. So a load *meets* the SLO here only if the
**upper bound** of its p99's confidence interval does (by default the time-block interval, which
keeps the requests one stall slowed together; an interval over independent requests is too
narrow when they are not), and a replica's capacity is the highest load of the unbroken run of
passing loads from the lightest up (a pass above a failure is not trusted). Cost then follows
from goodput:

    $ per million output tokens = $/hour ÷ (goodput tokens/s × 3600) × 10⁶

with the hourly prices of :data:`PRICES`, which are assumptions (stated with their date), not
quotes. For GPUs this machine has not measured, :func:`roofline_rate` gives the ceiling that
Chapter 1's roofline allows, so a projected cost is a floor: real kernels reach less.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from infer_lab.cache.sizing import kv_bytes_per_token
from infer_lab.measure.flops import step_bytes, step_flops
from infer_lab.measure.hardware import Hardware
from infer_lab.model.config import ModelConfig

PRICES_DATE = "2026-12-01"
# Assumed on-demand prices, USD per hour for one device (a GPU with its share of the host, or a
# whole small CPU VM), rounded from public cloud list prices as the authors last saw them; not
# fetched, not a quote. Replace them with your own before deciding anything.
PRICES: dict[str, float] = {
    "cpu-2vcpu": 0.07,
    "T4": 0.35,
    "L4": 0.80,
    "A100-80GB": 1.80,
    "H100-SXM": 3.00,
    "H200-SXM": 3.80,
}


def cost_per_million_tokens(usd_per_hour: float, tokens_per_s: float) -> float:
    """$ per 10⁶ tokens: the hourly price over the tokens an hour produces. inf at 0 tokens/s."""
    if usd_per_hour < 0 or tokens_per_s < 0 or math.isnan(tokens_per_s):
        raise ValueError("price and rate must be non-negative numbers")
    if tokens_per_s == 0:
        return math.inf
    return usd_per_hour / (tokens_per_s * 3600) * 1e6


INTERVALS = {"block": "ci_block", "requests": "ci"}  # which stored interval: its key in a point


def _value(point: Mapping[str, Any], key: str, bound: str, interval: str) -> float | None:
    """The point estimate, or the CI's upper bound (``bound="upper"``), of ``key`` in seconds."""
    if bound == "upper":
        ci = (point.get(INTERVALS[interval]) or {}).get(key)
        if ci is None or ci[1] is None:
            raise ValueError(f"point at load {point.get('load')} has no {interval} interval for "
                             f"{key}: re-run it with a bench that stores one (or, for a sweep "
                             "measured before, python -m benchmarks.serve_sweep --reanalyse)")
        return float(ci[1])
    value = point["metrics"].get(key)
    return None if value is None else float(value)


def meets(point: Mapping[str, Any], slo_p99: Mapping[str, float], bound: str = "upper",
          interval: str = "block") -> bool:
    """Every ``metric.p99`` (seconds, e.g. ``{"ttft": 0.25}``) within its bound at this point.

    ``bound="upper"`` judges the upper end of the p99's confidence interval, ``"point"`` the
    estimate itself. ``interval``: ``"block"`` (time-block bootstrap, ``ci_block``) or
    ``"requests"`` (bootstrap over requests, ``ci``). A point with failed requests never meets
    an SLO.
    """
    if bound not in ("upper", "point"):
        raise ValueError("bound must be 'upper' or 'point'")
    if interval not in INTERVALS:
        raise ValueError(f"interval must be one of {', '.join(INTERVALS)}")
    if point["metrics"].get("failed", 0):
        return False
    for metric, limit in slo_p99.items():
        v = _value(point, f"{metric}.p99", bound, interval)
        if v is None or v > limit:
            return False
    return True


@dataclass(frozen=True)
class Capacity:
    """The answer: per-replica rate at the SLO, the load it was measured at, and the replicas."""

    passing: tuple[bool, ...]  # per load point, lightest first
    load: float | None  # the heaviest trusted passing load; None if the lightest fails
    rate: float | None  # requests/s one replica carries there
    goodput_tokens: float | None  # output tokens/s of SLO-meeting requests there
    replicas: int | None  # for the target rate; None if no load meets the SLO
    monotone: bool  # passes form one unbroken run from the lightest load (the answer is stable)


def capacity(points: Sequence[Mapping[str, Any]], slo_p99: Mapping[str, float],
             target_rps: float, bound: str = "upper", interval: str = "block") -> Capacity:
    """Replicas needed for ``target_rps`` at the SLO, from a sweep's points (lightest first).

    The per-replica capacity is the throughput of the heaviest load in the unbroken run of
    passing loads that starts at the lightest; ``monotone`` says whether any load above the
    first failure passed again (then N per point was too small for a stable answer).
    """
    if target_rps <= 0:
        raise ValueError("target_rps must be positive")
    order = sorted(range(len(points)), key=lambda i: float(points[i]["load"]))
    passing = tuple(meets(points[i], slo_p99, bound, interval) for i in order)
    run = 0
    while run < len(passing) and passing[run]:
        run += 1
    monotone = not any(passing[run:])
    if run == 0:
        return Capacity(passing, None, None, None, None, monotone)
    best = points[order[run - 1]]
    m = best["metrics"]
    rate = float(m["request_throughput"])
    tokens = goodput_tokens(best)
    return Capacity(passing, float(best["load"]), rate, tokens,
                    math.ceil(target_rps / rate - 1e-9), monotone)


def goodput_tokens(point: Mapping[str, Any]) -> float:
    """Output tokens/s of the requests that met the run's SLO (all of them, without an SLO)."""
    m = point["metrics"]
    if "goodput_tokens" in m:
        return float(m["goodput_tokens"])
    if "goodput" in m and m.get("request_throughput"):
        # fixed output lengths: the SLO-meeting share of the output throughput
        return float(m["output_throughput"]) * float(m["goodput"]) / float(m["request_throughput"])
    return float(m["output_throughput"])


@dataclass(frozen=True)
class RooflineRate:
    """What the roofline allows one device: batch, step time, rates; ``fits`` False if not.

    ``step_s`` is the floor of one steady-state step *with its share of prefills in it*; every
    running sequence gets one token per step, so it is also the time between a sequence's tokens
    (its TPOT): ``batch / tokens_per_s == step_s`` and ``step_s <= tpot_bound``.
    """

    gpu: str
    fits: bool
    batch: int
    step_s: float
    requests_per_s: float
    tokens_per_s: float
    limit: str  # what stopped the batch from growing: "memory", "tpot" or "max_batch"
    prefill_tokens_per_step: float = 0.0  # prompt tokens each step carries on average
    chunked_prefill: bool = True


def steady_step_s(cfg: ModelConfig, gpu: Hardware, batch: int, prompt_len: int,
                  output_len: int, dtype_bytes: int = 2, chunked_prefill: bool = True) -> float:
    """The floor of one steady-state step of ``batch`` decoding sequences, prefills counted.

    In steady state ``batch / output_len`` requests finish per step, so as many new prompts must
    be prefilled per step. With ``chunked_prefill`` they ride in the decode step (as vLLM runs
    them): one step does both works, at max(bytes ÷ bandwidth, FLOPs ÷ peak) of the sum, so a
    prefill's arithmetic fills the idle compute of a bandwidth-bound decode. Without, each
    prefill is a step of its own that every running sequence waits for: the decode step's floor
    plus the prefills' floors. Decode attends over the mean context ``prompt_len +
    output_len // 2``; bytes are the least a step must move (each weight once per step).
    """
    share = batch / output_len  # prefills per step, on average
    context = prompt_len + output_len // 2
    bw, peak = gpu.bandwidth_gbs * 1e9, gpu.tflops_16bit * 1e12
    d_bytes = step_bytes(cfg, batch, 1, context, dtype_bytes)
    d_flops = step_flops(cfg, batch, 1, context)
    # a prompt's own bytes beyond the weights: its embedding rows read, its K/V written
    p_bytes = prompt_len * (kv_bytes_per_token(cfg, dtype_bytes) + cfg.hidden_size * dtype_bytes)
    p_flops = step_flops(cfg, 1, prompt_len, 0)
    if chunked_prefill:
        return max((d_bytes + share * p_bytes) / bw, (d_flops + share * p_flops) / peak)
    # a prefill step of its own reads every weight as well as its own bytes
    prefill = max(step_bytes(cfg, 1, prompt_len, 0, dtype_bytes) / bw, p_flops / peak)
    return max(d_bytes / bw, d_flops / peak) + share * prefill


def roofline_rate(cfg: ModelConfig, gpu: Hardware, prompt_len: int, output_len: int,
                  tpot_bound: float, dtype_bytes: int = 2, memory_fraction: float = 0.9,
                  max_batch: int = 1024, chunked_prefill: bool = True) -> RooflineRate:
    """The most output tokens/s one ``gpu`` can give this request shape within a TPOT bound.

    The batch B grows until the steady-state step (:func:`steady_step_s`: B decodes *and* the
    B ÷ ``output_len`` prefills that keep B running) passes ``tpot_bound``, the KV cache of B
    full sequences no longer fits beside the weights in ``memory_fraction`` of the memory
    (``gpu.memory_gb`` read as GiB: the datasheet's figure, an upper bound), or ``max_batch``.
    Then tokens/s = B ÷ step and requests/s = that ÷ ``output_len``. Datasheet peaks: a
    ceiling, never a prediction of what real kernels reach.

    Checking the bound on a decode step alone and charging the prefills afterwards breaks it:
    Llama-3-8B on an A100 at 512 in / 128 out, 25 ms, would run 475 sequences whose tokens come
    ~110 ms apart once the prefills are counted.
    """
    if prompt_len < 1 or output_len < 1 or tpot_bound <= 0 or not 0 < memory_fraction <= 1:
        raise ValueError("need prompt_len, output_len >= 1, tpot_bound > 0, memory_fraction "
                         "in (0, 1]")
    weights = cfg.num_parameters() * dtype_bytes  # stored; a step reads all but the embedding
    free = gpu.memory_gb * 2**30 * memory_fraction - weights
    per_seq = (prompt_len + output_len) * kv_bytes_per_token(cfg, dtype_bytes)
    mem_batch = int(free // per_seq) if free > 0 else 0

    def step(b: int) -> float:
        return steady_step_s(cfg, gpu, b, prompt_len, output_len, dtype_bytes, chunked_prefill)

    if mem_batch < 1:
        return RooflineRate(gpu.name, False, 0, math.nan, 0.0, 0.0, "memory",
                            chunked_prefill=chunked_prefill)
    top = min(mem_batch, max_batch)
    limit = "memory" if mem_batch < max_batch else "max_batch"
    if step(top) <= tpot_bound:
        batch = top
    else:  # the step grows with the batch: the largest batch within the bound, by bisection
        limit, lo, hi = "tpot", 0, top  # step(lo) within the bound (or lo = 0), step(hi) not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if step(mid) <= tpot_bound else (lo, mid)
        batch = lo
    if batch == 0:
        return RooflineRate(gpu.name, True, 0, step(1), 0.0, 0.0, "tpot",
                            chunked_prefill=chunked_prefill)
    t = step(batch)
    return RooflineRate(gpu.name, True, batch, t, batch / (t * output_len), batch / t, limit,
                        batch * prompt_len / output_len, chunked_prefill)
