"""The bundled model: complete HF layout, loadable by transformers, identical logits to ours."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import infer_lab as il
from infer_lab.model.loader import BUNDLED_MODEL_DIR
from tests.helpers import assert_greedy_equal

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json"]


@pytest.fixture(scope="module")
def bundled():
    return il.load(device="cpu")


def test_layout_and_size():
    for name in FILES:
        assert (BUNDLED_MODEL_DIR / name).is_file(), name
    total = sum(f.stat().st_size for f in BUNDLED_MODEL_DIR.iterdir())
    assert total < 20e6
    raw = json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())
    assert raw["model_type"] == "llama" and raw["max_position_embeddings"] >= 2048
    cfg = il.ModelConfig.from_dict(raw)
    assert 2e6 <= cfg.num_parameters() <= 4e6
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # exercises GQA


def test_special_tokens_and_chat_template(bundled):
    _, tok = bundled
    hf_tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    eot = tok.token_to_id("<|endoftext|>")
    assert eot is not None and eot in tok.eos_token_ids
    text = "In the beginning God created the heaven and the earth.\nAnd the earth was without form"
    assert tok.encode(text) == hf_tok(text)["input_ids"]
    chat = [{"role": "system", "content": "Answer in scripture."},
            {"role": "user", "content": "Who made the light?"}]
    ours = tok.apply_chat_template(chat, add_generation_prompt=True)
    assert ours == hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert "<|assistant|>" in ours


def test_transformers_agrees(bundled):
    model, tok = bundled
    hf = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL_DIR, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode("And the LORD spake unto Moses, saying, Speak unto the")])
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() <= 1e-4
    out = il.generate_naive(model, tok, ids[0].tolist(), max_tokens=30, ignore_eos=True)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=0)
    assert_greedy_equal(
        out.token_ids, ref[0, ids.shape[1]:].tolist(),
        lambda prefix: model(torch.tensor([ids[0].tolist() + prefix]), last_only=True)[0, -1],
    )


def test_continuations_are_words(bundled):
    """The model has learnt the corpus: a greedy continuation is made of words it was trained on."""
    model, tok = bundled
    out = il.generate_naive(model, tok, "And the LORD said unto Moses,", max_tokens=40)
    words = [w.strip(".,;:?!'()").lower() for w in out.text.split()]
    words = [w for w in words if w]
    assert len(words) >= 5
    # whole words of the tokenizer's vocabulary: BPE learns the corpus' common words as tokens
    pieces = json.loads((BUNDLED_MODEL_DIR / "tokenizer.json").read_text())["model"]["vocab"]
    vocab = {p.removeprefix("Ġ").lower() for p in pieces}
    known = sum(w in vocab for w in words)
    assert known / len(words) >= 0.7, out.text
