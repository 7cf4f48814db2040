"""How much of the KV memory a cache reserves actually holds tokens (Chapter 3's measurement).

A cache *reserves* token slots and *uses* the ones that hold a token's keys and values. The rest is
waste: slots reserved ahead of tokens that may never come (a contiguous cache sized for the longest
possible sequence), or the unfilled tail of a sequence's last block (a paged cache). What matters is
waste over time, so both are summed over every decode step of every running sequence: slot-steps.

The run is *offline* (as in :mod:`infer_lab.measure.workloads`): every request starts at step 0
and adds one token per step until its output is complete, when its memory goes back. During its
step ``t`` (``t = 0 .. output_len - 1``; step 0 is the prefill) a request holds the K/V of
``prompt_len + t`` tokens; the last generated token is never fed back, so it never needs a slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from infer_lab.utils import cdiv


class Request(Protocol):
    """Anything with a prompt and an output length (``infer_lab.measure.RequestSpec`` fits)."""

    @property
    def prompt_len(self) -> int: ...

    @property
    def output_len(self) -> int: ...

Scheme = Literal["max", "pow2", "oracle", "paged"]
SCHEMES: tuple[Scheme, ...] = ("max", "pow2", "oracle", "paged")


@dataclass(frozen=True)
class KVUsage:
    """Slot-steps reserved and slot-steps holding a token, summed over a whole run."""

    scheme: str
    reserved: int
    used: int

    @property
    def utilization(self) -> float:
        """Share of the reserved memory that holds tokens (the vLLM paper's "token states")."""
        return self.used / self.reserved

    @property
    def waste(self) -> float:
        return 1.0 - self.utilization


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n`` >= 1)."""
    return 1 << (n - 1).bit_length()


def reserved_slots(
    scheme: Scheme, held: int, final_len: int, max_len: int | None = None, block_size: int = 16
) -> int:
    """Token slots a sequence holding ``held`` tokens has reserved under ``scheme``.

    - ``"max"``: a contiguous region for the longest sequence the server allows (``max_len``);
    - ``"pow2"``: the final length rounded up to a power of two (a guess that over-reserves by
      up to 2x);
    - ``"oracle"``: exactly the final length, reserved up front (knowing the output length in
      advance, which no server does);
    - ``"paged"``: whole blocks of ``block_size`` slots, allocated as the tokens arrive.
    """
    if not 0 < held <= final_len:
        raise ValueError(f"a sequence holds 1..{final_len} tokens, not {held}")
    if scheme == "max":
        if max_len is None or max_len < final_len:
            raise ValueError(f"max_len must be given and at least {final_len}, got {max_len}")
        return max_len
    if scheme == "pow2":
        return next_pow2(final_len)
    if scheme == "oracle":
        return final_len
    if scheme == "paged":
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        return cdiv(held, block_size) * block_size
    raise ValueError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}")


def kv_usage(
    requests: Sequence[Request],
    scheme: Scheme,
    *,
    block_size: int = 16,
    max_len: int | None = None,
) -> KVUsage:
    """Reserved and used slot-steps of an offline run of ``requests`` under ``scheme``.

    ``max_len`` (for ``"max"``) defaults to the longest sequence in ``requests``, the least a
    contiguous server could have reserved for this workload; pass the server's real limit to
    see what it would reserve.
    """
    if not requests:
        raise ValueError("no requests")
    finals = [r.prompt_len + r.output_len - 1 for r in requests]
    if any(r.prompt_len < 1 or r.output_len < 1 for r in requests):
        raise ValueError("every request needs at least one prompt and one output token")
    if max_len is None:
        max_len = max(finals)
    reserved = used = 0
    for r, final in zip(requests, finals, strict=True):
        for held in range(r.prompt_len, final + 1):  # one step per output token
            reserved += reserved_slots(scheme, held, final, max_len, block_size)
            used += held
    return KVUsage(scheme if scheme != "paged" else f"paged/{block_size}", reserved, used)
