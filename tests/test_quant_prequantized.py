"""GPTQ and AWQ checkpoint directories (``quantization_config``) through ``il.load``: written from
a random-weight transformers model with the project's own GPTQ and AWQ's GEMM packing, loaded
into the engine's int4, and run: the engine's greedy tokens are the dequantized dense model's
(fp32) token for token, and every malformed config or tensor is refused by name. GPTQ's two
other layouts, a short last group and act-order, load with every weight the checkpoint's bit for
bit (checked against AutoGPTQ's formula written here), and so does a quantized LM head."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import infer_lab as il
from infer_lab.model.generate import stream_naive
from infer_lab.model.quant import FormatError
from infer_lab.model.quant.awq_checkpoint import AWQ_ORDER, pack_awq, unpack_awq
from infer_lab.model.quant.gptq import gptq_int4, rtn_int4
from infer_lab.model.quant.gptq_checkpoint import pack_gptq
from infer_lab.model.quantize import QuantizationError, QuantizedLinear
from tests.helpers import assert_greedy_equal, make_checkpoint

GEN = torch.Generator().manual_seed(0)
GROUP = 32
CONFIGS = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
             "sym": False, "checkpoint_format": "gptq"},
    "gptq_v2": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                "sym": False, "checkpoint_format": "gptq_v2"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
            "version": "gemm"},
}
PROMPTS = [[1, 5, 9, 33, 2, 77], [1, 200, 14, 3]]


def _hessian(k: int) -> torch.Tensor:
    """``2 X^T X / n`` of correlated inputs with a few large channels."""
    mix = torch.randn(k, k, generator=GEN) / k**0.5 + torch.eye(k)
    x = torch.randn(256, k, generator=GEN) @ mix
    x[:, :3] *= 10
    return 2 * x.t() @ x / 256


def _input_of(name: str) -> str:
    """Which input a projection reads: q/k/v share one, gate/up another (so share a Hessian,
    and under act-order one column order, as a real calibration gives them)."""
    module, _, proj = name.removesuffix(".weight").rpartition(".")
    return module + {"q_proj": ".qkv", "k_proj": ".qkv", "v_proj": ".qkv", "gate_proj": ".gu",
                     "up_proj": ".gu"}.get(proj, f".{proj}")


def write_pair(src: Path, root: Path, kind: str, group: int = GROUP, act_order: bool = False,
               head: bool = False) -> tuple[Path, Path]:
    """A ``kind`` checkpoint of ``src``'s model and the dense checkpoint of its dequantization
    (GPTQ in groups of ``group``, with ``act_order``; ``head``: the LM head quantized too)."""
    from safetensors.torch import load_file, save_file

    qdir, ddir = root / kind, root / f"{kind}-dense"
    for d in (qdir, ddir):
        shutil.copytree(src, d)
    packed, dense = {}, {}
    hessians: dict[str, torch.Tensor] = {}
    for name, w in load_file(src / "model.safetensors").items():
        if not (name.endswith("_proj.weight") or head and name == "lm_head.weight"):
            packed[name] = dense[name] = w
            continue
        w = w.float()
        if kind == "awq":  # AWQ's int4 is plain groups (its scales fold into the op before)
            t, tensors = rtn_int4(w, group, name), pack_awq
        else:
            h = hessians.setdefault(_input_of(name), _hessian(w.shape[1]))
            t = gptq_int4(w, h, group, act_order=act_order, name=name)
            tensors = pack_gptq if kind == "gptq" else lambda t, n: pack_gptq(t, n, 0)
        prefix = name.removesuffix(".weight")
        packed.update({f"{prefix}.{k}": v for k, v in tensors(t, name).items()})
        dense[name] = t.dequantize()
    save_file(packed, qdir / "model.safetensors")
    save_file(dense, ddir / "model.safetensors")
    extra = {"group_size": group, **({} if kind == "awq" else {"desc_act": act_order})}
    set_quant_config(qdir, {**CONFIGS[kind], **extra, **({"lm_head": True} if head else {})})
    return qdir, ddir


def set_quant_config(path: Path, qc: dict | None) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(raw))


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("src")
    make_checkpoint(path, "qwen2")  # q/k/v biases, tied head: the pieces a loader must join
    return path


@pytest.mark.parametrize("kind", ["gptq", "gptq_v2", "awq"])
def test_a_prequantized_checkpoint_runs_in_int4_as_its_dequantization(source, tmp_path, kind):
    qdir, ddir = write_pair(source, tmp_path, kind)
    model, tok = il.load(qdir, device="cpu", dtype=torch.float32)
    dense, _ = il.load(ddir, device="cpu", dtype=torch.float32)
    method = CONFIGS[kind]["quant_method"]
    assert model.quantization == f"{method}-int4-g{GROUP}"
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * model.config.num_hidden_layers
    assert all(m.fmt == "int4" and m.group_size == GROUP for m in layers)
    assert model.layers[0].self_attn.qkv_proj.bias is not None  # the pieces' biases, joined
    # the fp32 dequantize-matmul path: the dense model's logits bit for bit
    for m in layers:
        m.impl = "reference"
    for ids in PROMPTS:
        x = torch.tensor([ids])
        assert torch.equal(model(x), dense(x))
    # the engine (batched, paged KV) on that path: the dense model's greedy tokens
    assert_engine_greedy_equals_dense(model, dense, tok)
    # the CPU int4 kernel (bf16 activations): close to the dense logits
    for m in layers:
        m.impl = None
    x = torch.tensor([PROMPTS[0]])
    ref = dense(x)
    rel = ((model(x) - ref).pow(2).mean().sqrt() / ref.std()).item()
    assert rel <= 0.03, rel


def autoawq_dequantize(qweight, qzeros, scales, group_size):
    """AWQ GEMM's dequantization as AutoAWQ's ``dequantize_gemm`` states it (unpack each int32
    into its 8 nibbles, undo the interleave with the reverse order, ``(q - z) * s``), written
    here independently of :mod:`infer_lab.model.quant.awq_checkpoint`."""
    shifts = torch.arange(0, 32, 4)
    iw = ((qweight[:, :, None] >> shifts) & 15).reshape(qweight.shape[0], -1)
    iz = ((qzeros[:, :, None] >> shifts) & 15).reshape(qzeros.shape[0], -1)
    reverse = torch.arange(iw.shape[1]).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].reshape(-1)
    iw, iz = iw[:, reverse], iz[:, reverse]
    s = scales.float().repeat_interleave(group_size, 0)
    return ((iw - iz.repeat_interleave(group_size, 0)) * s).t()  # [N, K]


def test_awq_gemm_packing_matches_autoawq():
    assert [AWQ_ORDER.index(i) for i in range(8)] == [0, 4, 1, 5, 2, 6, 3, 7]
    t = rtn_int4(torch.randn(48, 96, generator=GEN), GROUP)
    ckpt = pack_awq(t)
    assert ckpt["qweight"].shape == (96, 6) and ckpt["qweight"].dtype == torch.int32
    assert ckpt["qzeros"].shape == (3, 6) and ckpt["scales"].shape == (3, 48)
    assert torch.equal(autoawq_dequantize(**ckpt, group_size=GROUP), t.dequantize())
    back = unpack_awq(ckpt, GROUP)
    for field in ("qweight", "scales", "zeros", "g_idx"):
        assert torch.equal(getattr(back, field), getattr(t, field)), field


def _tamper(qdir: Path, name: str, value: torch.Tensor | None) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(qdir / "model.safetensors")
    if value is None:
        del sd[name]
    else:
        sd[name] = value
    save_file(sd, qdir / "model.safetensors")


@pytest.mark.parametrize("change,match", [
    ({"bits": 8}, r"quantization_config\.bits is 8"),
    ({"group_size": 0}, r"quantization_config\.group_size is 0"),
    ({"quant_method": "bitsandbytes"}, r"quant_method is 'bitsandbytes'"),
    ({"checkpoint_format": "marlin"}, r"checkpoint_format is 'marlin'"),
    ({"sym": True}, r"_proj\.qzeros: quantization_config\.sym is true"),
    ({"group_size": 64}, r"_proj: GPTQ shapes do not agree with group_size 64"),
])
def test_malformed_gptq_configs_are_refused(source, tmp_path, change, match):
    qdir, _ = write_pair(source, tmp_path, "gptq")
    set_quant_config(qdir, {**CONFIGS["gptq"], **change})
    with pytest.raises(FormatError, match=match):
        il.load(qdir, device="cpu", dtype=torch.float32)


def test_malformed_tensors_are_refused_by_name(source, tmp_path):
    qdir, _ = write_pair(source, tmp_path, "gptq")
    prefix = "model.layers.1.mlp.down_proj"
    _tamper(qdir, f"{prefix}.scales", None)
    with pytest.raises(FormatError, match=rf"{prefix}: GPTQ tensors missing: \['scales'\]"):
        il.load(qdir, device="cpu", dtype=torch.float32)
    qdir, _ = write_pair(source, tmp_path / "b", "gptq")
    _tamper(qdir, f"{prefix}.qweight", torch.zeros(8, 64, dtype=torch.int32))  # K 64, not 128
    with pytest.raises(FormatError, match=rf"{prefix}: GPTQ shapes do not agree"):
        il.load(qdir, device="cpu", dtype=torch.float32)
    qdir, _ = write_pair(source, tmp_path / "c", "gptq")
    _tamper(qdir, f"{prefix}.qweight", torch.zeros(16, 64))  # float words
    with pytest.raises(FormatError, match=rf"{prefix}\.qweight: GPTQ stores int32 words"):
        il.load(qdir, device="cpu", dtype=torch.float32)
    qdir, _ = write_pair(source, tmp_path / "d", "awq")
    _tamper(qdir, f"{prefix}.qzeros", torch.zeros(4, 4, dtype=torch.int32))  # 32 outputs, not 64
    with pytest.raises(FormatError, match=rf"{prefix}: AWQ shapes do not agree"):
        il.load(qdir, device="cpu", dtype=torch.float32)
    # consistent tensors, but not the shape the config implies: the loader's own check
    qdir, _ = write_pair(source, tmp_path / "e", "awq")
    t = pack_awq(rtn_int4(torch.randn(64, 96, generator=GEN), GROUP))
    for k, v in t.items():
        _tamper(qdir, f"{prefix}.{k}", v)
    with pytest.raises(il.CheckpointError, match=rf"{prefix} \(unpacked\).* shape \(64, 96\)"):
        il.load(qdir, device="cpu", dtype=torch.float32)


def test_wrong_quantization_option_is_refused(source, tmp_path):
    qdir, ddir = write_pair(source, tmp_path, "gptq")
    with pytest.raises(QuantizationError, match="already quantized with GPTQ"):
        il.load(qdir, device="cpu", quantization="int4")
    with pytest.raises(QuantizationError, match="has no quantization_config"):
        il.load(ddir, device="cpu", quantization="awq")
    assert il.load(qdir, device="cpu", quantization="gptq")[0].quantization == "gptq-int4-g32"


def checkpoint_dequantize(qweight, qzeros, scales, g_idx, zero_offset=1):
    """``w[n, k] = scales[g_idx[k], n] * (q - zero[g_idx[k], n])`` from a GPTQ checkpoint's
    packed tensors, as AutoGPTQ's torch path states it (8 nibbles per int32, low first; v1
    zeros stored minus one), written here independently of
    :mod:`infer_lab.model.quant.gptq_checkpoint`."""
    shifts = torch.arange(0, 32, 4)
    q = ((qweight[:, None, :] >> shifts[None, :, None]) & 15).reshape(-1, qweight.shape[1])
    z = ((qzeros[:, :, None] >> shifts) & 15).reshape(qzeros.shape[0], -1) + zero_offset
    g = g_idx.long()
    return (scales.float()[g] * (q - z[g])).t()  # [N, K]


@pytest.mark.parametrize("k,group,act_order,sub,moved", [
    (576, 128, False, 64, False),  # SmolLM2's width at g128: 4 x 128 + 64
    (576, 128, True, 64, True),
    (160, 64, True, 32, True),  # 64 + 64 + 32
    (192, 64, True, 64, True),  # act-order alone
    (576, -1, True, 64, False),  # one group per row: act-order moves no group
])
def test_ragged_and_act_order_layers_are_the_checkpoints_weights(k, group, act_order, sub,
                                                                 moved, monkeypatch):
    from infer_lab.kernels import quant as qk
    from infer_lab.model.quant.gptq_checkpoint import to_quantized_linear, unpack_gptq

    w = torch.randn(48, k, generator=GEN)
    t = gptq_int4(w, _hessian(k), k if group == -1 else group, act_order=act_order)
    ckpt = pack_gptq(t)
    layer = to_quantized_linear(unpack_gptq(ckpt), None, "w", k if group == -1 else group)
    assert layer.group_size == sub
    assert (layer.input_perm is not None) == moved
    want = checkpoint_dequantize(**ckpt)
    assert torch.equal(layer.dequantize(), want)  # bit for bit, every weight
    x = torch.randn(5, k, generator=GEN)
    ref = x @ want.t()
    layer.impl = "reference"
    assert torch.equal(layer(x), ref)
    layer.impl = None  # the CPU int4 kernel (fp32 activations) on the gathered columns
    monkeypatch.setattr(qk, "CPU_ACTIVATION", None)
    tol = 1e-5 * ref.abs().max()
    assert (layer(x) - ref).abs().max() <= tol
    if moved:  # the gather is what makes it right: without it the product is wrong
        stored = qk.int4_linear_cpu(x, layer)
        assert (stored - ref).abs().max() > 100 * tol
    tq_out = qk.quant_linear(x, layer, backend="triton")  # Triton's interpreter on CPU
    assert (tq_out - ref).abs().max() <= tol


def _named_layers(model) -> dict[str, QuantizedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def test_a_ragged_act_order_checkpoint_runs_as_its_dequantization(tmp_path, monkeypatch):
    """Hidden 96 and intermediate 160 at group 64 leave a short last group in every layer (the
    SmolLM2-at-g128 case, smaller), and act-order permutes every layer's groups."""
    from transformers import AutoModelForCausalLM

    from infer_lab.kernels import quant as qk

    src = tmp_path / "src"
    make_checkpoint(src, "qwen2", hidden_size=96, intermediate_size=160)
    qdir, ddir = write_pair(src, tmp_path, "gptq", group=64, act_order=True)
    model, tok = il.load(qdir, device="cpu", dtype=torch.float32)
    dense, _ = il.load(ddir, device="cpu", dtype=torch.float32)
    assert model.quantization == "gptq-int4-g64"
    layers = _named_layers(model)
    assert len(layers) == 4 * model.config.num_hidden_layers
    for name, m in layers.items():
        assert m.group_size == 32 and m.input_perm is not None, name
        assert torch.equal(m.dequantize(), dense.get_submodule(name).weight), name
    # the dense model is transformers' reading of the dequantized checkpoint
    hf = AutoModelForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
    x = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(dense(x), hf(x).logits, rtol=1e-4, atol=1e-4)
    for m in layers.values():
        m.impl = "reference"
    for ids in PROMPTS:
        x = torch.tensor([ids])
        assert torch.equal(model(x), dense(x))
    # the engine on the CPU int4 kernel (fp32 activations): the dense model's greedy tokens
    for m in layers.values():
        m.impl = None
    monkeypatch.setattr(qk, "CPU_ACTIVATION", None)
    assert_engine_greedy_equals_dense(model, dense, tok)


