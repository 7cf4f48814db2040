"""``quantization="gguf"``: a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks kept as they are give the
same logits as the dequantized load (the bits are re-laid, never rounded again)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import infer_lab as il
from infer_lab.model.gguf import read_gguf
from infer_lab.model.quantize import (
    QuantizationError,
    QuantizedEmbedding,
    QuantizedLinear,
    gguf_block_tensors,
    keep_gguf_blocks,
    model_weight_bytes,
)
from tests.helpers import save_tokenizer
from tests.test_gguf import PROMPTS, hf_model, vocab_size, write_gguf

gguf = pytest.importorskip("gguf")  # a declared dependency (the GGUF loader needs it)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(path)
    return path


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_relaid_without_rounding(qtype):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(48, 96)).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]).reshape(48, 96)
    fmt, t = gguf_block_tensors(blocks, qtype, 48, 96)
    layer = QuantizedLinear(fmt, t, 96, 48, None, 32)
    assert fmt == ("int8g" if qtype == "Q8_0" else "int4")
    assert torch.equal(layer.dequantize(), torch.from_numpy(expected))
    # the file's bytes, plus (Q4_0 only) the minimum -8d spelled out: 2 bytes per 32 weights
    extra = 2 * 48 * 96 // 32 if qtype == "Q4_0" else 0
    assert layer.weight_bytes == blocks.nbytes + extra


def test_unsupported_block_type_raises():
    with pytest.raises(QuantizationError, match="Q4_K"):
        gguf_block_tensors(np.zeros((1, 144), np.uint8), "Q4_K", 1, 256)


@pytest.mark.parametrize("qtype,tie", [("Q4_0", False), ("Q4_1", True), ("Q8_0", False)])
def test_kept_blocks_give_the_dequantized_logits(qtype, tie, tok_dir, tmp_path):
    source = hf_model(vocab_size(tok_dir), tie=tie, seed=7)
    path = write_gguf(tmp_path / f"m-{qtype}.gguf", source, tok_dir, qtype)
    dequantized, _ = il.load(path, device="cpu", dtype=torch.float32)
    kept, _ = il.load(path, device="cpu", dtype=torch.float32)
    keep_gguf_blocks(kept, read_gguf(path).weights())
    assert kept.quantization == "gguf" and isinstance(kept.embed_tokens, QuantizedEmbedding)
    assert (kept.lm_head is kept.embed_tokens.table) == tie
    assert model_weight_bytes(kept) < 0.4 * model_weight_bytes(dequantized)
    for ids in PROMPTS:
        x = torch.tensor([ids])
        ref = dequantized(x)
        for mod in kept.modules():
            if isinstance(mod, QuantizedLinear):
                mod.impl = "reference"
        torch.testing.assert_close(kept(x), ref, atol=2e-5 * ref.abs().max().item(), rtol=0)
        for mod in kept.modules():
            if isinstance(mod, QuantizedLinear):
                mod.impl = None
        fast = kept(x)
        # the CPU kernels round activations to bf16 (about 0.4 % per value)
        rel = ((fast - ref).pow(2).mean().sqrt() / ref.std()).item()
        assert rel <= 0.03, rel
    # il.load(quantization="gguf") reads only the norms and the blocks (no dequantized load
    # first): the same model, so the same logits bit for bit
    direct, _ = il.load(path, device="cpu", dtype=torch.float32, quantization="gguf")
    assert direct.quantization == "gguf"
    assert model_weight_bytes(direct) == model_weight_bytes(kept)
    for ids in PROMPTS:
        x = torch.tensor([ids])
        assert torch.equal(direct(x), kept(x))
    with pytest.raises(QuantizationError, match="already quantized"):
        keep_gguf_blocks(kept, read_gguf(path).weights())


@pytest.mark.parametrize("qtype,kept", [("Q4_1", "gguf"), ("Q8_0", "gguf"), ("F32", None)])
def test_a_server_on_a_cpu_keeps_a_gguf_files_blocks_unless_told(qtype, kept, tok_dir, tmp_path):
    """``infer-lab serve`` with no ``--quantization`` and no ``--dtype``: a GGUF file of blocks
    the kept path holds is served as its blocks on a CPU, dense on a GPU or when a dtype or
    ``--quantization none`` asks for the exact path."""
    from infer_lab.cli import _serving_quantization, build_parser
    from infer_lab.model.loader import cpu_serving_quantization

    path = write_gguf(tmp_path / f"m-{qtype}.gguf", hf_model(vocab_size(tok_dir), tie=True),
                      tok_dir, qtype)
    assert cpu_serving_quantization(path, "cpu") == kept
    assert cpu_serving_quantization(path, "meta") is None  # not a CPU: dense
    assert cpu_serving_quantization(tok_dir, "cpu") is None  # no GGUF file there

    def chosen(*flags: str) -> str | None:
        return _serving_quantization(build_parser().parse_args(
            ["serve", "--model", str(path), "--device", "cpu", *flags]))

    assert chosen() == kept
    assert chosen("--dtype", "float32") is None
    assert chosen("--quantization", "none") is None
    assert chosen("--quantization", "int8") == "int8"


@pytest.mark.parametrize("rows", [1, 2, 3, 33])
def test_q8_0_on_cpu_by_group_calls_or_a_dense_bf16_copy(rows):
    """Both CPU paths of a Q8_0 layer compute the dequantized weight's product to bf16's
    precision, whichever the row count picks."""
    from infer_lab.kernels import quant as kq

    rng = np.random.default_rng(rows)
    w = rng.normal(size=(80, 96)).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    fmt, tensors = gguf_block_tensors(blocks, "Q8_0", 80, 96)
    layer = QuantizedLinear(fmt, tensors, 96, 80, None, 32)
    x = torch.from_numpy(rng.normal(size=(rows, 96)).astype(np.float32))
    ref = x @ layer.dequantize().T
    picked = kq.quant_linear(x, layer)  # picks by rows: the dense copy is made only past the limit
    assert (torch.bfloat16 in layer.__dict__.get("_cpu_dense", {})) == (
        rows > kq.INT8G_GROUP_CALLS_MAX_ROWS)
    for y in (picked, kq.int8g_linear_cpu(x, layer), kq.dense_linear_cpu(x, layer)):
        rel = ((y - ref).norm() / ref.norm()).item()
        assert y.shape == ref.shape and rel <= 1e-2, rel


_FALLBACK = r"""
import sys, torch, infer_lab as il
path = sys.argv[1]
ref, _ = il.load(path, device="cpu", dtype=torch.float32)
kept, _ = il.load(path, device="cpu", dtype=torch.float32, quantization="gguf")
x = torch.tensor([[1, 5, 77, 200, 13, 9, 300, 41]])
a, b = ref(x), kept(x)
rel = ((a - b).pow(2).mean().sqrt() / a.std()).item()
print(torch.backends.cpu.get_cpu_capability(), rel)
"""


def test_kept_blocks_on_a_cpu_without_avx512(tok_dir, tmp_path):
    """The kept-GGUF path (the CPU server's default) on plain AVX2: torch's kernels dispatched
    as on a CPU without AVX-512 (``ATEN_CPU_CAPABILITY``, and oneDNN capped the same way)
    give the dequantized model's logits to the same bf16-activation precision."""
    path = write_gguf(tmp_path / "m.gguf", hf_model(vocab_size(tok_dir), tie=True, seed=3),
                      tok_dir, "Q4_1")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2",
           "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", _FALLBACK, str(path)], env=env, text=True,
                         capture_output=True, check=True).stdout.split()
    assert out[0] == "AVX2", out
    assert float(out[1]) <= 0.03, out
