"""The fused ops the model calls, each dispatched by device and setting.

Each op takes tensors and returns tensors: Triton on CUDA, plain torch elsewhere (the reference,
:mod:`infer_lab.kernels.reference`, or where dispatch costs more than arithmetic, the same values
in fewer ops, :mod:`infer_lab.kernels.torch_path`), unless a backend is forced
(:mod:`infer_lab.kernels.dispatch`).
"""

from __future__ import annotations

import torch

from infer_lab.kernels.dispatch import resolve_backend, triton_module
from infer_lab.kernels.reference import rms_norm_ref, silu_and_mul_ref, store_kv_ref
from infer_lab.kernels.torch_path import rope_torch


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm; with ``residual``, ``(norm(x + residual), x + residual)`` in one pass."""
    if resolve_backend(backend, x) == "triton":
        return triton_module("triton_norm").rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their positions. The Triton version works *in place* and returns the
    same tensors; the reference returns new ones. Use the returned pair either way."""
    if resolve_backend(backend, q) == "triton":
        return triton_module("triton_rope").rope_triton_(q, k, positions, inv_freq)
    return rope_torch(q, k, positions, inv_freq)  # rope_ref's values in fewer ops


def silu_and_mul(x: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``silu(x[..., :n]) * x[..., n:]``."""
    if resolve_backend(backend, x) == "triton":
        return triton_module("triton_act").silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Write this step's k/v ``[T, Hkv, D]`` into the paged cache through the slot mapping."""
    if resolve_backend(backend, k) == "triton":
        triton_module("triton_attention").store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    *,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Triton paged attention with ``paged_attention_ref``'s contract (decode or prefill kernel).
    ``max_query_len``, the longest chunk as a host int, spares a device-to-host sync.

    Its torch reference lives with the cache (``infer_lab.cache.paged_attention_ref``), which
    chooses between the two (the cache imports the kernels, never the other way round).
    """
    mod = triton_module("triton_attention")
    return mod.paged_attention_triton(q, k_cache, v_cache, block_tables, context_lens,
                                      cu_seqlens_q, scale, window, max_query_len=max_query_len)
