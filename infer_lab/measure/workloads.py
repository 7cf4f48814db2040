"""The named, seeded workloads of DESIGN.md, so that no result can be tuned by picking inputs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Request:
    """One request of a workload: lengths in tokens and an arrival time in seconds."""

    prompt_len: int
    output_len: int
    arrival: float = 0.0


def _pareto(rng: np.random.Generator, alpha: float, scale: float, cap: int, n: int) -> np.ndarray:
    """⌊scale · Pareto(alpha)⌋ (classic Pareto, minimum 1) capped at ``cap``."""
    return np.minimum(np.floor(scale * (1.0 + rng.pareto(alpha, n))), cap).astype(int)


def long_tail_mix(
    n: int = 128, seed: int = 0, rate: float | None = None, burstiness: float = 1.0
) -> list[Request]:
    """DESIGN.md's *long-tail mix*: many short requests and a few very long ones.

    Prompt ⌊8·Pareto(1.5)⌋ capped at 512, output ⌊12·Pareto(1.2)⌋ capped at 256. With ``rate``
    (requests/s), arrivals are a gamma process with that mean rate (Poisson when ``burstiness``
    is 1); without it everything arrives at t = 0 (the offline, throughput setting).
    """
    rng = np.random.default_rng(seed)
    prompts = _pareto(rng, 1.5, 8, 512, n)
    outputs = _pareto(rng, 1.2, 12, 256, n)
    arrivals = arrival_times(n, rate, burstiness, rng) if rate else np.zeros(n)
    return [Request(int(p), int(o), float(t)) for p, o, t in zip(prompts, outputs, arrivals)]


def nano_vllm_offline(n: int = 256, seed: int = 0, lo: int = 100, hi: int = 1024) -> list[Request]:
    """DESIGN.md's *nano-vllm offline*: input and output lengths uniform in [lo, hi], at t = 0."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(lo, hi + 1, n)
    outputs = rng.integers(lo, hi + 1, n)
    return [Request(int(p), int(o)) for p, o in zip(prompts, outputs)]


def arrival_times(
    n: int, rate: float, burstiness: float = 1.0, rng: np.random.Generator | None = None
) -> np.ndarray:
    """Arrival times of a gamma renewal process with mean rate ``rate`` (Poisson at burstiness 1).

    Lower burstiness means burstier traffic at the same mean rate (as in vLLM's ``bench serve``).
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    rng = rng or np.random.default_rng(0)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return np.cumsum(gaps) - gaps[0]
