"""benchmarks/fp8_gpu.py (device_check.sh's ``fp8`` step) on the CPU: its dry run end to end,
the FP8 operands it hands ``torch._scaled_mm`` being the package encoder's, its products against
the dequantized reference (and that check catching a wrong scale), and its shapes against the
models' published parameter counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import fp8_gpu
from infer_lab.model.quant.fp8 import quantize_fp8

CPU = torch.device("cpu")

# Published parameter counts (the models' cards and safetensors index), layers of each.
PUBLISHED_COUNTS = {"smollm2-135m": (134_515_008, 30, True),
                    "llama-3.2-1b": (1_235_814_400, 16, True),
                    "llama-3-8b": (8_030_261_248, 32, False)}


@pytest.mark.parametrize("model", list(PUBLISHED_COUNTS))
def test_shapes_add_up_to_the_published_parameter_count(model: str) -> None:
    count, layers, tied = PUBLISHED_COUNTS[model]
    shapes = dict((name, n * k) for name, n, k in fp8_gpu.linear_shapes(model))
    h, vocab = fp8_gpu.MODELS[model][0], fp8_gpu.MODELS[model][5]
    body = sum(v for name, v in shapes.items() if name != "lm_head")
    total = layers * (body + 2 * h) + h + shapes["lm_head"] + (0 if tied else vocab * h)
    assert total == count


def operands(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations whose rows and a weight whose output channels span 1000x in magnitude, so a
    scale applied to the wrong axis shows."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g) * torch.logspace(-1.5, 1.5, m)[:, None]
    w = torch.randn(n, k, generator=g) * torch.logspace(1.5, -1.5, n)[:, None]
    return x, w


@pytest.mark.parametrize("granularity", fp8_gpu.GRANULARITIES)
def test_scaled_mm_operands_are_the_encoders(granularity: str) -> None:
    x, w = operands(16, 48, 64)
    qx, qw = (quantize_fp8(t, "fp8_e4m3", granularity) for t in (x, w))
    a, sa = fp8_gpu.scaled_mm_args(qx, "a")
    b, sb = fp8_gpu.scaled_mm_args(qw, "b")
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.shape == (16, 64)
    assert b.shape == (64, 48) and b.stride() == (1, 64)  # column-major, as _scaled_mm wants
    assert torch.equal(a.float() * sa, qx.dequantize())
    assert torch.equal((b.float() * sb).t(), qw.dequantize())
    assert fp8_gpu.codes_match_torch(x, qx) and fp8_gpu.codes_match_torch(w, qw)


@pytest.mark.parametrize("granularity", fp8_gpu.GRANULARITIES)
def test_product_within_tolerance_and_a_wrong_scale_is_caught(granularity: str) -> None:
    x, w = operands(16, 48, 64)
    qx, qw = (quantize_fp8(t, "fp8_e4m3", granularity) for t in (x, w))
    ran = fp8_gpu.has_scaled_mm(CPU)
    row, call = fp8_gpu.fp8_check(x, w, qx, qw, run=ran)
    assert row["codes_match_torch"]
    if not ran:  # a torch without a CPU kernel: the reference path alone
        assert call is None and "rel_err" not in row
        return
    assert call is not None and row["rel_err"] <= fp8_gpu.TOL
    # The same codes with one scale per tensor where they were encoded per row: far off.
    a, _ = fp8_gpu.scaled_mm_args(qx, "a")
    b, _ = fp8_gpu.scaled_mm_args(qw, "b")
    one = qx.scale.max() * qw.scale.max()
    wrong = torch._scaled_mm(a, b, scale_a=one, scale_b=torch.ones(()),
                             out_dtype=torch.bfloat16).float()
    ref = qx.dequantize() @ qw.dequantize().t()
    err = float((wrong - ref).abs().max() / ref.abs().max())
    assert (err > fp8_gpu.TOL) == (granularity == "channel")


def test_dry_run_writes_what_chapter_8b_reads(tmp_path: Path) -> None:
    assert fp8_gpu.main(["--dry-run", "--rows", "1", "16", "--repeats", "1", "--warmup", "0",
                         "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "fp8_gpu.json").read_text())
    assert data["provenance"]["device"] == "cpu" and data["all_checks_pass"]
    assert {(r["layer"], r["m"]) for r in data["rows"]} == {
        (layer, m) for layer, _, _ in fp8_gpu.linear_shapes("smollm2-135m", lm_head=False)
        for m in (1, 16)}
    for r in data["rows"]:
        assert r["bf16_tflops"] > 0
        for g in fp8_gpu.GRANULARITIES:
            assert r[f"codes_match_torch_{g}"]
            if data["scaled_mm_ran"]:
                assert r[f"rel_err_{g}"] <= data["settings"]["tolerance"]
                assert r[f"speedup_{g}"] == pytest.approx(r["bf16_ms"] / r[f"fp8_{g}_ms"])
    expected = "cpu_dry_run" if data["scaled_mm_ran"] else "cpu_reference_only"
    assert data["mode"] == expected
    if data["scaled_mm_ran"]:
        assert set(data["summary_speedup_geomean"]["smollm2-135m"]) == {"1", "16"}