def _act_order_dir(source: Path, root: Path) -> Path:
    return write_pair(source, root, "gptq", act_order=True)[0]


def test_g_idx_of_neither_layout_is_refused_by_name(source, tmp_path):
    from safetensors.torch import load_file

    name = "model.layers.0.mlp.down_proj"
    qdir = _act_order_dir(source, tmp_path / "a")
    g_idx = load_file(qdir / "model.safetensors")[f"{name}.g_idx"]
    bad = g_idx.clone()
    bad[int((g_idx == 0).nonzero()[0])] = 1  # group 0 one input short, group 1 one over
    _tamper(qdir, f"{name}.g_idx", bad)
    with pytest.raises(FormatError, match=rf"{name}\.g_idx: its groups hold \[31, 33, 32, 32\]"):
        il.load(qdir, device="cpu", dtype=torch.float32)
    qdir = _act_order_dir(source, tmp_path / "b")
    bad = g_idx.clone()
    bad[0] = 4  # 4 groups of scales: 0..3
    _tamper(qdir, f"{name}.g_idx", bad)
    with pytest.raises(FormatError, match=rf"{name}: g_idx holds groups 0\.\.4 but .* 4 groups"):
        il.load(qdir, device="cpu", dtype=torch.float32)
    # consistent groups, but not the config's group_size (two of 64 where it says 32)
    qdir = _act_order_dir(source, tmp_path / "c")
    _tamper(qdir, f"{name}.g_idx", (torch.arange(128) // 64 * 2).to(torch.int32))
    with pytest.raises(FormatError, match=rf"{name}\.g_idx: its groups hold \[64, 0, 64, 0\]"):
        il.load(qdir, device="cpu", dtype=torch.float32)
    # act-order groups under desc_act false: vLLM would ignore g_idx, so refuse
    qdir = _act_order_dir(source, tmp_path / "d")
    set_quant_config(qdir, CONFIGS["gptq"])
    with pytest.raises(FormatError, match=r"_proj\.g_idx: its groups are not consecutive "
                                          r".*quantization_config\.desc_act is false"):
        il.load(qdir, device="cpu", dtype=torch.float32)


def test_fused_pieces_with_different_column_orders_are_refused(source, tmp_path):
    from safetensors.torch import load_file

    qdir = _act_order_dir(source, tmp_path)
    prefix = "model.layers.1.self_attn"
    g_idx = load_file(qdir / "model.safetensors")[f"{prefix}.k_proj.g_idx"]
    _tamper(qdir, f"{prefix}.k_proj.g_idx", g_idx.flip(0))  # a valid layout, another order
    with pytest.raises(FormatError, match=r"layers\.1\.self_attn\.qkv_proj: its pieces "
                                          r"\(q/k/v or gate/up\) have different g_idx"):
        il.load(qdir, device="cpu", dtype=torch.float32)


def test_a_quantized_lm_head_loads_untied_and_is_refused_otherwise(tmp_path):
    src = tmp_path / "src"
    make_checkpoint(src, "qwen2", tie_word_embeddings=False)
    qdir, ddir = write_pair(src, tmp_path, "gptq", act_order=True, head=True)
    model, _ = il.load(qdir, device="cpu", dtype=torch.float32)
    dense, _ = il.load(ddir, device="cpu", dtype=torch.float32)
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.input_perm is not None
    for m in _named_layers(model).values():
        m.impl = "reference"
    x = torch.tensor([PROMPTS[0]])
    assert torch.equal(model(x), dense(x))
    # the flag and the tensors disagree: refused either way, naming the field
    set_quant_config(qdir, {**CONFIGS["gptq"], "desc_act": True})
    with pytest.raises(FormatError, match=r"lm_head: quantization_config\.lm_head is false but "
                                          r"the checkpoint's lm_head is packed"):
        il.load(qdir, device="cpu", dtype=torch.float32)
    plain = write_pair(src, tmp_path / "b", "gptq")[0]
    set_quant_config(plain, {**CONFIGS["gptq"], "lm_head": True})
    with pytest.raises(FormatError, match=r"lm_head is true but the checkpoint's lm_head is not"):
        il.load(plain, device="cpu", dtype=torch.float32)


def test_a_quantized_head_of_a_tied_model_is_refused(source, tmp_path):
    from safetensors.torch import load_file

    qdir, _ = write_pair(source, tmp_path, "gptq", head=True)
    assert "lm_head.weight" not in load_file(source / "model.safetensors")  # tied: none
    w = load_file(source / "model.safetensors")["model.embed_tokens.weight"].float()
    for k, v in pack_gptq(rtn_int4(w, GROUP)).items():
        _tamper(qdir, f"lm_head.{k}", v)
    with pytest.raises(FormatError, match=r"lm_head: packed, but config\.json ties the head"):
        il.load(qdir, device="cpu", dtype=torch.float32)


def test_an_int4_layer_takes_only_a_permutation_of_its_inputs():
    from infer_lab.model.quant.gptq_checkpoint import to_quantized_linear

    t = gptq_int4(torch.randn(16, 64, generator=GEN), _hessian(64), GROUP, act_order=True)
    layer = to_quantized_linear(t)
    tensors = {k: getattr(layer, k) for k in ("qweight", "scale", "minimum")}
    for perm in (torch.arange(64).flip(0)[:-1], torch.zeros(64, dtype=torch.long),
                 torch.arange(64, dtype=torch.int32)):
        with pytest.raises(QuantizationError, match="input_perm must be a permutation of the 64"):
            QuantizedLinear("int4", tensors, 64, 16, None, GROUP, perm)
    with pytest.raises(QuantizationError, match="input_perm is for int4 layers, not int8"):
        QuantizedLinear("int8", {}, 64, 16, None, 0, torch.arange(64))


def assert_engine_greedy_equals_dense(model, dense, tok) -> None:
    """``il.LLM`` on ``model`` (batched, paged KV) gives ``dense``'s naive greedy tokens on
    every prompt (12 each, the near-tie rule of ``assert_greedy_equal``)."""
    llm = il.LLM(model, tokenizer=tok, max_num_seqs=4)
    params = il.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for ids, out in zip(PROMPTS, outs, strict=True):
        ref = list(stream_naive(dense, ids, 12, set()))

        def at(prefix, ids=ids):
            with torch.inference_mode():
                return dense(torch.tensor([ids + prefix]), last_only=True)[0, -1]
        assert len(ref) == 12
        assert_greedy_equal(out.outputs[0].token_ids, ref, at)
