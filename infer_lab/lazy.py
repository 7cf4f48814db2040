"""Package roots that import their parts on first use (PEP 562).

``import infer_lab`` used to import every subpackage, and with them torch, the tokenizer and its
template engine, before the caller had asked for anything. A package root built with
:func:`lazy_exports` imports nothing: ``infer_lab.cache.BlockPool`` imports
``infer_lab.cache.block_pool`` the first time it is looked up, and keeps it. The public names do
not change: ``from infer_lab import load`` and ``il.load`` work as before, ``dir()`` and
``__all__`` list them, and a submodule is reachable as an attribute (``il.model.loader``) the way
an eager root made it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for package ``package``.

    ``exports`` maps a module (absolute, or relative to the package when it starts with ``.``)
    to the names the package re-exports from it.
    """
    where: dict[str, str] = {}
    for module, names in exports.items():
        absolute = package + module if module.startswith(".") else module
        for name in names:
            if name in where:
                raise ValueError(f"{package}: {name!r} is exported from two modules")
            where[name] = absolute

    def __getattr__(name: str) -> Any:
        namespace = sys.modules[package].__dict__
        if name in where:
            value = getattr(importlib.import_module(where[name]), name)
            namespace[name] = value  # looked up once; later reads do not come here
            return value
        if not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}"):
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(sys.modules[package].__dict__) | set(where))

    return __getattr__, __dir__, list(where)
