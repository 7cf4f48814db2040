"""Bad checkpoints and bad prompts raise errors that say what is wrong."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import infer_lab as il
from infer_lab.model.config import UnsupportedModelError
from infer_lab.model.loader import CheckpointError
from tests.helpers import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    make_checkpoint(path, "llama3")
    return path


def copy_of(ckpt, tmp_path):
    import shutil

    dest = tmp_path / "copy"
    shutil.copytree(ckpt, dest)
    return dest


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory, a .gguf file or a named"):
        il.load(tmp_path / "no-such-model")


def test_file_instead_of_directory(ckpt):
    with pytest.raises(NotADirectoryError, match="directory"):
        il.load(ckpt / "config.json")


def test_unknown_hub_id_offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="could not be fetched"):
        il.load("no-such-org/no-such-model")


def test_unsupported_architecture(ckpt, tmp_path):
    path = copy_of(ckpt, tmp_path)
    raw = json.loads((path / "config.json").read_text())
    raw.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="gpt2") as e:
        il.load(path)
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(e.value)


def test_unsupported_rope_type(ckpt, tmp_path):
    path = copy_of(ckpt, tmp_path)
    raw = json.loads((path / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="yarn"):
        il.load(path)


@pytest.mark.parametrize("keep", [0.5, 0.999, 4])
def test_truncated_safetensors(ckpt, tmp_path, keep):
    path = copy_of(ckpt, tmp_path)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    cut = int(len(data) * keep) if keep < 1 else keep
    weights.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match="truncated"):
        il.load(path)


def test_shapes_that_do_not_match_the_config(ckpt, tmp_path):
    path = copy_of(ckpt, tmp_path)
    raw = json.loads((path / "config.json").read_text())
    raw["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"mlp\.(gate|up|down)_proj.*shape"):
        il.load(path)


def test_missing_and_unexpected_weights(ckpt, tmp_path):
    path = copy_of(ckpt, tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors.pop("model.layers.1.self_attn.k_proj.weight")
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing weights.*qkv_proj"):
        il.load(path)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    tensors["model.layers.9.extra.weight"] = torch.zeros(2)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="does not use"):
        il.load(path)


def test_pickled_weights_are_refused(ckpt, tmp_path):
    path = copy_of(ckpt, tmp_path)
    os.remove(path / "model.safetensors")
    (path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(CheckpointError, match="safetensors only"):
        il.load(path)


def test_prompt_longer_than_context(ckpt):
    model, tok = il.load(ckpt)
    too_long = list(range(3, 3 + model.config.max_position_embeddings + 5))
    with pytest.raises(ValueError, match=r"prompt has \d+ tokens but the model's context is 256"):
        il.generate_naive(model, tok, too_long)
    with pytest.raises(ValueError, match="longer than the model's context"):
        model(torch.tensor([too_long]))


def test_bad_generation_arguments(ckpt):
    model, tok = il.load(ckpt)
    with pytest.raises(ValueError, match="max_tokens"):
        il.generate_naive(model, tok, "hello", max_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        il.generate_naive(model, tok, [])


def test_generation_stops_at_the_context_limit(ckpt):
    model, tok = il.load(ckpt)
    prompt = list(range(3, 3 + 250))
    out = il.generate_naive(model, tok, prompt, max_tokens=50, ignore_eos=True)
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
