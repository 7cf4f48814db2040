"""Small helpers the chapters share, so their set-up cells stay two lines long."""

from __future__ import annotations

from typing import Any, TypeVar

import torch

T = TypeVar("T")


def on_gpu() -> bool:
    return torch.cuda.is_available()


def pick(cpu: T, gpu: T) -> T:
    """The CPU size or the GPU size of an experiment: one notebook, run unchanged on both."""
    return gpu if on_gpu() else cpu


class _Formatted:
    """Shows as its text: a glued *string* would otherwise appear in the prose with quotes."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def glue(name: str, value: Any, fmt: str | None = None) -> None:
    """Hand a computed value to the book's prose (myst-nb ``glue``).

    It returns nothing on purpose: a cell that ends in ``glue(...)`` must not print the value a
    second time as the cell's result (a stray ``np.float64(60.75...)`` under the cell).

    Outside a book build (Colab, a plain Jupyter: no myst-nb) it prints ``name = value``: the
    notebook's prose names the value (``scripts/sync_notebooks.py`` writes ```name``` where the
    book shows the number), and the number is right there under the cell.
    """
    if fmt:
        shown: Any = _Formatted(format(value, fmt))
    elif isinstance(value, str):  # a commit, a name: shown as text, not as a quoted repr
        shown = _Formatted(value)
    else:
        shown = value
    try:
        from myst_nb import glue as _glue
    except ImportError:
        print(f"{name} = {shown!r}")
        return
    _glue(name, shown, display=False)
