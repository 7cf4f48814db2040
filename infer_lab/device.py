"""Device and dtype defaults, chosen once so every chapter runs unchanged on CPU and GPU.

``INFER_LAB_DTYPE`` (``float32``, ``bfloat16``, ``float16`` or their short names) overrides the
default dtype everywhere (``il.load``, ``il.LLM``, random models): CI runs the chapters in bf16 on
CPU with it, to meet on CPU the numbers a GPU reader will see.
"""

from __future__ import annotations

import torch

from infer_lab import settings

DTYPE_ENV = settings.DTYPE.name


def default_device() -> torch.device:
    """CUDA when there is a GPU, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device | str) -> torch.dtype:
    """``INFER_LAB_DTYPE`` if set; else fp32 on CPU (exact comparisons), bf16 on Ampere or newer,
    fp16 on older GPUs (a T4 has no bf16 tensor cores, and Triton no bf16 ``tl.dot`` there)."""
    device = torch.device(device)
    forced = settings.DTYPE.get()
    if forced != "auto":
        return _parse_dtype(forced)
    if device.type != "cuda":
        return torch.float32
    major, _ = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if major >= 8 else torch.float16


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """Accept ``torch.float16``, ``"float16"``, ``"fp16"``, ``"bf16"``, ``"auto"`` or None."""
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    return _parse_dtype(dtype)


def _parse_dtype(dtype: object) -> torch.dtype:
    names = settings.DTYPE_ALIASES
    try:
        return getattr(torch, names[str(dtype).lower()])
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(names)} or 'auto'") from None
