"""The quantized matmul kernels compiled for a real GPU, in bf16 and fp16 at SmolLM2's and
Llama-3-8B's shapes, and a whole quantized model on CUDA. Run with ``pytest -m gpu``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from infer_lab import kernels
from infer_lab.kernels import quant as qk
from infer_lab.model.quantize import QuantizedLinear, quantize_model
from infer_lab.model.random import llama_config, random_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed"),
]
TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fmt,group", [("int8", 0), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("n,k", [(1536, 576), (576, 1536), (14336, 4096)])
@pytest.mark.parametrize("rows", [1, 8, 200])
def test_quant_kernels_on_gpu(dtype, fmt, group, n, k, rows):
    if fmt == "int4" and k % group:
        pytest.skip(f"group {group} does not divide {k}")  # a format limit, not a missing install
    torch.manual_seed(0)
    layer = QuantizedLinear.from_linear(nn.Linear(k, n, bias=False), fmt, group or 32).cuda()
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    out = qk.quant_linear(x, layer, backend="triton")
    ref = qk.quant_linear_ref(x.double(), layer)
    assert out.dtype == dtype and out.shape == ref.shape
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOL[dtype], err


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_model_on_gpu_close_to_its_reference_path(fmt):
    cfg = llama_config(vocab_size=4096, hidden_size=512, intermediate_size=1024,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)
    model = quantize_model(random_model(cfg, device="cuda", dtype=torch.bfloat16), fmt)
    ids = torch.randint(0, 4096, (2, 40), device="cuda")
    out = model(ids).double()
    for mod in model.modules():
        if isinstance(mod, QuantizedLinear):
            mod.impl = "reference"
    ref = model(ids).double()
    assert ((out - ref).pow(2).mean().sqrt() / ref.std()).item() <= 0.05


@pytest.mark.parametrize("rows", [1, 200])
def test_a_gptq_act_order_layer_with_a_short_last_group_on_gpu(rows):
    """SmolLM2's 576 inputs at group 128 under act-order: groups of 64 and the activation's
    columns gathered before the compiled Triton kernel, against the checkpoint's weight."""
    from infer_lab.model.quant.gptq import gptq_int4
    from infer_lab.model.quant.gptq_checkpoint import to_quantized_linear

    torch.manual_seed(0)
    w, x = torch.randn(1536, 576), torch.randn(256, 576)
    x[:, :3] *= 10
    t = gptq_int4(w, 2 * x.t() @ x / 256, 128, act_order=True)
    layer = to_quantized_linear(t, None, "w", 128).cuda()
    assert layer.group_size == 64 and layer.input_perm is not None
    xs = torch.randn(rows, 576, device="cuda", dtype=torch.bfloat16)
    out = qk.quant_linear(xs, layer, backend="triton")
    ref = xs.double() @ t.dequantize().double().cuda().t()
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOL[torch.bfloat16], err
