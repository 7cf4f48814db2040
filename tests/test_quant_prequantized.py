"""GPTQ and AWQ checkpoint directories (``quantization_config``) through ``il.load``: written from
a random-weight transformers model with the project's own GPTQ and AWQ's GEMM packing, loaded
into the engine's int4, and run: the engine's greedy tokens are the dequantized dense model's
(fp32) token for token, and every malformed config or tensor is refused by name."""

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


def write_pair(src: Path, root: Path, kind: str) -> tuple[Path, Path]:
    """A ``kind`` checkpoint of ``src``'s model and the dense checkpoint of its dequantization."""
    from safetensors.torch import load_file, save_file

    qdir, ddir = root / kind, root / f"{kind}-dense"
    for d in (qdir, ddir):
        shutil.copytree(src, d)
    packed, dense = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        if not name.endswith("_proj.weight"):
            packed[name] = dense[name] = w
            continue
        w = w.float()
        if kind == "awq":  # AWQ's int4 is plain groups (its scales fold into the op before)
            t, tensors = rtn_int4(w, GROUP, name), pack_awq
        else:
            t = gptq_int4(w, _hessian(w.shape[1]), GROUP, act_order=False, name=name)
            tensors = pack_gptq if kind == "gptq" else lambda t, n: pack_gptq(t, n, 0)
        prefix = name.removesuffix(".weight")
        packed.update({f"{prefix}.{k}": v for k, v in tensors(t, name).items()})
        dense[name] = t.dequantize()
    save_file(packed, qdir / "model.safetensors")
    save_file(dense, ddir / "model.safetensors")
    set_quant_config(qdir, CONFIGS[kind])
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


def test_act_order_and_wrong_quantization_option_are_refused(source, tmp_path):
    qdir, ddir = write_pair(source, tmp_path, "gptq")
    with pytest.raises(QuantizationError, match="already quantized with GPTQ"):
        il.load(qdir, device="cpu", quantization="int4")
    with pytest.raises(QuantizationError, match="has no quantization_config"):
        il.load(ddir, device="cpu", quantization="awq")
    assert il.load(qdir, device="cpu", quantization="gptq")[0].quantization == "gptq-int4-g32"
    # an act-order layer: its groups are not consecutive columns
    from safetensors.torch import load_file

    name = "model.layers.0.mlp.down_proj"
    w = load_file(source / "model.safetensors")[f"{name}.weight"].float()
    t = gptq_int4(w, _hessian(w.shape[1]), GROUP, act_order=True)
    for k, v in pack_gptq(t).items():
        _tamper(qdir, f"{name}.{k}", v)
    set_quant_config(qdir, {**CONFIGS["gptq"], "desc_act": True})
    with pytest.raises(FormatError, match=r"mlp\.down_proj: g_idx is not 4 consecutive groups"):
        il.load(qdir, device="cpu", dtype=torch.float32)
