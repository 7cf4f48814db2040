"""Colocated against disaggregated serving, as a small discrete-event simulation (Chapter 10).

Two machines' worth of work: either two servers that each prefill and decode (a prefill stalls
every running stream for its whole duration), or one prefill server feeding one decode server
through a KV transfer. Step costs are inputs (a prefill's seconds, a decode step's fixed and
per-sequence seconds), so the chapter can feed in what it measured on the bundled model.

Every request yields one TTFT and ``out_len - 1`` inter-token gaps. In split mode the gap
between token 1 (made by the prefill server) and token 2 (made by the decode server) spans the
KV transfer and any wait for the decode server; it counts like any other gap, or the split
mode's ITL tail would leave out exactly the gap that the split adds.
"""

from __future__ import annotations

import numpy as np


def simulate(rate: float, split: bool, *, prefill_s: float, step_s: float, per_seq_s: float,
             out_len: int = 64, n: int = 2000, transfer_s: float = 0.002,
             seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """TTFT and per-token gaps (s) of ``n`` Poisson arrivals at ``rate`` on two servers."""
    if rate <= 0 or n < 1 or out_len < 2:
        raise ValueError("need rate > 0, n >= 1 and out_len >= 2")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    ttft: list[float] = []
    gaps: list[float] = []
    if split:  # server 0 prefills in arrival order, server 1 decodes all it is given
        first, free = [], 0.0
        for t in arrivals:
            free = max(free, t) + prefill_s
            first.append(free)
            ttft.append(free - t)
        first_token = np.array(first)
        servers = [(first_token + transfer_s, np.zeros(n, bool), first_token)]
    else:  # each server takes every other request, prefill and decode interleaved
        servers = [(arrivals[i::2], np.ones(len(arrivals[i::2]), bool), None) for i in (0, 1)]
    for start, needs_prefill, first_token in servers:
        _run_server(start, needs_prefill, first_token, prefill_s, step_s, per_seq_s, out_len,
                    ttft, gaps)
    return np.array(ttft), np.array(gaps)


def _run_server(start: np.ndarray, needs_prefill: np.ndarray, first_token: np.ndarray | None,
                prefill_s: float, step_s: float, per_seq_s: float, out_len: int,
                ttft: list[float], gaps: list[float]) -> None:
    """One server's event loop: admit what has arrived, else run one decode step."""
    clock, queue, running = 0.0, list(range(len(start))), {}
    while queue or running:
        if queue and not running:
            clock = max(clock, start[queue[0]])
        if queue and start[queue[0]] <= clock:
            i = queue.pop(0)
            if needs_prefill[i]:  # the prefill stalls every running stream
                clock += prefill_s
                ttft.append(clock - start[i])
            # the previous token's time: now, or when the prefill server made token 1
            last = clock if first_token is None else first_token[i]
            running[i] = [out_len - 1, last]
            continue
        clock += step_s + per_seq_s * len(running)
        for i in list(running):
            left, last = running[i]
            gaps.append(clock - last)
            running[i] = [left - 1, clock]
            if left == 1:
                del running[i]
