"""Ask for Triton's interpreter before Triton loads, with no torch import at ``import infer_lab``.

On a machine without CUDA the Triton kernels run in Triton's interpreter, which must be switched
on (``TRITON_INTERPRET=1``) before ``triton`` is first imported (see
:mod:`infer_lab.kernels.dispatch`). The package root used to make sure of it by importing the
kernels, and torch with them, eagerly. Now it leaves a finder on ``sys.meta_path`` that acts once,
the first time anything looks for ``triton``: it imports the dispatch module, whose import does
the check, and steps aside. ``import infer_lab`` stays cheap and the promise holds: import
``infer_lab`` first and Triton comes up in the mode this machine needs.
"""

from __future__ import annotations

import importlib
import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from typing import Any


class InterpretBeforeTriton(MetaPathFinder):
    """A finder that finds nothing: on the first look-up of ``triton`` it readies the dispatch."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if fullname == "triton":
            uninstall()
            importlib.import_module("infer_lab.kernels.dispatch")
        return None


def install() -> None:
    """Put the finder first on ``sys.meta_path`` unless Triton is loaded or it is there already."""
    if "triton" in sys.modules or any(isinstance(f, InterpretBeforeTriton) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, InterpretBeforeTriton())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, InterpretBeforeTriton)]
