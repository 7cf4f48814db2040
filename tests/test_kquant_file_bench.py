"""``benchmarks/kquant_file.py``'s writer on the bundled model: a llama.cpp Q4_K_M mix (Q4_K,
Q6_K, and the Q4_1 / Q8_0 fallbacks for rows that are not whole 256-weight super-blocks) that
the CPU server keeps as blocks, each matrix in the format its type maps to, with the logits of
its own dequantized load. No timing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import infer_lab as il
from benchmarks.kquant_file import (
    kept_layout,
    logits_check,
    matrix_bits,
    use_more_bits,
    write_kquant_gguf,
)
from infer_lab.model.loader import BUNDLED_MODEL_DIR, cpu_serving_quantization
from tests.test_gguf import write_gguf

pytest.importorskip("gguf")


def test_use_more_bits_is_llama_cpps_choice():
    """14 of SmolLM2's 30 layers (the first 3, the last 4, every third between); of the bundled
    model's 4, layers 2 and 3."""
    assert [i for i in range(30) if use_more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20,
                                                              23, 26, 27, 28, 29]
    assert [i for i in range(4) if use_more_bits(i, 4)] == [2, 3]


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> tuple[Path, Path, dict]:
    from transformers import LlamaForCausalLM

    tmp = tmp_path_factory.mktemp("kq")
    source = LlamaForCausalLM.from_pretrained(BUNDLED_MODEL_DIR, dtype=torch.float32).eval()
    f32 = write_gguf(tmp / "tiny-f32.gguf", source, BUNDLED_MODEL_DIR, "F32")
    dest = tmp / "tiny-q4_k_m.gguf"
    return f32, dest, write_kquant_gguf(f32, dest)


def test_the_mix_follows_q4_k_m_with_fallbacks(tiny_files):
    """hidden 256: Q4_K everywhere it fits, Q6_K for the tied embedding and layers 2-3's v;
    the down projection's rows (704) are not whole super-blocks: Q4_1 / Q8_0 there."""
    _, dest, tensors = tiny_files
    for name, t in tensors.items():
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        more = layer in (2, 3)
        if name == "token_embd.weight":
            want = ("Q6_K", "Q6_K")
        elif name.endswith("ffn_down.weight"):
            want = ("Q6_K", "Q8_0") if more else ("Q4_K", "Q4_1")
        elif name.endswith("attn_v.weight"):
            want = ("Q6_K", "Q6_K") if more else ("Q4_K", "Q4_K")
        else:
            want = ("Q4_K", "Q4_K")
        assert (t["wanted"], t["type"]) == want, name
    bits = matrix_bits(dest)
    assert bits["types"] == {"Q4_K": 22, "Q6_K": 3, "Q4_1": 2, "Q8_0": 2}
    assert 4.5 < bits["bits_per_weight"] < 6.6


def test_kept_as_k_quant_blocks_with_the_dequantized_logits(tiny_files):
    f32, dest, _ = tiny_files
    assert cpu_serving_quantization(dest, "cpu") == "gguf"
    kept, tok = il.load(dest, device="cpu", dtype=torch.float32, quantization="gguf")
    layout = kept_layout(kept)
    assert layout["layers.0.mlp.gate_up_proj"] == "int4/g32/float32"  # Q4_K
    assert layout["layers.0.mlp.down_proj"] == "int4/g32/float16"  # Q4_1
    assert layout["layers.3.mlp.down_proj"] == "int8g/g32/float16"  # Q8_0
    assert layout["layers.0.self_attn.qkv_proj"] == "int4/g32/float32"
    assert layout["layers.2.self_attn.qkv_proj"] == "int4/g32/float32+int8g/g16/float32"
    assert layout["embed_tokens.table"] == "int8g/g16/float32"  # Q6_K, the tied head too
    assert kept.lm_head is kept.embed_tokens.table
    ids = torch.tensor(tok.encode("In the beginning God created the heaven and the earth."))
    check = logits_check(dest, ids)
    assert check["ref_max_abs_diff"] <= check["ref_tolerance"], check
    assert check["default_rel_rms"] <= check["default_tolerance"], check
    # and the encoding is close to the weights it was made from
    src, _ = il.load(f32, device="cpu", dtype=torch.float32)
    dense, _ = il.load(dest, device="cpu", dtype=torch.float32)
    for name, bound in (("layers.0.mlp.gate_up_proj", 0.12),  # Q4_K
                        ("layers.2.mlp.down_proj", 0.01),  # Q8_0
                        ("embed_tokens", 0.04)):  # Q6_K
        a = src.get_submodule(name).weight
        b = dense.get_submodule(name).weight
        rel = ((a - b).norm() / a.norm()).item()
        assert 0 < rel <= bound, (name, rel)
