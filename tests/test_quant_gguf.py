"""``quantization="gguf"``: a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks kept as they are give the
same logits as the dequantized load (the bits are re-laid, never rounded again)."""

from __future__ import annotations

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
