"""Weight quantization (Chapter 8): round trips within each format's bound, quantized layers
against their dequantized reference, whole models against the unquantized one, bad combinations.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import infer_lab as il
from infer_lab.kernels import quant as qk
from infer_lab.measure.quality import greedy_agreement, perplexity
from infer_lab.model.quantize import (
    QuantizationError,
    QuantizedEmbedding,
    QuantizedLinear,
    dequantize_int4,
    dequantize_int8,
    model_weight_bytes,
    quantize_int4,
    quantize_int8,
    quantize_model,
)
from infer_lab.model.random import random_model
from tests.helpers import make_checkpoint

torch.manual_seed(0)


def test_int8_round_trip_within_half_a_step():
    w = torch.randn(96, 200) * torch.logspace(-3, 1, 96)[:, None]  # rows of very different size
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (96,)
    err = (dequantize_int8(q, s) - w).abs()
    # round-to-nearest: at most half a step, the step being the row's max |w| / 127
    assert (err <= s[:, None] / 2 * (1 + 1e-5)).all()
    assert q.abs().max() == 127  # the largest weight of each row uses the full range


@pytest.mark.parametrize("group", [32, 64])
def test_int4_round_trip_within_half_a_step(group):
    w = torch.randn(48, 192) * 3 + 1
    p, s, m = quantize_int4(w, group)
    assert p.shape == (48, 96) and p.dtype == torch.uint8
    assert s.shape == m.shape == (48, 192 // group) and s.dtype == torch.float16
    err = (dequantize_int4(p, s, m) - w).abs().view(48, -1, group)
    # half a step, plus the fp16 rounding of the stored minimum (at most 2**-11 of its size),
    # which can push the group's top value up to that much past code 15
    bound = s.float()[..., None] / 2 + m.float().abs()[..., None] * 2**-10 + 1e-6
    assert (err <= bound).all()


def test_int4_codes_are_packed_two_per_byte_low_nibble_first():
    codes = torch.randint(0, 16, (3, 64))
    codes[:, 0], codes[:, 1], codes[:, 32], codes[:, 33] = 0, 15, 15, 0  # full range per group
    w = codes.float() * 0.5 - 1.0  # exactly representable: scale 0.5, minimum -1
    p, s, m = quantize_int4(w, 32)
    assert (s.float() == 0.5).all() and (m.float() == -1.0).all()
    assert torch.equal(p.long(), codes[:, 0::2] | (codes[:, 1::2] << 4))
    assert torch.equal(dequantize_int4(p, s, m), w)


def test_bad_group_sizes_raise_clear_errors():
    lin = nn.Linear(576, 64)
    with pytest.raises(QuantizationError, match="does not divide .* 576.*32, 64"):
        QuantizedLinear.from_linear(lin, "int4", 128)
    with pytest.raises(QuantizationError, match="even"):
        QuantizedLinear.from_linear(lin, "int4", 3)
    with pytest.raises(QuantizationError, match="unknown weight format"):
        QuantizedLinear.from_linear(lin, "int3")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("bias", [False, True])
def test_quantized_linear_cpu_path_matches_dequantized_reference(fmt, bias):
    lin = nn.Linear(256, 192, bias=bias)
    layer = QuantizedLinear.from_linear(lin, fmt, 64)
    for rows in (1, 5, 33):
        x = torch.randn(rows, 256)
        ref = qk.quant_linear(x, layer, impl="reference")
        fast = qk.quant_linear(x, layer, backend="torch")
        # the CPU kernels read bf16 activations (chosen for speed): 8 significant bits of x,
        # so each product is off by up to 2**-9 relative; summed over 256 random-sign terms the
        # error grows like sqrt(256) times one term
        tol = 2e-2
        scale = ref.abs().max()
        assert (fast - ref).abs().max() <= tol * scale, (fmt, rows)
    # the reference really is the dequantized weight times x
    x = torch.randn(3, 256)
    expected = x @ layer.dequantize().T + (lin.bias if bias else 0)
    torch.testing.assert_close(qk.quant_linear_ref(x, layer), expected)


def test_cpu_kernels_in_fp32_activations_are_exact_to_fp32():
    """The slow fp32-activation paths of the same kernels: the layout and the zero-point
    conversion are right to fp32 rounding, so the bf16 paths differ only by rounding x."""
    lin = nn.Linear(128, 64, bias=False)
    x = torch.randn(4, 128)
    layer = QuantizedLinear.from_linear(lin, "int8")
    out = qk.int8_linear_cpu(x, layer.qweight, layer.scale, act_dtype=torch.float32)
    torch.testing.assert_close(out, qk.quant_linear_ref(x, layer), atol=1e-5, rtol=1e-5)
    layer = QuantizedLinear.from_linear(lin, "int4", 32)
    out = qk.int4_linear_cpu(x, layer, act_dtype=torch.float32)
    torch.testing.assert_close(out, qk.quant_linear_ref(x, layer), atol=1e-5, rtol=1e-5)


def test_int4_cpu_kernel_refused_shapes_fall_back_to_the_reference():
    layer = QuantizedLinear.from_linear(nn.Linear(64, 40, bias=False), "int4", 32)  # 40 % 16 != 0
    x = torch.randn(2, 64)
    torch.testing.assert_close(qk.quant_linear(x, layer), qk.quant_linear_ref(x, layer))


def test_quant_linear_rejects_wrong_input_width():
    layer = QuantizedLinear.from_linear(nn.Linear(64, 32), "int8")
    with pytest.raises(ValueError, match="64"):
        layer(torch.randn(2, 63))
    with pytest.raises(ValueError, match="impl"):
        qk.quant_linear(torch.randn(2, 64), layer, impl="fastest")


@pytest.fixture(scope="module")
def bundled():
    model, tok = il.load(device="cpu", dtype=torch.float32)
    return model, tok


def _text_ids(tok, n=300):
    text = ("In the beginning God created the heaven and the earth. And the earth was without "
            "form, and void; and darkness was upon the face of the deep. And the Spirit of God "
            "moved upon the face of the waters. And God said, Let there be light: and there was "
            "light. And God saw the light, that it was good: and God divided the light from the "
            "darkness. And God called the light Day, and the darkness he called Night. ") * 3
    return tok.encode(text)[:n]


@pytest.mark.parametrize("fmt,byte_ratio,logit_tol", [("int8", 0.3, 0.03), ("int4", 0.2, 0.2)])
def test_bundled_model_quantized_logits_close(bundled, fmt, byte_ratio, logit_tol):
    model, tok = bundled
    qmodel, _ = il.load(device="cpu", dtype=torch.float32)
    quantize_model(qmodel, fmt)
    assert isinstance(qmodel.embed_tokens, QuantizedEmbedding)
    assert qmodel.lm_head is qmodel.embed_tokens.table  # tied: one storage for both
    assert model_weight_bytes(qmodel) <= byte_ratio * model_weight_bytes(model)
    ids = torch.tensor([_text_ids(tok, 64)])
    ref, out = model(ids), qmodel(ids)
    # The bound: the RMS logit error relative to the logits' spread (std). Round-to-nearest
    # moves each int8 weight by <= 1/254 of its row's max and each int4 (g32) weight by <= 1/30
    # of its group's range; through the 4 layers that measured 0.8 % (int8) and 7 % (int4) of
    # the std. The tolerances are ~3x those, and far below the 0.94 that one layer with its rows
    # out of order gives.
    rel = ((out - ref).pow(2).mean().sqrt() / ref.std()).item()
    assert rel <= logit_tol, rel
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= (0.95 if fmt == "int8" else 0.75)


def test_bundled_model_quality_figures(bundled):
    """The issue's targets: perplexity +1 % (int8) and +10 % (int4) on a held-out text."""
    model, tok = bundled
    ids = _text_ids(tok, 300)
    base = perplexity(model, ids, window=128, stride=64)
    assert base.tokens == len(ids) - 1
    for fmt, limit in (("int8", 1.01), ("int4", 1.10)):
        qmodel, _ = il.load(device="cpu", dtype=torch.float32)
        quantize_model(qmodel, fmt)
        ppl = perplexity(qmodel, ids, window=128, stride=64)
        assert ppl.perplexity <= limit * base.perplexity, (fmt, ppl, base)
        agree = greedy_agreement(model, qmodel, [ids[:12], ids[40:50]], n=12)
        assert agree.tokens == 24 and agree.teacher_forced >= (0.9 if fmt == "int8" else 0.7)


