"""The W8A16 / W4A16 Triton kernels through Triton's interpreter, against the dequantize-then-
matmul reference, and the dispatch around them. (Compiled for a GPU: tests/test_quant_gpu.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from infer_lab import kernels
from infer_lab.kernels import quant as qk
from infer_lab.model.quantize import QuantizedLinear

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed")


def _layer(fmt: str, n: int, k: int, group: int = 32, bias: bool = False) -> QuantizedLinear:
    torch.manual_seed(n * 7 + k)
    return QuantizedLinear.from_linear(nn.Linear(k, n, bias=bias), fmt, group)


@pytest.mark.parametrize("fmt,group", [("int8", 0), ("int4", 32), ("int4", 64)])
@pytest.mark.parametrize("kind", ["gemv", "gemm"])
@pytest.mark.parametrize("rows", [1, 3, 37])
def test_triton_quant_kernels_match_reference(fmt, group, kind, rows):
    # N = 80 and K = 192 are not multiples of the 64-wide tiles: the masks are exercised
    layer = _layer(fmt, 80, 192, group or 32)
    tq = kernels.triton_module("triton_quant")
    x = torch.randn(rows, 192)
    ref = qk.quant_linear_ref(x, layer)
    if fmt == "int8":
        out = tq.w8_linear(x, layer.qweight, layer.scale, force=kind)
    else:
        out = tq.w4_linear(x, layer.qweight, layer.scale, layer.minimum, group, force=kind)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_dispatch_forced_triton_with_bias_and_batch_dims(fmt):
    layer = _layer(fmt, 64, 128, 32, bias=True)
    x = torch.randn(2, 5, 128)
    out = qk.quant_linear(x, layer, backend="triton")
    ref = qk.quant_linear_ref(x, layer)
    assert out.shape == (2, 5, 64)
    torch.testing.assert_close(out, ref, atol=1e-5 * ref.abs().max().item(), rtol=0)


def test_triton_int4_refuses_groups_it_does_not_cover_and_dispatch_falls_back():
    layer = _layer("int4", 32, 64, 16)  # a valid format, but the kernels take groups >= 32
    assert not qk.triton_takes(layer)
    x = torch.randn(2, 64)
    torch.testing.assert_close(qk.quant_linear(x, layer, backend="triton"),
                               qk.quant_linear_ref(x, layer))
    tq = kernels.triton_module("triton_quant")
    with pytest.raises(ValueError, match="groups of at least 32"):
        tq.w4_linear(x, layer.qweight, layer.scale, layer.minimum, 16)
    with pytest.raises(ValueError, match="K=64"):
        tq.w8_linear(torch.randn(2, 64), torch.zeros(8, 32, dtype=torch.int8), torch.ones(8))


@pytest.mark.parametrize("kind", ["gemv", "gemm"])
def test_triton_int4_takes_a_kept_q4_k_layers_float32_scales(kind):
    """A GGUF Q4_K matrix kept as int4 holds its scales and minimums in float32 (fp16 cannot
    hold ``d * sc``); the Triton kernels read them as they are. Q6_K's ``int8g`` layer has no
    Triton kernel: forced to Triton, the dispatch falls back (here on the CPU, to the int8
    kernel with bf16 activations; on CUDA, to the reference)."""
    from infer_lab.model.quant.kquants import quantize_q4_k, quantize_q6_k
    from infer_lab.model.quantize import gguf_block_tensors

    torch.manual_seed(5)
    w = torch.randn(80, 512)
    fmt, t = gguf_block_tensors(quantize_q4_k(w).numpy(), "Q4_K", 80, 512)
    assert fmt == "int4" and t["scale"].dtype == t["minimum"].dtype == torch.float32
    layer = QuantizedLinear(fmt, t, 512, 80, None, 32)
    x = torch.randn(3, 512)
    ref = qk.quant_linear_ref(x, layer)
    tq = kernels.triton_module("triton_quant")
    out = tq.w4_linear(x, layer.qweight, layer.scale, layer.minimum, 32, force=kind)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    fmt, t = gguf_block_tensors(quantize_q6_k(w).numpy(), "Q6_K", 80, 512)
    q6 = QuantizedLinear(fmt, t, 512, 80, None, 16)
    assert not qk.triton_takes(q6)
    ref = qk.quant_linear_ref(x, q6)
    out = qk.quant_linear(x, q6, backend="triton")
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-2
