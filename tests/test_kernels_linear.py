"""``kernels.linear``: oneDNN's inner product on a CPU, checked against ``F.linear``.

Fresh random inputs per case; the fast path must give F.linear's values to float32's accuracy,
take exactly the products it claims to (``onednn_takes``), and leave training (a product that
needs a gradient) to ``F.linear``, whose backward it does not have, and bf16 too, whose
``aten::mm`` was faster than the inner product (``benchmarks/results/cpu_linear.json``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from infer_lab.kernels.linear import linear, onednn_takes
from infer_lab.model.linear import Linear
from infer_lab.model.random import llama_config, random_model


def ops_run(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def random_product(dtype: torch.dtype, rows: int, bias: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x [rows, 80]``, ``W [96, 80]`` and maybe ``b [96]``, seeded by the case."""
    g = torch.Generator().manual_seed(rows * 7 + bias)
    w = torch.randn(96, 80, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    return torch.randn(rows, 80, generator=g).to(dtype), w, b


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(rows: int, bias: bool) -> None:
    x, w, b = random_product(torch.float32, rows, bias)
    with torch.inference_mode():
        assert onednn_takes(x, w, b)
        got, want = linear(x, w, b), F.linear(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("rows", [1, 3, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_goes_to_f_linear(rows: int, bias: bool) -> None:
    """bf16 is F.linear's: the same ops (no oneDNN inner product) and the same bits."""
    x, w, b = random_product(torch.bfloat16, rows, bias)
    with torch.inference_mode():
        assert not onednn_takes(x, w, b)
        got, want = linear(x, w, b), F.linear(x, w, b)
        ours, theirs = ops_run(lambda: linear(x, w, b)), ops_run(lambda: F.linear(x, w, b))
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert "mkldnn::_linear_pointwise" not in ours and ours == theirs


def test_linear_takes_batches_and_strided_inputs() -> None:
    w = torch.randn(48, 32)
    for x in (torch.randn(2, 7, 32), torch.randn(5, 64)[:, ::2], torch.randn(32, 5).t(),
              torch.randn(32)):
        with torch.no_grad():
            torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_fast_path_is_onednn_and_f_linear_is_not() -> None:
    """The profiler names the kernel that ran: oneDNN's op for linear, MKL's mm for F.linear
    (if torch ever routed both the same way, the speedup this module exists for is gone)."""
    w, x = torch.randn(64, 32), torch.randn(3, 32)
    with torch.inference_mode():
        fast = ops_run(lambda: linear(x, w))
        slow = ops_run(lambda: F.linear(x, w))
    assert "mkldnn::_linear_pointwise" in fast and "aten::mm" not in fast
    assert "mkldnn::_linear_pointwise" not in slow


def test_gradients_go_to_f_linear() -> None:
    """Training (an EAGLE head's) needs a backward, which oneDNN's op does not have."""
    w = torch.randn(16, 8, requires_grad=True)
    x = torch.randn(4, 8)
    assert not onednn_takes(x, w, None)
    linear(x, w).square().sum().backward()
    want = torch.autograd.grad(F.linear(x, w).square().sum(), w)[0]
    torch.testing.assert_close(w.grad, want)
    with torch.no_grad():
        assert onednn_takes(x, w, None)


def test_what_stays_with_f_linear() -> None:
    w = torch.randn(16, 8)
    assert not onednn_takes(torch.randn(0, 8), w, None)  # empty
    assert not onednn_takes(torch.randn(2, 8).double(), w.double(), None)  # float64
    assert not onednn_takes(torch.randn(2, 8).bfloat16(), w, None)  # mixed dtypes
    assert not onednn_takes(torch.randn(2, 8).bfloat16(), w.bfloat16(), None)  # bf16
    assert not onednn_takes(torch.randn(2, 8).half(), w.half(), None)  # fp16
    assert not onednn_takes(torch.randn(2, 8), w, torch.randn(16).double())
    assert not onednn_takes(torch.randn(2, 16), torch.randn(8, 16).t(), None)  # strided weight
    assert not onednn_takes(torch.tensor(1.0), w, None)  # 0-d
    torch._C._set_mkldnn_enabled(False)  # torch.backends.mkldnn switched off: F.linear
    try:
        assert not onednn_takes(torch.randn(2, 8), w, None)
    finally:
        torch._C._set_mkldnn_enabled(True)
    assert onednn_takes(torch.randn(2, 8), w, None)
    strided = torch.randn(8, 16).t()
    with torch.no_grad():
        torch.testing.assert_close(linear(torch.randn(3, 8), strided).shape, (3, 16))
    with torch.no_grad():
        assert linear(torch.randn(0, 8), w).shape == (0, 16)
    with pytest.raises(RuntimeError):  # F.linear's own error, not oneDNN's
        linear(torch.randn(2, 8).bfloat16(), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_layers_use_it(dtype: torch.dtype) -> None:
    """Every projection of the model is ``Linear`` (a ``nn.Linear``, so the quantizers and
    loaders that look for ``nn.Linear`` still find them); its forward is oneDNN's inner
    product in float32 and ``F.linear``'s in bf16."""
    cfg = llama_config(vocab_size=128, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = random_model(cfg, device="cpu", dtype=dtype)
    projections = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert projections and all(isinstance(m, Linear) for m in projections)
    x = torch.randn(3, model.config.hidden_size, dtype=dtype)
    with torch.inference_mode():
        ran = ops_run(lambda: projections[0](x))
    assert ("mkldnn::_linear_pointwise" in ran) == (dtype == torch.float32)


def test_flop_counter_counts_it() -> None:
    """torch's FLOP counter knows oneDNN's op (Chapter 7 counts a step's FLOPs with it)."""
    from torch.utils.flop_counter import FlopCounterMode

    w, x = torch.randn(64, 32), torch.randn(2, 3, 32)
    counts = []
    for f in (linear, F.linear):
        with torch.inference_mode(), FlopCounterMode(display=False) as mode:
            f(x, w)
        counts.append(mode.get_total_flops())
    assert counts[0] == counts[1] == 2 * 6 * 32 * 64