def test_perplexity_window_and_counts(bundled):
    model, tok = bundled
    ids = _text_ids(tok, 100)
    whole = perplexity(model, ids, window=128)
    # a window longer than the text: one forward, every token but the first scored
    logits = model(torch.tensor([ids]))[0]
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    assert whole.tokens == 99 and abs(whole.nll - nll.item()) < 1e-5
    short = perplexity(model, ids, window=16, stride=8)
    assert short.tokens == 99 and short.perplexity > whole.perplexity  # less context, worse
    with pytest.raises(ValueError):
        perplexity(model, ids, window=16, stride=17)
    with pytest.raises(ValueError):
        perplexity(model, ids[:1])


def test_greedy_agreement_of_a_model_with_itself_is_total(bundled):
    model, tok = bundled
    a = greedy_agreement(model, model, [tok.encode("And God said")], n=8)
    assert a.teacher_forced == 1.0 and a.first_divergence == [8]


def _dequantized_twin(model, qmodel):
    """``model`` with every quantized weight replaced by its dequantized value (in place)."""
    with torch.no_grad():
        for name, mod in qmodel.named_modules():
            if isinstance(mod, QuantizedLinear) and name != "embed_tokens.table":
                target = "embed_tokens" if (name == "lm_head" and model.lm_head is None) else name
                model.get_submodule(target).weight.copy_(mod.dequantize())
        model.embed_tokens.weight.copy_(qmodel.embed_tokens.table.dequantize())
    return model


