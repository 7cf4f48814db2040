"""``quantization="gguf"``: a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks and Q4_K / Q5_K / Q6_K
super-blocks kept as they are give the same weights, bit for bit, and the same logits as the
dequantized load (the bits are re-laid, never rounded again)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import infer_lab as il
from infer_lab.kernels import quant as qk
from infer_lab.model.generate import stream_naive
from infer_lab.model.gguf import read_gguf
from infer_lab.model.quant.kquants import CODECS
from infer_lab.model.quantize import (
    ConcatLinear,
    QuantizationError,
    QuantizedEmbedding,
    QuantizedLinear,
    gguf_block_tensors,
    keep_gguf_blocks,
    model_weight_bytes,
)
from tests.helpers import assert_greedy_equal, save_tokenizer
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
    with pytest.raises(QuantizationError, match="blk.0.attn_q.weight: .*Q5_0"):
        gguf_block_tensors(np.zeros((1, 22), np.uint8), "Q5_0", 1, 32, "blk.0.attn_q.weight")


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


@pytest.mark.parametrize("groups", [3, 32, 33, 64])
def test_one_row_takes_the_group_calls_only_while_a_row_has_few_groups(groups):
    """At one row the per-group int8 calls pay a fixed cost per group, so a layer whose rows
    have more than ``INT8G_GROUP_CALLS_MAX_GROUPS`` groups takes its bf16 copy instead; both
    give the dequantized weight's product to bf16's precision."""
    from infer_lab.kernels import quant as kq

    rng = np.random.default_rng(groups)
    k = 32 * groups
    w = rng.normal(size=(48, k)).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    fmt, tensors = gguf_block_tensors(blocks, "Q8_0", 48, k)
    layer = QuantizedLinear(fmt, tensors, k, 48, None, 32)
    x = torch.from_numpy(rng.normal(size=(1, k)).astype(np.float32))
    y = kq.quant_linear(x, layer)
    copied = torch.bfloat16 in layer.__dict__.get("_cpu_dense", {})
    assert copied == (groups > kq.INT8G_GROUP_CALLS_MAX_GROUPS)
    ref = x @ layer.dequantize().T
    assert ((y - ref).norm() / ref.norm()).item() <= 1e-2


@pytest.mark.parametrize("rows", [1, 3])
def test_q8_0_group_calls_add_up_exactly_as_a_plain_fp32_sum(rows):
    """The per-group int8 calls' partials are added in fp32 in group order: the same numbers
    as ``sum_g int8mm(x_g, q_g, s_g).float()`` written out, bit for bit."""
    from infer_lab.kernels import quant as kq

    rng = np.random.default_rng(7 + rows)
    w = rng.normal(size=(64, 160)).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    fmt, tensors = gguf_block_tensors(blocks, "Q8_0", 64, 160)
    layer = QuantizedLinear(fmt, tensors, 160, 64, None, 32)
    x = torch.from_numpy(rng.normal(size=(rows, 160)).astype(np.float32))
    xa, s = x.to(torch.bfloat16), layer.scale.t().to(torch.bfloat16)
    expect = torch.zeros(rows, 64)
    for g in range(5):
        expect += torch.ops.aten._weight_int8pack_mm(
            xa[:, 32 * g : 32 * (g + 1)].contiguous(), layer.qweight[g], s[g].contiguous()
        ).float()
    assert torch.equal(kq.int8g_linear_cpu(x, layer), expect)


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


# ------------------------------------------------------------------------------------ K-quants
Q = gguf.GGMLQuantizationType
# How each K-quant is kept (gguf_block_tensors' docstrings say why each is exact): the layer's
# format and group size, and its bytes per 256-weight super-block (codes, float32 scales and
# minimums) beside the file's.
K_KEPT = {"Q4_K": ("int4", 32, 128 + 8 * 8, 144), "Q5_K": ("int8g", 32, 256 + 8 * 8, 176),
          "Q6_K": ("int8g", 16, 256 + 16 * 4, 210)}
# llama.cpp's Q4_K_M mix, in small: Q4_K, with v in Q6_K (so the fused q/k/v mixes formats), one
# layer's down projection in Q6_K, and the tied embedding (the LM head) in Q6_K.
Q4_K_M = {"blk.0.attn_v.weight": "Q6_K", "blk.1.attn_v.weight": "Q6_K",
          "blk.0.ffn_down.weight": "Q6_K", "token_embd.weight": "Q6_K"}
K_FILES = {"Q4_K": ("Q4_K", None, False), "Q5_K": ("Q5_K", None, False),
           "Q6_K": ("Q6_K", None, True), "Q4_K_M": ("Q4_K", Q4_K_M, True)}
D_OFFSET = {"Q4_K": 0, "Q5_K": 0, "Q6_K": 208}  # the fp16 super-block scale d


def _k_blocks(qtype: str, rows: int, cols: int, source: str, rng) -> np.ndarray:
    """``rows x cols`` weights in ``qtype``: the package's encoder on normal weights, or arbitrary
    bytes (every code, scale and minimum bit pattern) with finite fp16 scales of either sign."""
    if source == "encoder":
        w = torch.from_numpy(rng.normal(size=(rows, cols)).astype(np.float32))
        return CODECS[qtype][0](w).numpy().reshape(rows, -1)
    size = K_KEPT[qtype][3]
    raw = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    for off in (0, 2) if qtype != "Q6_K" else (208,):
        scale = rng.uniform(-0.5, 0.5, size=raw.shape[:2]).astype(np.float16)
        raw[..., off:off + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("source", ["encoder", "random bytes"])
@pytest.mark.parametrize("qtype", sorted(K_KEPT))
def test_k_blocks_relaid_without_rounding(qtype, source, monkeypatch):
    """Every weight of the kept layer is ``gguf``'s dequantization, bit for bit; its CPU kernels
    give the product to bf16's precision (the default, activations rounded to 8 significant
    bits: about 0.4 % per value) and to fp32 summation order with fp32 activations."""
    rng = np.random.default_rng(len(source) + ord(qtype[1]))
    rows, cols = 48, 512
    blocks = _k_blocks(qtype, rows, cols, source, rng)
    want = torch.from_numpy(gguf.quants.dequantize(blocks, Q[qtype]).reshape(rows, cols))
    fmt, t = gguf_block_tensors(blocks, qtype, rows, cols)
    kept_fmt, group, kept_bytes, file_bytes = K_KEPT[qtype]
    assert (fmt, cols // t["scale"].shape[1]) == (kept_fmt, group)
    layer = QuantizedLinear(fmt, t, cols, rows, None, group)
    assert torch.equal(layer.dequantize(), want)
    supers = rows * cols // 256
    assert (blocks.nbytes, layer.weight_bytes) == (supers * file_bytes, supers * kept_bytes)
    assert want.abs().max() > 0 and torch.isfinite(want).all()
    for n in (1, 5):  # one row: the per-group int8 calls (int8g); five: its dense bf16 copy
        x = torch.from_numpy(rng.normal(size=(n, cols)).astype(np.float32))
        ref = x @ want.T
        y = qk.quant_linear(x, layer)
        rel = ((y - ref).norm() / ref.norm()).item()
        assert y.shape == ref.shape and rel <= 1e-2, rel
        with monkeypatch.context() as m:
            m.setattr(qk, "CPU_ACTIVATION", None)
            y32 = qk.quant_linear(x, layer)
        assert (y32 - ref).abs().max() <= 1e-5 * ref.abs().max()


def _matrices(model) -> dict[str, torch.Tensor]:
    """Every matrix of ``model`` as the weight it stands for, by name (the embedding's table)."""
    out = {"embed_tokens": (model.embed_tokens.table.dequantize()
                            if isinstance(model.embed_tokens, QuantizedEmbedding)
                            else model.embed_tokens.weight)}
    for name, mod in model.named_modules():
        if name.startswith("embed_tokens"):
            continue  # above (and the LM head too, when tied: named once)
        if isinstance(mod, torch.nn.Linear):
            out[name] = mod.weight
        elif isinstance(mod, (QuantizedLinear, ConcatLinear)) and ".parts." not in name:
            out[name] = mod.dequantize()
    return out


@pytest.mark.parametrize("kind", sorted(K_FILES))
def test_kept_k_quant_files_are_the_dequantized_model(kind, tok_dir, tmp_path, monkeypatch):
    """A file encoded with the package's K-quant encoders, loaded kept and dense: the same
    weights bit for bit, the same logits (to fp32 rounding through the reference, to bf16's
    precision through the default CPU kernels) and, with fp32 activations, the same greedy
    tokens through ``il.LLM`` one request at a time (the batch-1 kernels) as the dense model's."""
    qtype, types, tie = K_FILES[kind]
    source = hf_model(vocab_size(tok_dir), tie=tie, seed=11)
    path = write_gguf(tmp_path / f"m-{kind}.gguf", source, tok_dir, qtype,
                      tensor_types=types, encode_k=True)
    dense, tok = il.load(path, device="cpu", dtype=torch.float32)
    kept, _ = il.load(path, device="cpu", dtype=torch.float32, quantization="gguf")
    assert kept.quantization == "gguf" and (kept.lm_head is kept.embed_tokens.table) == tie
    want, got = _matrices(dense), _matrices(kept)
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert torch.equal(got[name], w), name
    mixed = {n for n, m in kept.named_modules() if isinstance(m, ConcatLinear)}
    assert mixed == ({"layers.0.self_attn.qkv_proj", "layers.1.self_attn.qkv_proj"}
                     if types else set())
    assert model_weight_bytes(kept) < 0.4 * model_weight_bytes(dense)
    layers = [m for m in kept.modules() if isinstance(m, QuantizedLinear)]
    for ids in PROMPTS:
        x = torch.tensor([ids])
        ref = dense(x)
        for mod in layers:
            mod.impl = "reference"
        torch.testing.assert_close(kept(x), ref, atol=2e-5 * ref.abs().max().item(), rtol=0)
        for mod in layers:
            mod.impl = None
        rel = ((kept(x) - ref).pow(2).mean().sqrt() / ref.std()).item()
        assert rel <= 0.03, rel  # bf16 activations, as in the Q4_0/Q4_1/Q8_0 test above
    monkeypatch.setattr(qk, "CPU_ACTIVATION", None)
    llm = il.LLM(kept, tokenizer=tok, max_num_seqs=4)
    params = il.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for ids in PROMPTS:
        out = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
        ref_ids = list(stream_naive(dense, ids, 12, set()))

        def at(prefix, ids=ids):
            with torch.inference_mode():
                return dense(torch.tensor([ids + prefix]), last_only=True)[0, -1]
        assert len(ref_ids) == 12
        assert_greedy_equal(out, ref_ids, at)


@pytest.mark.parametrize("types,kept", [(Q4_K_M, "gguf"), ({"token_embd.weight": "F16"}, None)])
def test_a_server_on_a_cpu_keeps_a_k_quant_file_whose_every_matrix_is_kept(types, kept, tok_dir,
                                                                           tmp_path):
    """A K-quant mix is served as its blocks; a file with one matrix of a type not kept as
    blocks (F16 here) is served dense, and asking to keep its blocks names that tensor."""
    from infer_lab.model.loader import cpu_serving_quantization

    path = write_gguf(tmp_path / "m.gguf", hf_model(vocab_size(tok_dir), tie=True), tok_dir,
                      "Q4_K", tensor_types=types)
    assert cpu_serving_quantization(path, "cpu") == kept
    if kept is None:
        with pytest.raises(QuantizationError, match=r"token_embd\.weight: .*F16 are not kept"):
            il.load(path, device="cpu", quantization="gguf")


@pytest.mark.parametrize("qtype,bad", [("Q4_K", np.inf), ("Q6_K", np.nan), ("Q5_K", -np.inf)])
def test_a_k_block_with_a_bad_scale_is_refused_by_name(qtype, bad, tok_dir, tmp_path):
    """One super-block's fp16 ``d`` set to inf or NaN in the file: keeping its blocks raises,
    naming the tensor and where, instead of serving NaN logits."""
    path = write_gguf(tmp_path / "m.gguf", hf_model(vocab_size(tok_dir), tie=True), tok_dir,
                      qtype, encode_k=True)
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_up.weight")
    row = 3  # ffn_up's rows are 256 weights: one super-block each, no row permutation
    at = int(tensor.data_offset) + row * K_KEPT[qtype][3] + D_OFFSET[qtype]
    data = bytearray(path.read_bytes())
    data[at:at + 2] = np.array([bad], np.float16).tobytes()
    path.write_bytes(bytes(data))
    sub = 16 if qtype == "Q6_K" else 8
    with pytest.raises(QuantizationError, match=(
            rf"blk\.1\.ffn_up\.weight: {sub} {qtype} sub-block\(s\) with a NaN or infinite "
            rf"scale \(the first at row {row}, columns 0-{256 // sub - 1}\)")):
        il.load(path, device="cpu", quantization="gguf")
