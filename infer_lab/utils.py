"""Small helpers shared by the cache, the engine and the benchmarks (no torch, no model)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` slots ``a`` tokens need."""
    return -(-a // b)


def check_positive_int(name: str, value: object) -> int:
    """``value`` if it is an int >= 1 (bools refused); a clear error naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value
