"""Which implementation of a kernel runs: Triton or the torch reference.

The rule: Triton on CUDA, the reference elsewhere; and only what compiles on the GPU at hand
(:func:`triton_compiles`: no bf16 below compute capability 8.0, where Triton has no bf16
``tl.dot``; there the model runs in fp16 by default anyway). Both can be forced, globally with
:func:`set_backend` / :func:`use_backend` or the ``INFER_LAB_KERNELS`` environment variable, or per
call with ``backend=``, so that tests and Chapter 4 can run the two side by side.

Triton is imported lazily, on the first kernel that needs it: ``import infer_lab`` stays fast and
works where Triton is not installed. Without a CUDA device the kernels run in Triton's interpreter,
which must be switched on *before* the kernel modules are imported (``@triton.jit`` reads it).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from types import ModuleType

import torch

from infer_lab import settings

BACKENDS = settings.KERNEL_BACKENDS
_backend = settings.KERNELS.get()


def set_backend(name: str) -> None:
    """Choose the kernels for every later call: ``"triton"``, ``"torch"`` or ``"auto"``."""
    global _backend
    name = name.lower()
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; use one of {BACKENDS}")
    _backend = name


def get_backend() -> str:
    return _backend


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """``with use_backend("triton"): ...`` runs a block with other kernels, then restores."""
    previous = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def _interpret_before_triton_loads() -> None:
    """Without CUDA, ask for the interpreter now, before anything else imports Triton.

    ``@triton.jit`` reads the switch when it decorates, and that includes the helpers inside
    ``triton.language`` (the combine functions behind ``tl.sum`` and ``tl.max``): flipping the
    switch after ``import triton`` interprets our kernels but not those (measured), and
    reductions then fail. Setting an environment variable is cheap and imports nothing; a
    CPU-only machine cannot compile Triton kernels anyway. An explicit setting is respected.
    """
    if "triton" not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_before_triton_loads()


@cache
def triton_available() -> bool:
    """Is Triton installed? (It has Linux wheels only.)"""
    return importlib.util.find_spec("triton") is not None


@cache
def interpreting() -> bool:
    """Do the Triton kernels run in the interpreter (no CUDA device)? Decided once."""
    return not torch.cuda.is_available()


@cache
def _import_triton() -> ModuleType:
    if not triton_available():
        raise RuntimeError("Triton is not installed (it has Linux wheels only): use the torch "
                           "kernels, set_backend('torch')")
    if interpreting():
        os.environ["TRITON_INTERPRET"] = "1"  # read by @triton.jit, so before the kernels load
    import triton

    if interpreting():
        import triton.language.standard as tl_standard
        from triton.runtime.jit import JITFunction

        triton.knobs.runtime.interpret = True
        if isinstance(getattr(tl_standard, "_sum_combine", None), JITFunction):
            raise RuntimeError(
                "Triton was imported before infer_lab on a machine without CUDA, so its own "
                "helpers were not set up for the interpreter: import infer_lab first, or set "
                "TRITON_INTERPRET=1 before starting Python"
            )
    return triton


def triton_module(name: str) -> ModuleType:
    """Import ``infer_lab.kernels.<name>`` (a module of Triton kernels), Triton set up first."""
    _import_triton()
    return importlib.import_module(f"infer_lab.kernels.{name}")


def triton_compiles(dtype: torch.dtype, capability: tuple[int, int]) -> bool:
    """Do this package's Triton kernels compile for ``dtype`` on a GPU of ``capability``?

    bf16 needs sm_80 (Ampere): below it Triton has no bf16 ``tl.dot``. ``make gpu-compile``
    compiles exactly the combinations this allows.
    """
    return dtype != torch.bfloat16 or capability >= (8, 0)


@cache
def gpu_capability(device_index: int) -> tuple[int, int]:
    """Compute capability of CUDA device ``device_index``, asked once."""
    return tuple(torch.cuda.get_device_capability(device_index))  # type: ignore[return-value]


def _capability_of(x: torch.Tensor) -> tuple[int, int]:
    index = x.device.index
    return gpu_capability(torch.cuda.current_device() if index is None else index)


def resolve_backend(backend: str | None, x: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"`` for a call on tensor ``x`` (``backend`` None: the setting)."""
    name = (backend or _backend).lower()
    if name == "auto":
        if not (x.is_cuda and triton_available()):
            return "torch"
        return "triton" if triton_compiles(x.dtype, _capability_of(x)) else "torch"
    if name == "triton":
        if x.is_cuda == interpreting():
            how = "are interpreted (no CUDA device)" if interpreting() else "are compiled for CUDA"
            raise RuntimeError(f"Triton kernels here {how}; they cannot take a {x.device} tensor")
        if x.is_cuda and not triton_compiles(x.dtype, cap := _capability_of(x)):
            raise RuntimeError(f"Triton has no {x.dtype} kernels for compute capability "
                               f"{cap[0]}.{cap[1]}: use float16, or the torch kernels")
        return "triton"
    if name == "torch":
        return "torch"
    raise ValueError(f"unknown kernel backend {name!r}; use one of {BACKENDS}")
