"""The expert computations of Chapter 12 against the naive loop in fp64, on fresh random inputs:
the grouped path, the grouped-GEMM path, the blocked layout the Triton kernel works on, and the
Triton kernel itself through the interpreter (one shape, as CI affords). ``pytest -m gpu`` runs the
kernel compiled, at model sizes, in bf16/fp16/fp32, and inside a CUDA graph."""

from __future__ import annotations

import random

import pytest
import torch

from infer_lab import kernels
from infer_lab.kernels import moe
from infer_lab.kernels.moe import (
    fused_experts,
    moe_align_block_size,
    moe_blocked_ref,
    moe_naive,
    select_experts,
)

needs_triton = pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed")
TOL = {torch.float32: 2e-6, torch.float16: 3e-3, torch.bfloat16: 3e-2}  # relative to max |ref|


def fresh_gen() -> tuple[torch.Generator, int]:
    seed = random.SystemRandom().randrange(2**31)
    return torch.Generator().manual_seed(seed), seed


def problem(t, e, h, i, k, gen, dtype=torch.float32, device="cpu", skip_expert=None):
    """Random activations, experts and routing; ``skip_expert`` gets no token at all."""
    x = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, i, generator=gen) / i**0.5
    logits = torch.randn(t, e, generator=gen)
    if skip_expert is not None:
        logits[:, skip_expert] = -1e9
    weights, ids = select_experts(logits, k, renormalize=True)
    cast = [a.to(device=device, dtype=dtype) for a in (x, w13, w2)]
    return (*cast, weights.to(device), ids.to(device))


def reference(x, w13, w2, weights, ids):
    return moe_naive(x.cpu().double(), w13.cpu().double(), w2.cpu().double(),
                     weights.cpu().double(), ids.cpu())


def assert_close(out, ref, dtype, seed, what):
    assert out.dtype == dtype and out.shape == ref.shape, (out.dtype, out.shape)
    err = ((out.cpu().double() - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e} > {TOL[dtype]:.0e} (seed {seed})"


def test_naive_is_the_definition():
    """Token by token, expert by expert, written out in full on a small case."""
    gen, _ = fresh_gen()
    x, w13, w2, weights, ids = problem(5, 4, 8, 6, 2, gen)
    out = moe_naive(x, w13, w2, weights, ids)
    for t in range(5):
        want = sum(weights[t, j] * (w2[e] @ (torch.nn.functional.silu(w13[e, :6] @ x[t])
                                             * (w13[e, 6:] @ x[t])))
                   for j, e in enumerate(ids[t].tolist()))
        torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["grouped", "grouped_mm", "blocked"])
@pytest.mark.parametrize("shape", [(1, 8, 64, 32, 2), (33, 8, 64, 48, 2), (70, 16, 32, 16, 4)],
                         ids=["decode", "batch", "k4"])
def test_torch_paths_equal_the_naive_loop(impl, shape):
    gen, seed = fresh_gen()
    args = problem(*shape, gen, skip_expert=3)
    out = moe_blocked_ref(*args) if impl == "blocked" else fused_experts(*args, impl=impl)
    assert_close(out, reference(*args), torch.float32, seed, impl)


def test_select_experts_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 1]] and torch.allclose(w, probs[:, :2])
    w, _ = select_experts(logits, 2, renormalize=True)
    assert torch.allclose(w, torch.softmax(logits[:, :2], -1))  # softmax over the chosen two
    with pytest.raises(ValueError, match="top_k=5"):
        select_experts(logits, 5, renormalize=True)


@pytest.mark.parametrize("block_m", [4, 16])
def test_align_block_size_layout(block_m):
    gen, seed = fresh_gen()
    t, e, k = 23, 8, 2
    _, ids = select_experts(torch.randn(t, e, generator=gen), k, True)
    ids[:, 0] = torch.where(ids[:, 0] == 5, 6, ids[:, 0])  # keep expert 5 nearly idle
    sorted_ids, expert_ids, used = moe_align_block_size(ids, block_m, e)
    n, used = t * k, int(used)
    assert used % block_m == 0 and len(sorted_ids) >= used
    real = sorted_ids[:used][sorted_ids[:used] < n]
    assert sorted(real.tolist()) == list(range(n)), f"every pair exactly once (seed {seed})"
    assert (sorted_ids[used:] == n).all()
    flat = ids.flatten()
    for b in range(used // block_m):
        block = sorted_ids[b * block_m : (b + 1) * block_m]
        block = block[block < n].long()
        assert len(block) and (flat[block] == expert_ids[b]).all(), f"block {b} (seed {seed})"
    counts = torch.bincount(flat, minlength=e)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())


def test_fused_experts_dispatch():
    gen, _ = fresh_gen()
    args = problem(4, 4, 16, 8, 2, gen)
    assert moe.get_moe_impl() in moe.MOE_IMPLS
    with pytest.raises(ValueError, match="unknown MoE implementation"):
        fused_experts(*args, impl="fastest")
    with pytest.raises(ValueError, match="shapes disagree"):
        fused_experts(args[0][:, :8], *args[1:], impl="grouped")
    previous = moe.set_moe_impl("naive")
    try:
        assert moe.get_moe_impl() == "naive"
        torch.testing.assert_close(fused_experts(*args), moe_naive(*args))
    finally:
        moe.set_moe_impl(previous)


@needs_triton
@pytest.mark.parametrize("tiles", ["decode", "prefill"])
def test_triton_kernel_in_the_interpreter(tiles):
    """One shape (CI time): 2 + 5 tokens' worth of pairs over 4 experts, one expert idle, both
    tile configurations the dispatch picks; fresh random inputs every run."""
    gen, seed = fresh_gen()
    args = problem(7, 4, 64, 32, 2, gen, skip_expert=2)
    if tiles == "decode":  # through the dispatch, which picks the tiles itself
        out = fused_experts(*args, impl="triton")
    else:
        mod = kernels.triton_module("moe_triton")
        out = mod.fused_moe_triton(*args, tiles=mod.MoETiles(64, 32, 32, 4, 2))
    assert_close(out, reference(*args), torch.float32, seed, f"triton {tiles}")


# ----------------------------------------------------------------------------- on a GPU
def on_gpu(test):
    """``pytest -m gpu`` only (CI deselects it); skipped without CUDA or Triton."""
    for mark in (pytest.mark.gpu,
                 pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
                 pytest.mark.skipif(not kernels.triton_available(), reason="no Triton")):
        test = mark(test)
    return test


@on_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("t", [1, 8, 64, 300])
@pytest.mark.parametrize("e, k", [(8, 2), (64, 6)])
def test_triton_kernel_on_gpu(dtype, t, e, k):
    gen, seed = fresh_gen()
    args = problem(t, e, 1024, 512, k, gen, dtype=dtype, device="cuda")
    out = fused_experts(*args, impl="triton")
    assert_close(out, reference(*args), dtype, seed, f"triton T={t} E={e}")


@on_gpu
def test_triton_kernel_in_a_cuda_graph():
    """No host sync anywhere in the layer: it captures, and replays with new routing."""
    gen, _ = fresh_gen()
    x, w13, w2, weights, ids = problem(16, 8, 512, 256, 2, gen, dtype=torch.float16,
                                       device="cuda")
    fused_experts(x, w13, w2, weights, ids, impl="triton")  # warm-up: compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, weights, ids, impl="triton")
    new_w, new_ids = select_experts(torch.randn(16, 8, device="cuda"), 2, True)
    weights.copy_(new_w)
    ids.copy_(new_ids)
    graph.replay()
    assert_close(out, reference(x, w13, w2, weights, ids), torch.float16, 0, "graph replay")
