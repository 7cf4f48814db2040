"""Mixture-of-experts compute: routing, then the experts, in the book's usual order (Chapter 12).

Every token picks ``k`` of ``E`` experts (:func:`select_experts`); each expert is a SwiGLU MLP with
its gate/up weights ``w13 [E, 2I, H]`` (gate rows, then up rows) and down weights ``w2 [E, H, I]``
(vLLM's names and layout; transformers 5 keeps its fused experts the same way). The output of a
token is the routing-weighted sum of its ``k`` experts' outputs. Four ways to compute it, each
checked against the first:

- :func:`moe_naive` loops over the experts and, for each, finds its tokens (transformers' loop);
- :func:`moe_grouped` sorts the (token, expert) pairs by expert once, gathers the rows once, runs
  one matmul pair per expert on a contiguous slice, and scatter-adds the weighted rows back once;
- :func:`moe_grouped_mm` is the same with one ``torch.nn.functional.grouped_mm`` per projection
  (one call for all experts, offsets on the device, no host sync; torch >= 2.10);
- the fused Triton kernel (:mod:`infer_lab.kernels.moe_triton`) does the grouped GEMMs over the
  sorted pairs with the gather, SiLU-and-mul and routing weight inside the kernel, on the padded
  block layout of :func:`moe_align_block_size`.

:func:`fused_experts` picks one: Triton on CUDA, :data:`CPU_DEFAULT` elsewhere (the fastest on this
project's CPU, ``benchmarks/moe.py``), unless forced per call or by ``INFER_LAB_MOE``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infer_lab import settings
from infer_lab.kernels.dispatch import resolve_backend, triton_module
from infer_lab.kernels.linear import linear
from infer_lab.kernels.reference import silu_and_mul_ref

MOE_IMPLS = settings.MOE_IMPLS
# The CPU path: one grouped GEMM per projection was as fast as the others or faster at batch 1, 8
# and 64 in benchmarks/moe.py (fp32, this project's machine); torch before 2.10 lacks it.
CPU_DEFAULT = "grouped_mm" if hasattr(F, "grouped_mm") else "grouped"
_impl = settings.MOE.get()


def set_moe_impl(name: str) -> str:
    """Choose how :func:`fused_experts` computes from now on; returns the previous choice."""
    global _impl
    name = name.lower()
    if name not in MOE_IMPLS:
        raise ValueError(f"unknown MoE implementation {name!r}; use one of {MOE_IMPLS}")
    previous, _impl = _impl, name
    return previous


def get_moe_impl() -> str:
    return _impl


# ----------------------------------------------------------------------------- routing
def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` experts of each token and their weights: softmax over all experts in fp32, keep
    the ``k`` largest, and (``renormalize``: Mixtral always, Qwen with ``norm_topk_prob``) divide
    them by their sum, which is the softmax over the chosen ``k`` logits alone.

    Returns ``(weights [T, k] fp32, ids [T, k] int64)``.
    """
    if not 1 <= top_k <= router_logits.shape[-1]:
        raise ValueError(f"top_k={top_k} must be between 1 and the "
                         f"{router_logits.shape[-1]} experts")
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
           ids: torch.Tensor) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"x must be [T, H] and the weights [E, 2I, H] and [E, H, I]; got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    e, two_i, h = w13.shape
    if x.shape[1] != h or w2.shape != (e, h, two_i // 2):
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}")
    if ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must "
                         f"both be [T={x.shape[0]}, k]")


