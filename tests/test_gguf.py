"""GGUF loading on small files written here, compared against the model they were written from.

Each file is written the way llama.cpp's converter writes a Llama model: ``blk.N.*`` tensor names,
rows first, the q/k projections' rows permuted into llama.cpp's interleaved RoPE order, norms in
F32, every matrix in the tensor type under test. The source is a random-weight ``transformers``
Llama with grouped-query attention (4 query heads, 2 KV heads) whose matrices are replaced by what
the file holds once dequantized, so the comparison is exact up to fp32 rounding and a misplaced
row, a missing permutation or a swapped slice cannot pass.

``gguf.quants`` quantizes F16, BF16, Q8_0, Q4_0 and Q4_1 but not the K-quants (Q4_K, Q5_K, Q6_K:
it only dequantizes those). For them the blocks are built by hand, random bytes with their fp16
scale fields set to small values, and the source model takes gguf's dequantization of those
blocks; the Q4_K layout is also checked against a hand-built block whose values are known. The
real SmolLM2 file (tests/test_smollm2.py) covers Q4_1 and Q8_0 against transformers' own loader.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import infer_lab as il
from infer_lab.model.gguf import (
    SUPPORTED_TENSOR_TYPES,
    GGUFError,
    load_gguf_tokenizer,
    read_gguf_config,
)
from infer_lab.model.tokenizer import Tokenizer
from tests.helpers import save_tokenizer

Q = gguf.GGMLQuantizationType

HEADS, KV_HEADS, HIDDEN, INTER, LAYERS = 4, 2, 256, 512, 2  # in-features multiple of 256: K-quants
K_QUANTS = {"Q4_K", "Q5_K", "Q6_K"}
# byte offsets of each K-quant block's fp16 scale fields (ggml's block_q4_K, _q5_K, _q6_K)
K_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
PROMPTS = [[1, 5, 77, 200, 13, 9, 300, 41], [1, 250, 3, 3, 3, 100, 64, 18, 255, 7, 2, 99]]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(path)
    return path


def hf_model(vocab: int, tie: bool, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie, bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.08)
    return model


def llama_cpp_rows(rows: int, heads: int) -> np.ndarray:
    """Row ``j`` of the file is row ``order[j]`` of the Hugging Face matrix (llama.cpp's RoPE
    pairs rows 2i and 2i+1 of each head; Hugging Face pairs i and i + head_dim/2)."""
    d = rows // heads
    order = []
    for h in range(heads):
        for i in range(d // 2):
            order += [h * d + i, h * d + i + d // 2]
    return np.array(order)


def blocks_for(w: np.ndarray, qtype: str, rng: np.random.Generator,
               encode_k: bool = False) -> np.ndarray:
    """What the file stores for matrix ``w`` in ``qtype``: quantized, or K blocks hand-built
    (random bytes) or, with ``encode_k``, made by the package's K-quant encoders from ``w``."""
    if qtype == "F32":
        return w.astype(np.float32)
    if qtype not in K_QUANTS:  # Q5_0 too: the unsupported-type test writes one
        return gguf.quants.quantize(w.astype(np.float32), Q[qtype])
    if encode_k:
        from infer_lab.model.quant.kquants import CODECS

        return CODECS[qtype][0](torch.from_numpy(w)).numpy().reshape(w.shape[0], -1)
    block, size = gguf.GGML_QUANT_SIZES[Q[qtype]]
    raw = rng.integers(0, 256, size=(w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
    for off in K_SCALE_OFFSETS[qtype]:
        scale = rng.uniform(0.0005, 0.002, size=raw.shape[:2]).astype(np.float16)
        raw[:, :, off : off + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(w.shape[0], -1)


def stored_values(blocks: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    if qtype == "F32":
        return blocks
    return gguf.quants.dequantize(blocks, Q[qtype]).reshape(shape)


def write_gguf(
    path: Path,
    source,
    tok_dir: Path,
    qtype: str = "F32",
    *,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    drop: str | None = None,
    seed: int = 0,
    tensor_types: dict[str, str] | None = None,
    encode_k: bool = False,
) -> Path:
    """Write ``source`` as llama.cpp would, in ``qtype``; ``source``'s matrices become exactly
    what the file holds (its quantization error moved into the reference). ``tensor_types``: a
    type per GGUF tensor name (``"blk.0.attn_v.weight"``) where it is not ``qtype``, as
    llama.cpp's mixes (Q4_K_M) do; ``encode_k``: see :func:`blocks_for`."""
    import json

    rng = np.random.default_rng(seed)
    cfg = source.config
    tokj = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = sorted(tokj["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    added = {a["id"]: a for a in tokj["added_tokens"]}
    for i, a in added.items():
        if i >= len(tokens):
            tokens.append(a["content"])
    types = [3 if i in added and added[i]["special"] else 1 for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokj["model"]["merges"]]

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_chat_template(
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )

    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    with torch.no_grad():
        for hf_name, p in source.named_parameters():
            if hf_name == "model.embed_tokens.weight":
                name = "token_embd.weight"
            elif hf_name == "model.norm.weight":
                name = "output_norm.weight"
            elif hf_name == "lm_head.weight":
                if cfg.tie_word_embeddings:
                    continue
                name = "output.weight"
            else:
                parts = hf_name.split(".")  # model.layers.N.(self_attn|mlp).X.weight or norm
                name = f"blk.{parts[2]}.{names[parts[-2]]}.weight"
            if name == drop:
                continue
            value = p.detach().numpy().astype(np.float32)
            if value.ndim == 1:  # norms stay F32, as llama.cpp keeps them
                w.add_tensor(name, value)
                continue
            order = None
            if name.endswith("attn_q.weight"):
                order = llama_cpp_rows(value.shape[0], cfg.num_attention_heads)
            elif name.endswith("attn_k.weight"):
                order = llama_cpp_rows(value.shape[0], cfg.num_key_value_heads)
            filed = value[order] if order is not None else value
            ttype = (tensor_types or {}).get(name, qtype)
            blocks = blocks_for(filed, ttype, rng, encode_k)
            held = stored_values(blocks, ttype, filed.shape)
            back = np.empty_like(held)
            if order is not None:
                back[order] = held
            else:
                back = held
            p.copy_(torch.from_numpy(np.ascontiguousarray(back)))
            if ttype == "F32":
                w.add_tensor(name, blocks)
            else:
                w.add_tensor(name, blocks, raw_dtype=Q[ttype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def vocab_size(tok_dir: Path) -> int:
    return Tokenizer.from_dir(tok_dir).vocab_size


def assert_logits_match(ours, source, rel: float = 1e-5) -> None:
    """Our logits equal transformers' to ``rel`` of their largest magnitude: both are fp32, but
    through different libraries (oneDNN here on a CPU, MKL there), so they agree to fp32's
    accuracy at these logits' scale (about 100-300), not to the bit; a wrong tensor is off by
    whole units."""
    for ids in PROMPTS:
        x = torch.tensor([ids])
        with torch.no_grad():
            ref = source(x).logits
            got = ours(x)
        assert got.shape == ref.shape
        tol = rel * float(ref.abs().max())
        assert torch.allclose(got, ref, atol=tol, rtol=0), (float((got - ref).abs().max()), tol)
        assert ref.std() > 0.1  # the logits are far from flat: a wrong tensor would show


@pytest.mark.parametrize("qtype", SUPPORTED_TENSOR_TYPES)
def test_each_tensor_type_matches_the_source_model(qtype, tok_dir, tmp_path):
    source = hf_model(vocab_size(tok_dir), tie=False, seed=len(qtype))
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", source, tok_dir, qtype)
    model, tok = il.load(path, device="cpu", dtype=torch.float32)
    assert model.config.num_key_value_heads == KV_HEADS < model.config.num_attention_heads
    assert not model.config.tie_word_embeddings
    assert_logits_match(model, source)


def test_tied_embeddings_and_a_directory_holding_one_file(tok_dir, tmp_path):
    source = hf_model(vocab_size(tok_dir), tie=True, seed=3)
    write_gguf(tmp_path / "model.gguf", source, tok_dir, "Q8_0")
    model, _ = il.load(tmp_path, device="cpu", dtype=torch.float32)
    assert model.config.tie_word_embeddings and model.lm_head is None
    assert_logits_match(model, source)


def test_bf16_dtype_requested(tok_dir, tmp_path):
    source = hf_model(vocab_size(tok_dir), tie=False, seed=4)
    path = write_gguf(tmp_path / "m.gguf", source, tok_dir, "Q4_0")
    model, _ = il.load(path, device="cpu", dtype="bf16")
    assert model.dtype == torch.bfloat16
    x = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        rel = (model(x).float() - source(x).logits).norm() / source(x).logits.norm()
    assert rel < 0.02


def test_config_from_metadata(tok_dir, tmp_path):
    source = hf_model(vocab_size(tok_dir), tie=False)
    cfg = read_gguf_config(write_gguf(tmp_path / "m.gguf", source, tok_dir))
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (HIDDEN, INTER, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 64)
    assert cfg.vocab_size == source.config.vocab_size
    assert cfg.rms_norm_eps == pytest.approx(1e-5) and cfg.rope.theta == 10000.0


def test_q4_k_block_layout_by_hand():
    """One Q4_K block whose values are known: scale 1 and min 0 in all eight sub-blocks, d = 0.5,
    and nibbles laid out as ggml does (each 32-byte run: low nibbles are elements 0-31 of a
    64-element chunk, high nibbles elements 32-63). gguf must decode it to 0.5 * nibble."""
    want = np.arange(256) % 16
    block = np.zeros(144, dtype=np.uint8)
    block[0:2] = np.array([0.5], dtype=np.float16).view(np.uint8)  # d
    block[2:4] = 0  # dmin
    block[4:8] = 1  # scales of sub-blocks 0-3 (low 6 bits); mins 0-3 (bytes 8-11) stay 0
    block[12:16] = 1  # sub-blocks 4-7: low nibble is the scale, high nibble the min
    qs = np.zeros(128, dtype=np.uint8)
    for chunk in range(4):
        lo, hi = want[chunk * 64 : chunk * 64 + 32], want[chunk * 64 + 32 : chunk * 64 + 64]
        qs[chunk * 32 : chunk * 32 + 32] = lo | (hi << 4)
    block[16:] = qs
    got = gguf.quants.dequantize(block[None], Q.Q4_K).reshape(-1)
    np.testing.assert_array_equal(got, 0.5 * want)


def test_tokenizer_from_metadata_equals_the_source_tokenizer(tok_dir, tmp_path):
    source = hf_model(vocab_size(tok_dir), tie=False)
    ours = load_gguf_tokenizer(write_gguf(tmp_path / "m.gguf", source, tok_dir))
    ref = Tokenizer.from_dir(tok_dir)
    texts = ["In the beginning was the word", "café naïve — 日本語 🙂🚀", "x = f(1234)\n\n  end",
             "<s>hello</s> <pad>"]
    for text in texts:
        assert ours.encode(text) == ref.encode(text)
        ids = ours.encode(text)
        assert ours.decode(ids) == ref.decode(ids)
        detok = ours.detokenizer()
        assert "".join(detok.add(t) for t in ids) + detok.flush() == ours.decode(ids)
    assert ours.encode("hi")[0] == 1  # add_bos_token from the metadata
    assert (ours.bos_token, ours.eos_token, ours.eos_token_ids) == ("<s>", "</s>", {2})
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs) == "<|user|>hi</s><|assistant|>"


# ----------------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def good_file(tok_dir, tmp_path_factory) -> Path:
    source = hf_model(vocab_size(tok_dir), tie=False)
    return write_gguf(tmp_path_factory.mktemp("good") / "m.gguf", source, tok_dir)


def test_truncated_file(good_file, tmp_path):
    data = good_file.read_bytes()
    for cut in (len(data) // 2, len(data) - 100, 100):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="truncated"):
            il.load(bad, device="cpu")


def test_corrupt_file_and_not_gguf(good_file, tmp_path):
    data = bytearray(good_file.read_bytes())
    data[8:24] = b"\xff" * 16  # tensor and metadata counts: absurd
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="corrupt"):
        il.load(bad, device="cpu")
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04 not a gguf at all")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        il.load(other, device="cpu")


def test_unsupported_architecture(tok_dir, tmp_path):
    source = hf_model(vocab_size(tok_dir), tie=False)
    path = write_gguf(tmp_path / "m.gguf", source, tok_dir, arch="mamba")
    with pytest.raises(il.UnsupportedModelError, match=r"architecture 'mamba'.*llama"):
        il.load(path, device="cpu")


def test_unsupported_tensor_type(tok_dir, tmp_path):
    source = hf_model(vocab_size(tok_dir), tie=False)
    path = write_gguf(tmp_path / "m.gguf", source, tok_dir, "Q5_0")
    with pytest.raises(il.UnsupportedModelError, match=r"type Q5_0.*supported tensor types: F32"):
        il.load(path, device="cpu")


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_unsupported_tokenizer_model(kind, tok_dir, tmp_path):
    source = hf_model(vocab_size(tok_dir), tie=False)
    path = write_gguf(tmp_path / "m.gguf", source, tok_dir, tokenizer_model=kind)
    match = "SentencePiece" if kind == "llama" else f"tokenizer model '{kind}'.*gpt2"
    with pytest.raises(il.UnsupportedModelError, match=match):
        il.load(path, device="cpu")


def test_missing_tensor(tok_dir, tmp_path):
    source = hf_model(vocab_size(tok_dir), tie=False)
    path = write_gguf(tmp_path / "m.gguf", source, tok_dir, drop="blk.1.attn_k.weight")
    with pytest.raises(GGUFError, match=r"missing tensors.*layers\.1\.self_attn\.qkv_proj"):
        il.load(path, device="cpu")


def test_directory_with_two_files(good_file, tmp_path):
    (tmp_path / "a.gguf").write_bytes(good_file.read_bytes())
    (tmp_path / "b.gguf").write_bytes(good_file.read_bytes())
    with pytest.raises(GGUFError, match="2 .gguf files"):
        il.load(tmp_path, device="cpu")
