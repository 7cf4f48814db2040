"""Colocated against disaggregated serving, as a small discrete-event simulation (Chapter 10).

Two machines' worth of work: either two servers that each prefill and decode (a prefill stalls
every running stream for its whole duration), or one prefill server feeding one decode server
through a KV transfer. Step costs are inputs (a prefill's seconds, a decode step's fixed and
per-sequence seconds), so the chapter can feed in what it measured on the bundled model.

Every request yields one TTFT and ``out_len - 1`` inter-token gaps. In split mode the gap
between token 1 (made by the prefill server) and token 2 (made by the decode server) spans the
KV transfer and any wait for the decode server; it counts like any other gap, or the split
mode's ITL tail would leave out exactly the gap that the split adds.

:func:`simulate` draws Poisson arrivals of one request shape; :func:`simulate_requests` takes
given arrivals and a prefill cost and output length per request, so a mixed workload (long
prompts among short chats, Chapter 13) runs through the same event loop, and returns each
request's TTFT and gaps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def simulate(rate: float, split: bool, *, prefill_s: float, step_s: float, per_seq_s: float,
             out_len: int = 64, n: int = 2000, transfer_s: float = 0.002,
             seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """TTFT and per-token gaps (s) of ``n`` Poisson arrivals at ``rate`` on two servers."""
    if rate <= 0 or n < 1 or out_len < 2:
        raise ValueError("need rate > 0, n >= 1 and out_len >= 2")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    ttft, gaps, _, _ = _simulate(arrivals, split, np.full(n, prefill_s), np.full(n, out_len),
                                 step_s, per_seq_s, transfer_s)
    return np.array(ttft), np.array(gaps)


def simulate_requests(arrivals: Sequence[float] | np.ndarray, split: bool, *,
                      prefill_s: float | Sequence[float] | np.ndarray,
                      out_len: int | Sequence[int] | np.ndarray, step_s: float,
                      per_seq_s: float,
                      transfer_s: float = 0.002) -> tuple[np.ndarray, list[np.ndarray]]:
    """Each request's TTFT and its gaps (s), for given arrival times and per-request shapes.

    ``prefill_s`` and ``out_len`` are one value for all or one per request. Colocated, the two
    servers take the requests alternately in arrival order (a round-robin router). Returns the
    TTFTs in the order of ``arrivals`` and a list of each request's ``out_len - 1`` gaps.
    """
    t = np.asarray(arrivals, dtype=float)
    n = len(t)
    if n < 1 or np.any(np.diff(t) < 0) or np.any(t < 0):
        raise ValueError("arrivals: need at least one, not negative, in increasing order")
    prefill = np.broadcast_to(np.asarray(prefill_s, dtype=float), (n,))
    out = np.broadcast_to(np.asarray(out_len, dtype=int), (n,))
    if np.any(prefill < 0) or np.any(out < 2):
        raise ValueError("need prefill_s >= 0 and out_len >= 2 for every request")
    ttft, gaps, ttft_of, gap_of = _simulate(t, split, prefill, out, step_s, per_seq_s,
                                            transfer_s)
    by_request = np.empty(n)
    by_request[ttft_of] = ttft
    owner, values = np.asarray(gap_of), np.asarray(gaps)
    return by_request, [values[owner == i] for i in range(n)]


def _simulate(arrivals: np.ndarray, split: bool, prefill: np.ndarray, out: np.ndarray,
              step_s: float, per_seq_s: float, transfer_s: float,
              ) -> tuple[list[float], list[float], list[int], list[int]]:
    """TTFTs and gaps in the order they happen, and the request each belongs to."""
    n = len(arrivals)
    ttft: list[float] = []
    gaps: list[float] = []
    ttft_of: list[int] = []
    gap_of: list[int] = []
    ids = np.arange(n)
    if split:  # server 0 prefills in arrival order, server 1 decodes all it is given
        first, free = [], 0.0
        for t, p in zip(arrivals, prefill, strict=True):
            free = max(free, t) + p
            first.append(free)
            ttft.append(free - t)
        ttft_of += ids.tolist()
        first_token = np.array(first)
        servers = [(ids, first_token + transfer_s, np.zeros(n, bool), first_token)]
    else:  # each server takes every other request, prefill and decode interleaved
        servers = [(ids[i::2], arrivals[i::2], np.ones(len(ids[i::2]), bool), None)
                   for i in (0, 1)]
    for who, start, needs_prefill, first_token in servers:
        _run_server(start, needs_prefill, first_token, prefill[who], step_s, per_seq_s,
                    out[who], ttft, gaps, who, ttft_of, gap_of)
    return ttft, gaps, ttft_of, gap_of


def _run_server(start: np.ndarray, needs_prefill: np.ndarray, first_token: np.ndarray | None,
                prefill: np.ndarray, step_s: float, per_seq_s: float, out: np.ndarray,
                ttft: list[float], gaps: list[float], who: np.ndarray, ttft_of: list[int],
                gap_of: list[int]) -> None:
    """One server's event loop: admit what has arrived, else run one decode step."""
    clock, queue, running = 0.0, list(range(len(start))), {}
    while queue or running:
        if queue and not running:
            clock = max(clock, start[queue[0]])
        if queue and start[queue[0]] <= clock:
            i = queue.pop(0)
            if needs_prefill[i]:  # the prefill stalls every running stream
                clock += prefill[i]
                ttft.append(clock - start[i])
                ttft_of.append(int(who[i]))
            # the previous token's time: now, or when the prefill server made token 1
            last = clock if first_token is None else first_token[i]
            running[i] = [out[i] - 1, last]
            continue
        clock += step_s + per_seq_s * len(running)
        for i in list(running):
            left, last = running[i]
            gaps.append(clock - last)
            gap_of.append(int(who[i]))
            running[i] = [left - 1, clock]
            if left == 1:
                del running[i]