# ----------------------------------------------------------------------------- torch paths
def moe_naive(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The reference: for each expert, find its tokens, run it on them, add the weighted rows."""
    _check(x, w13, w2, topk_weights, topk_ids)
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == e)
        if token.numel() == 0:
            continue
        h = silu_and_mul_ref(F.linear(x[token], w13[e]))
        y = F.linear(h, w2[e]) * topk_weights[token, slot, None].to(x.dtype)
        out.index_add_(0, token, y)
    return out


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs ordered by expert: ``order`` (flat pair indices, stable) and
    ``counts [E]`` (pairs per expert). Pair ``p`` is token ``p // k``, slot ``p % k``."""
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount without a host sync
    return order, counts


def moe_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    """Sort once, gather once, one matmul pair per expert on a contiguous slice, scatter once."""
    _check(x, w13, w2, topk_weights, topk_ids)
    k = topk_ids.shape[1]
    order, counts = sort_by_expert(topk_ids, w13.shape[0])
    token = order // k
    rows = x[token]  # the one gather: [T*k, H], grouped by expert
    outs = [linear(silu_and_mul_ref(linear(r, w13[e])), w2[e])  # fp32: oneDNN on a CPU
            for e, r in enumerate(rows.split(counts.tolist())) if r.shape[0]]
    y = torch.cat(outs) * topk_weights.flatten()[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)  # the one weighted scatter-add


def moe_grouped_mm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """:func:`moe_grouped` with one grouped GEMM per projection (``F.grouped_mm``, torch >= 2.10)
    in place of the Python loop over experts."""
    _check(x, w13, w2, topk_weights, topk_ids)
    if not hasattr(F, "grouped_mm"):
        raise RuntimeError(f"torch {torch.__version__} has no grouped_mm (torch >= 2.10 has): "
                           "use the 'grouped' MoE implementation")
    k = topk_ids.shape[1]
    order, counts = sort_by_expert(topk_ids, w13.shape[0])
    token = order // k
    offs = counts.cumsum(0).to(torch.int32)
    h = F.grouped_mm(x[token], w13.transpose(1, 2), offs=offs)
    y = F.grouped_mm(silu_and_mul_ref(h), w2.transpose(1, 2), offs=offs)
    y = y * topk_weights.flatten()[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


# ----------------------------------------------------------------------------- the kernel's layout
def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay the (token, slot) pairs out in blocks of ``block_m`` rows, one expert per block.

    Each expert's pairs are padded to a multiple of ``block_m`` so that a kernel program owns one
    block and multiplies it by one expert's weights. Returns (vLLM's names):

    - ``sorted_token_ids [P]``: flat pair indices, expert by expert; padding holds ``T*k``;
    - ``expert_ids [P / block_m]``: the expert of each block (0 past the end: never read);
    - ``num_tokens_post_padded [1]``: how many of the ``P`` rows are used (a tensor, so no host
      sync: ``P`` is the bound ``T*k + min(E, T*k) * (block_m - 1)`` known from the shapes).
    """
    flat = topk_ids.flatten()
    n, dev = flat.numel(), flat.device
    order, counts = sort_by_expert(topk_ids, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    start = counts.cumsum(0) - counts
    expert = flat[order]
    dest = pad_start[expert] + torch.arange(n, device=dev) - start[expert]
    size = n + min(num_experts, n) * (block_m - 1)
    size = (size + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, size, block_m, device=dev)
    expert_ids = torch.searchsorted(pad_end, block_starts, right=True)
    expert_ids = expert_ids.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, pad_end[-1:].to(torch.int32)


def moe_blocked_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, block_m: int = 16
                    ) -> torch.Tensor:
    """What the Triton kernel computes, block by block in torch: the definition of its layout
    (each block's rows gathered through ``sorted_token_ids``, one expert per block)."""
    _check(x, w13, w2, topk_weights, topk_ids)
    t, k = topk_ids.shape
    sorted_ids, expert_ids, used = moe_align_block_size(topk_ids, block_m, w13.shape[0])
    pairs = torch.zeros(t * k + 1, x.shape[1], dtype=x.dtype, device=x.device)  # +1: padding
    flat_w = torch.cat([topk_weights.flatten().to(x.dtype), x.new_zeros(1)])
    for b in range(int(used) // block_m):
        ids = sorted_ids[b * block_m : (b + 1) * block_m].long()
        e = int(expert_ids[b])
        rows = x[(ids // k).clamp(max=t - 1)]
        y = F.linear(silu_and_mul_ref(F.linear(rows, w13[e])), w2[e]) * flat_w[ids, None]
        pairs[ids] = y
    return pairs[: t * k].view(t, k, -1).sum(1)


# ----------------------------------------------------------------------------- dispatch
IMPLS = {"naive": moe_naive, "grouped": moe_grouped, "grouped_mm": moe_grouped_mm}


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                  impl: str | None = None) -> torch.Tensor:
    """The routed experts' weighted sum for each token of ``x [T, H]`` (vLLM's name).

    ``impl`` (default: the process setting, ``INFER_LAB_MOE``): ``"auto"`` runs the Triton kernel
    where the kernels' dispatch would run Triton (CUDA) and :data:`CPU_DEFAULT` elsewhere.
    """
    name = (impl or _impl).lower()
    if x.shape[0] == 0 and name in MOE_IMPLS:  # an expert-parallel rank that received nothing
        return torch.zeros_like(x)
    if name == "auto":
        name = "triton" if resolve_backend(None, x) == "triton" else CPU_DEFAULT
    if name == "triton":
        resolve_backend("triton", x)  # raises if Triton cannot take this tensor here
        return triton_module("moe_triton").fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    if name not in IMPLS:
        raise ValueError(f"unknown MoE implementation {name!r}; use one of {MOE_IMPLS}")
    return IMPLS[name](x, w13, w2, topk_weights, topk_ids)
