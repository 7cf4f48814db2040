"""The small fused kernels (RMSNorm + residual, RoPE, SiLU-and-mul) through Triton's interpreter
against their torch references in fp64, and the dispatch rules around them."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from infer_lab import kernels
from infer_lab.kernels.reference import rms_norm_ref, rope_ref, silu_and_mul_ref
from infer_lab.model.config import RopeConfig
from infer_lab.model.rope import rope_inv_freq

needs_triton = pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed")
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # relative to max |ref|
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])


def fresh_gen() -> tuple[torch.Generator, int]:
    seed = random.SystemRandom().randrange(2**31)
    return torch.Generator().manual_seed(seed), seed


def assert_close(out, ref, dtype, seed, what):
    assert out.dtype == dtype and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e} > {TOL[dtype]:.0e} (seed {seed})"


@needs_triton
@DTYPES
@pytest.mark.parametrize("shape", [(1, 1), (7, 37), (2, 3, 64)], ids=["one", "odd", "3d"])
def test_rms_norm_with_and_without_residual(shape, dtype):
    gen, seed = fresh_gen()
    x, r = (torch.randn(*shape, generator=gen).to(dtype) for _ in range(2))
    w = (1 + 0.3 * torch.randn(shape[-1], generator=gen)).to(dtype)
    x0, r0 = x.clone(), r.clone()
    out = kernels.rms_norm(x, w, 1e-6, backend="triton")
    assert_close(out, rms_norm_ref(x.double(), w.double(), 1e-6), dtype, seed, "rms_norm")
    out, total = kernels.rms_norm(x, w, 1e-6, r, backend="triton")
    ref, ref_total = rms_norm_ref(x.double(), w.double(), 1e-6, r.double())
    assert_close(out, ref, dtype, seed, "rms_norm(x + r)")
    assert_close(total, ref_total, dtype, seed, "x + r")
    assert torch.equal(x, x0) and torch.equal(r, r0), "inputs must not change"


@needs_triton
def test_rms_norm_of_heads_split_from_qkv():
    """Qwen3's q/k norm normalises each head of a strided view of the qkv projection."""
    gen, seed = fresh_gen()
    qkv = torch.randn(5, 4 * 16 + 2 * 2 * 16, generator=gen)
    q = qkv[:, :64].unflatten(-1, (4, 16))
    w = torch.randn(16, generator=gen)
    out = kernels.rms_norm(q, w, 1e-6, backend="triton")
    assert_close(out, rms_norm_ref(q.double(), w.double(), 1e-6), torch.float32, seed, "q norm")


def llama3_inv_freq(head_dim: int) -> torch.Tensor:
    rope = RopeConfig(rope_type="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=64)
    return rope_inv_freq(rope, head_dim, 1024)


@needs_triton
@DTYPES
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "gqa8"])
def test_rope_in_place_on_qkv_views(heads, dtype):
    """q and k are strided views of one fused qkv output; positions start mid-sequence."""
    hq, hkv = heads
    d, t = 32, 9
    gen, seed = fresh_gen()
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], -1)
    q, k = q.unflatten(-1, (hq, d)), k.unflatten(-1, (hkv, d))
    v_before = qkv[:, (hq + hkv) * d:].clone()
    positions = torch.randint(0, 1000, (t,), generator=gen)
    inv_freq = llama3_inv_freq(d)
    ref_q, ref_k = rope_ref(q.double(), k.double(), positions, inv_freq)
    out_q, out_k = kernels.apply_rope(q, k, positions, inv_freq, backend="triton")
    assert out_q.data_ptr() == q.data_ptr(), "the Triton RoPE works in place"
    assert_close(out_q, ref_q, dtype, seed, "rope q")
    assert_close(out_k, ref_k, dtype, seed, "rope k")
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before), "v must be left alone"


@needs_triton
def test_rope_batched_layout_and_odd_half_dim():
    """The no-cache path passes ``[B, S, H, D]`` and expanded positions; D/2 = 5 (odd)."""
    gen, seed = fresh_gen()
    q = torch.randn(2, 3, 4, 10, generator=gen)
    k = torch.randn(2, 3, 2, 10, generator=gen)
    positions = torch.arange(3).expand(2, 3)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 10, 2) / 10)
    ref_q, ref_k = rope_ref(q.double(), k.double(), positions, inv_freq)
    out_q, out_k = kernels.apply_rope(q, k, positions, inv_freq, backend="triton")
    assert_close(out_q, ref_q, torch.float32, seed, "rope q")
    assert_close(out_k, ref_k, torch.float32, seed, "rope k")


@needs_triton
@DTYPES
@pytest.mark.parametrize("shape", [(1, 2), (5, 74), (2, 3, 2200)], ids=["one", "odd", "wide"])
def test_silu_and_mul(shape, dtype):
    gen, seed = fresh_gen()
    x = (2 * torch.randn(*shape, generator=gen)).to(dtype)
    out = kernels.silu_and_mul(x, backend="triton")
    assert_close(out, silu_and_mul_ref(x.double()), dtype, seed, "silu_and_mul")


# --------------------------------------------------------------------------- dispatch


def test_auto_uses_the_reference_on_cpu_and_settings_override():
    x = torch.ones(2, 4)
    assert kernels.resolve_backend("auto", x) == "torch"
    assert kernels.resolve_backend("torch", x) == "torch"
    before = kernels.get_backend()
    with kernels.use_backend("torch"):
        assert kernels.get_backend() == "torch"
        assert kernels.resolve_backend(None, x) == "torch"
    assert kernels.get_backend() == before
    with pytest.raises(ValueError, match="unknown kernel backend"):
        kernels.set_backend("cuda")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        kernels.resolve_backend("fast", x)


@needs_triton
def test_forcing_triton_on_cpu_runs_the_interpreter():
    x = torch.randn(3, 8)
    assert kernels.interpreting() == (not torch.cuda.is_available())
    if kernels.interpreting():
        with kernels.use_backend("triton"):
            assert kernels.resolve_backend(None, x) == "triton"
            out = kernels.silu_and_mul(x)
        torch.testing.assert_close(out, silu_and_mul_ref(x))


def test_import_is_lazy_and_env_setting_is_read():
    """``import infer_lab`` (model, cache, kernels) must not import Triton; the environment
    variable sets the starting backend."""
    code = ("import sys, infer_lab, infer_lab.cache, infer_lab.kernels as k; "
            "assert 'triton' not in sys.modules, 'triton imported eagerly'; print(k.get_backend())")
    env = {**os.environ, "INFER_LAB_KERNELS": "torch"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch"