@pytest.mark.parametrize("family", ["llama2_bias", "qwen3", "llama3"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_every_family_equals_its_dequantized_twin(tmp_path, family, fmt):
    """Biases, q/k norms, untied and tied heads: the quantized model computes exactly the model
    whose weights are its dequantized weights (reference path to fp32 rounding; the CPU kernels
    within their activation rounding)."""
    make_checkpoint(tmp_path, family)
    qmodel, _ = il.load(tmp_path, device="cpu", dtype=torch.float32)
    quantize_model(qmodel, fmt)
    tied = qmodel.lm_head is qmodel.embed_tokens.table
    assert tied == (family != "llama2_bias" and family != "qwen3")
    twin = _dequantized_twin(il.load(tmp_path, device="cpu", dtype=torch.float32)[0], qmodel)
    ids = torch.randint(3, 384, (2, 20), generator=torch.Generator().manual_seed(1))
    ref = twin(ids)
    for mod in qmodel.modules():
        if isinstance(mod, QuantizedLinear):
            mod.impl = "reference"
    torch.testing.assert_close(qmodel(ids), ref, atol=1e-4 * ref.abs().max().item(), rtol=0)
    for mod in qmodel.modules():
        if isinstance(mod, QuantizedLinear):
            mod.impl = None
    rel = ((qmodel(ids) - ref).pow(2).mean().sqrt() / ref.std()).item()
    # the CPU kernels round activations to bf16, which these large random weights amplify to a
    # few percent (measured 1-2 %)
    assert rel <= 0.05, rel


def test_bad_combinations_raise_and_leave_the_model_alone():
    cfg = il.ModelConfig.from_dict(dict(
        model_type="llama", vocab_size=128, hidden_size=96, intermediate_size=192,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=64, tie_word_embeddings=True))
    model = random_model(cfg, seed=0)
    before = model_weight_bytes(model)
    with pytest.raises(QuantizationError, match="group_size 64 does not divide"):
        quantize_model(model, "int4", 64)  # 96 takes 32, not 64
    assert model_weight_bytes(model) == before and not hasattr(model, "quantization")
    with pytest.raises(QuantizationError, match="one of"):
        quantize_model(model, "int2")
    with pytest.raises(QuantizationError, match="gguf"):
        quantize_model(model, "gguf")
    quantize_model(model, "int8")
    with pytest.raises(QuantizationError, match="already quantized"):
        quantize_model(model, "int4", 32)


def test_load_with_quantization_and_its_errors():
    model, tok = il.load(quantization="int4", group_size=64)
    assert model.quantization == "int4-g64" and tok.vocab_size == model.config.vocab_size
    with pytest.raises(QuantizationError, match="one of"):
        il.load(quantization="int5")
    with pytest.raises(QuantizationError, match="safetensors checkpoint"):
        il.load(quantization="gguf")  # the bundled model has no GGUF blocks to keep
    with pytest.raises(QuantizationError, match="does not divide"):
        il.load(quantization="int4", group_size=96)  # 256 wide layers: 96 does not divide
