"""Counting the aten ops a piece of code dispatches: the unit of per-op overhead on a CPU, and
of kernel launches on a GPU (every op a launch, bar views)."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class CountOps(TorchDispatchMode):
    """``with CountOps() as c: ...`` then ``c.n``: every op torch dispatched inside, views too."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),  # noqa: ANN401
                           kwargs: Any = None) -> Any:  # noqa: ANN401
        self.n += 1
        return func(*args, **(kwargs or {}))
