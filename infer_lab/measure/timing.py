"""Wall-clock timing that is honest on both CPU and GPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work; CUDA calls return before the work is done."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(
    fn: Callable[[], object],
    repeats: int = 5,
    warmup: int = 1,
    device: torch.device | str | None = None,
) -> float:
    """Median seconds per call of ``fn`` after ``warmup`` untimed calls.

    The median, not the mean: one call interrupted by another process should not move the result.
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
