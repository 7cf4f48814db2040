"""The model against Hugging Face transformers, family by family, on random-weight checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import infer_lab as il
from infer_lab.model.config import ModelConfig
from tests.helpers import FAMILIES, assert_greedy_equal, make_checkpoint


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(path, request.param)
    return request.param, path, hf


def test_logits_match_transformers(checkpoint):
    family, path, hf = checkpoint
    model, _ = il.load(path, device="cpu")
    assert model.dtype == torch.float32
    ids = torch.randint(3, 384, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    ours = model(ids)
    assert ours.shape == (3, 40, 384)
    assert ref.abs().max() > 1.0, "logits too flat to be a meaningful comparison"
    diff = (ours - ref).abs().max().item()
    assert diff <= 1e-4, f"{family}: max |logit difference| {diff:.2e}"


def test_greedy_matches_transformers_generate(checkpoint):
    family, path, hf = checkpoint
    model, tok = il.load(path, device="cpu")
    prompt = "In the beginning was the word"
    out = il.generate_naive(model, tok, prompt, max_tokens=30, ignore_eos=True)
    assert len(out.token_ids) == 30
    ids = torch.tensor([out.prompt_token_ids])
    hf.generation_config.eos_token_id = None  # both sides ignore EOS: compare 30 tokens
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=0)
    ref = ref[0, ids.shape[1]:].tolist()

    def logits_at(prefix: list[int]) -> torch.Tensor:
        return model(torch.tensor([out.prompt_token_ids + prefix]), last_only=True)[0, -1]

    assert_greedy_equal(out.token_ids, ref, logits_at)
    assert out.text == tok.decode(out.token_ids)


def test_last_only_equals_full_forward(checkpoint):
    _, path, _ = checkpoint
    model, _ = il.load(path, device="cpu")
    ids = torch.randint(3, 384, (2, 17))
    # Not bit-equal: one row alone and the same row in a bigger matmul take different BLAS paths.
    torch.testing.assert_close(model(ids, last_only=True), model(ids)[:, -1:], atol=1e-5, rtol=0)


def test_hub_and_transformers5_config_shapes_agree(checkpoint, tmp_path):
    """transformers 5 writes ``rope_parameters``; the hub's files use rope_theta/rope_scaling."""
    family, path, hf = checkpoint
    raw = json.loads((path / "config.json").read_text())
    assert "rope_parameters" in raw
    hub = dict(raw)
    params = dict(hub.pop("rope_parameters"))
    hub["rope_theta"] = params.pop("rope_theta")
    if params.get("rope_type", "default") != "default":
        hub["rope_scaling"] = params
    assert ModelConfig.from_dict(hub) == ModelConfig.from_dict(raw)
    # and the hub-shaped checkpoint loads and computes the same logits
    shutil.copytree(path, tmp_path / "hub")
    (tmp_path / "hub" / "config.json").write_text(json.dumps(hub))
    model, _ = il.load(tmp_path / "hub", device="cpu")
    ids = torch.randint(3, 384, (1, 50))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() <= 1e-4


def test_sharded_checkpoint(tmp_path):
    hf = make_checkpoint(tmp_path / "one", "llama2_bias")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "one" / f, tmp_path / "sharded" / f)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    model, _ = il.load(tmp_path / "sharded", device="cpu")
    ids = torch.randint(3, 384, (2, 20))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() <= 1e-4


def test_sliding_window_changes_the_output(tmp_path):
    """The window is really applied: the same weights without it give other logits far out."""
    make_checkpoint(tmp_path, "mistral_window")
    windowed, _ = il.load(tmp_path, device="cpu")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["sliding_window"] = None
    (tmp_path / "config.json").write_text(json.dumps(raw))
    full, _ = il.load(tmp_path, device="cpu")
    ids = torch.randint(3, 384, (1, 30))
    a, b = windowed(ids), full(ids)
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-5)  # inside the window: identical
    assert (a[:, 20:] - b[:, 20:]).abs().max() > 1e-2


def test_bf16_load_runs(tmp_path):
    make_checkpoint(tmp_path, "qwen3")
    model, _ = il.load(tmp_path, device="cpu", dtype="bf16")
    assert model.dtype == torch.bfloat16
    assert model.inv_freq.dtype == torch.float32  # RoPE frequencies stay fp32
    logits = model(torch.randint(3, 384, (1, 8)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
