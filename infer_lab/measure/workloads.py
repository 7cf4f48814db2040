"""The named, seeded workloads of the book, and the one request type they are made of.

A result is only as honest as its inputs: every benchmark and chapter draws its requests from one
of these seeded generators, so nobody can tune a number by picking the requests that flatter it.

- **long-tail mix** (:func:`long_tail_mix`): many short requests and a few very long ones, the
  shape of chat traffic. Prompt lengths ⌊8·Pareto(1.5)⌋ capped at 512, output lengths
  ⌊12·Pareto(1.2)⌋ capped at 256 (:data:`LONG_TAIL`). Offline (all at t = 0) or with Poisson or
  gamma arrivals at a given rate. Chapters 3 and 5 and the batching benchmark use it.
- **nano-vllm offline** (:func:`nano_vllm_offline`): 256 requests with input and output lengths
  uniform in [100, 1024], all at t = 0, the offline throughput benchmark of nano-vllm, so that
  figures can be set beside its published ones.
- **random** (``infer-lab bench --dataset random``): fixed (or ± a ratio) input and output lengths,
  as vLLM's ``bench serve`` makes them; built in :mod:`infer_lab.measure.bench`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: its lengths in tokens, when it arrives, and what it says.

    ``arrival`` (seconds after the run starts) matters only in an open-loop run. ``prompt`` (token
    ids or text) is what the load generator sends; a workload that only fixes the shape (the
    KV-waste count, the engine's batching benchmark) leaves it ``None``.
    """

    prompt_len: int
    output_len: int
    arrival: float = 0.0
    prompt: list[int] | str | None = None

    def __post_init__(self) -> None:
        if self.prompt_len < 0 or self.output_len < 1:
            raise ValueError(f"a request needs prompt_len >= 0 and output_len >= 1, not "
                             f"({self.prompt_len}, {self.output_len})")


@dataclass(frozen=True)
class ParetoLengths:
    """Lengths ⌊scale · Pareto(alpha)⌋ (classic Pareto, at least ``scale``) capped at ``cap``."""

    alpha: float
    scale: float
    cap: int

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.minimum(np.floor(self.scale * (1.0 + rng.pareto(self.alpha, n))),
                          self.cap).astype(int)

    def __str__(self) -> str:
        return f"⌊{self.scale:g}·Pareto({self.alpha:g})⌋≤{self.cap}"


@dataclass(frozen=True)
class LongTail:
    """The long-tail mix's two length distributions, the one place their constants live."""

    prompt: ParetoLengths = ParetoLengths(1.5, 8, 512)
    output: ParetoLengths = ParetoLengths(1.2, 12, 256)

    @property
    def max_len(self) -> int:
        """The longest sequence the mix can make (prompt cap + output cap): 768."""
        return self.prompt.cap + self.output.cap

    def __str__(self) -> str:
        return f"long-tail mix (prompt {self.prompt}, output {self.output})"


LONG_TAIL = LongTail()


def long_tail_mix(
    n: int = 128, seed: int = 0, rate: float | None = None, burstiness: float = 1.0
) -> list[RequestSpec]:
    """The *long-tail mix*: many short requests and a few very long ones (see :data:`LONG_TAIL`).

    With ``rate`` (requests/s), arrivals are a gamma process with that mean rate (Poisson when
    ``burstiness`` is 1); without it everything arrives at t = 0 (the offline, throughput setting).
    """
    rng = np.random.default_rng(seed)
    prompts = LONG_TAIL.prompt.draw(rng, n)
    outputs = LONG_TAIL.output.draw(rng, n)
    arrivals = arrival_times(n, rate, burstiness, rng) if rate else np.zeros(n)
    return [RequestSpec(int(p), int(o), float(t)) for p, o, t in zip(prompts, outputs, arrivals)]


def nano_vllm_offline(
    n: int = 256, seed: int = 0, lo: int = 100, hi: int = 1024
) -> list[RequestSpec]:
    """The *nano-vllm offline* workload: input and output lengths uniform in [lo, hi], at t = 0."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(lo, hi + 1, n)
    outputs = rng.integers(lo, hi + 1, n)
    return [RequestSpec(int(p), int(o)) for p, o in zip(prompts, outputs)]


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
