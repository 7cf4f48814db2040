"""Device and dtype defaults, chosen once so every chapter runs unchanged on CPU and GPU."""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    """CUDA when there is a GPU, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device | str) -> torch.dtype:
    """fp32 on CPU (exact comparisons), bf16 on Ampere or newer, fp16 on older GPUs (T4)."""
    device = torch.device(device)
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
    names = {
        "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
        "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
        "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    }
    try:
        return names[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(names)} or 'auto'") from None
