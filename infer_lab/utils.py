"""Small helpers shared by the cache, the engine and the benchmarks (no torch, no model)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


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


def renamed_keyword(old: str, new: str) -> Callable[[F], F]:
    """Keep a renamed keyword argument working: ``old=`` still does, with a DeprecationWarning
    that names ``new``. Positional calls pass straight through."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"{fn.__qualname__}() got both {old}= and {new}=")
                warnings.warn(f"{fn.__qualname__}({old}=...) is deprecated: use {new}=",
                              DeprecationWarning, stacklevel=2)
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap
