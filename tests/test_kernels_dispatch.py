"""The Triton dispatch picks a path that compiles on the GPU it runs on, and INFER_LAB_DTYPE.

No GPU here: the compute capability is faked (monkeypatched), and the tensor handed to the
dispatch is a stand-in that says it lives on CUDA. What is tested is the choice, not a launch;
``make gpu-compile`` proves that the chosen combinations compile.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from infer_lab import device as dev
from infer_lab.kernels import dispatch


def fake_cuda_tensor(dtype: torch.dtype) -> SimpleNamespace:
    return SimpleNamespace(is_cuda=True, dtype=dtype, device=torch.device("cuda", 0))


@pytest.fixture
def on_gpu(monkeypatch):
    """A pretend CUDA machine whose capability the test sets."""
    def set_capability(cap: tuple[int, int]) -> None:
        monkeypatch.setattr(dispatch, "gpu_capability", lambda index: cap)
        monkeypatch.setattr(dispatch, "interpreting", lambda: False)
        monkeypatch.setattr(dispatch, "triton_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    return set_capability


@pytest.mark.parametrize(("cap", "dtype", "expected"), [
    ((7, 5), torch.float16, "triton"),   # T4: fp16 tensor cores
    ((7, 5), torch.bfloat16, "torch"),   # T4: no bf16 tl.dot in Triton
    ((7, 5), torch.float32, "triton"),
    ((8, 0), torch.bfloat16, "triton"),  # A100
    ((9, 0), torch.bfloat16, "triton"),  # H100/H200
])
def test_auto_backend_follows_the_capability(on_gpu, cap, dtype, expected):
    on_gpu(cap)
    assert dispatch.resolve_backend("auto", fake_cuda_tensor(dtype)) == expected


def test_forcing_triton_bf16_on_a_t4_is_a_clear_error(on_gpu):
    on_gpu((7, 5))
    with pytest.raises(RuntimeError, match="compute capability 7.5"):
        dispatch.resolve_backend("triton", fake_cuda_tensor(torch.bfloat16))
    assert dispatch.resolve_backend("triton", fake_cuda_tensor(torch.float16)) == "triton"


def test_default_dtype_by_capability(on_gpu, monkeypatch):
    monkeypatch.delenv(dev.DTYPE_ENV, raising=False)
    on_gpu((7, 5))
    assert dev.default_dtype("cuda") == torch.float16
    on_gpu((9, 0))
    assert dev.default_dtype("cuda") == torch.bfloat16
    assert dev.default_dtype("cpu") == torch.float32
    # What the default picks, the dispatch can run with Triton.
    for cap in ((7, 5), (8, 0), (9, 0)):
        on_gpu(cap)
        assert dispatch.triton_compiles(dev.default_dtype("cuda"), cap)


@pytest.mark.parametrize(("value", "dtype"), [
    ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("float16", torch.float16),
    ("FP32", torch.float32),
])
def test_infer_lab_dtype_overrides_the_default(monkeypatch, value, dtype):
    monkeypatch.setenv(dev.DTYPE_ENV, value)
    assert dev.default_dtype("cpu") == dtype
    assert dev.resolve_dtype(None, torch.device("cpu")) == dtype
    assert dev.resolve_dtype("auto", torch.device("cpu")) == dtype
    assert dev.resolve_dtype(torch.float32, torch.device("cpu")) == torch.float32  # explicit wins


def test_infer_lab_dtype_rejects_nonsense(monkeypatch):
    monkeypatch.setenv(dev.DTYPE_ENV, "float8")
    with pytest.raises(ValueError, match="INFER_LAB_DTYPE='float8'"):
        dev.default_dtype("cpu")


def test_infer_lab_dtype_reaches_a_loaded_model(monkeypatch):
    import infer_lab as il

    monkeypatch.setenv(dev.DTYPE_ENV, "bfloat16")
    model, _ = il.load()
    assert model.dtype == torch.bfloat16
