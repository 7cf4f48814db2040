"""``kernels.linear``: oneDNN's inner product on a CPU, checked against ``F.linear``.

Fresh random inputs per case; the fast path must give F.linear's values to float32's (bf16's)
accuracy, take exactly the products it claims to (``onednn_takes``), and leave training (a
product that needs a gradient) to ``F.linear``, whose backward it does not have.
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

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def ops_run(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(dtype: torch.dtype, rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows * 7 + bias)
    w = torch.randn(96, 80, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, 80, generator=g).to(dtype)
    with torch.inference_mode():
        assert onednn_takes(x, w, b)
        got, want = linear(x, w, b), F.linear(x.float(), w.float(), None if b is None
                                               else b.float())
    assert got.dtype == dtype and got.shape == (rows, 96)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol * float(want.abs().max()))


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


def test_model_layers_use_it() -> None:
    """Every projection of the model is ``Linear`` (a ``nn.Linear``, so the quantizers and
    loaders that look for ``nn.Linear`` still find them), and its forward is oneDNN's."""
    cfg = llama_config(vocab_size=128, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = random_model(cfg, device="cpu", dtype=torch.float32)
    projections = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert projections and all(isinstance(m, Linear) for m in projections)
    x = torch.randn(3, model.config.hidden_size)
    with torch.inference_mode():
        assert "mkldnn::_linear_pointwise" in ops_run(lambda: projections[0](x))


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
