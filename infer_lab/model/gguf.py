"""Load a llama.cpp GGUF file: its metadata into :class:`ModelConfig`, its tensors into
:class:`Transformer`, its tokenizer into :class:`Tokenizer`.

A GGUF file is the whole model in one file: hyper-parameters and the tokenizer as key-value
metadata, the weights as tensors that are usually quantized in llama.cpp's block formats. The file
is read with ``gguf``, ggml's own reader, and every tensor is dequantized (``gguf.quants``) into
the dtype asked for: the engine computes in floating point, so a Q4_1 file costs the same memory
as any fp32 checkpoint once loaded. What that buys is the file, not speed.

Two details of llama.cpp's converter are undone here. It permutes the rows of the query and key
projections (its RoPE pairs dimension ``2i`` with ``2i + 1``; Hugging Face's, and ours, pairs ``i``
with ``i + head_dim / 2``), and it stores the tokenizer as lists rather than a ``tokenizer.json``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infer_lab.device import default_device, resolve_dtype
from infer_lab.model.config import ModelConfig, UnsupportedModelError
from infer_lab.model.tokenizer import Tokenizer
from infer_lab.model.transformer import Transformer

__all__ = [
    "SUPPORTED_GGUF_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "SUPPORTED_TOKENIZER_MODELS",
    "GGUFError",
    "find_gguf",
    "is_gguf",
    "load_gguf",
    "load_gguf_model",
    "load_gguf_tokenizer",
    "read_gguf_config",
]

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TOKENIZER_MODELS = ("gpt2",)
_MAGIC = b"GGUF"

# llama.cpp tensor name (after "blk.N.") -> (our parameter, which slice of a fused one)
_LAYER_TENSORS: dict[str, tuple[str, int | None]] = {
    "attn_norm": ("input_layernorm", None),
    "ffn_norm": ("post_attention_layernorm", None),
    "attn_q": ("self_attn.qkv_proj", 0),
    "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", None),
    "ffn_gate": ("mlp.gate_up_proj", 0),
    "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", None),
}
_GLOBAL_TENSORS = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}

# Pre-tokenizer split rules by ``tokenizer.ggml.pre``, as llama.cpp applies them. None of them is
# needed for "gpt2"-style vocabularies, whose default is GPT-2's own regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Pre-tokenizers that split every digit off first and then use GPT-2's regex (StarCoder family).
_DIGIT_SPLIT_PRES = ("smollm", "starcoder", "refact")
_GPT2_PRES = ("default", "gpt2", "gpt-2", "olmo", "mpt", "jais")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


class GGUFError(ValueError):
    """A GGUF file that cannot be read: truncated, corrupt, or not GGUF at all."""


def is_gguf(path: str | os.PathLike) -> bool:
    """True if ``path`` is a file that starts with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == _MAGIC


def find_gguf(path: str | os.PathLike) -> Path | None:
    """The ``.gguf`` file that ``path`` names: the file itself, or the only one in a directory."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix == ".gguf" or is_gguf(path) else None
    if not path.is_dir():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise GGUFError(
            f"{path} holds {len(files)} .gguf files ({', '.join(f.name for f in files[:4])}); "
            "pass the one to load"
        )
    return files[0] if files else None


# ------------------------------------------------------------------------------------- reading


class _File:
    """A parsed GGUF file: plain-Python metadata and the reader's tensors, by name."""

    def __init__(self, path: str | os.PathLike) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no GGUF file at {self.path}")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != _MAGIC:
            raise GGUFError(
                f"{self.path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')"
            )
        try:
            reader = GGUFReader(self.path)
        except Exception as e:  # the reader raises bare ValueErrors, struct errors, IndexErrors
            raise GGUFError(
                f"{self.path} is truncated or corrupt ({size} bytes): the gguf reader failed "
                f"with {type(e).__name__}: {e}"
            ) from e
        self.reader = reader
        self.tensors = {t.name: t for t in reader.tensors}
        for t in reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise GGUFError(
                    f"{self.path} is truncated: tensor {t.name!r} needs bytes up to {end} but the "
                    f"file has {size}"
                )

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:
            raise GGUFError(f"{self.path}: metadata {key!r} is unreadable ({e})") from e

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path} lacks the metadata key {key!r} that a model needs")
        return value

    def string_list(self, key: str) -> list[str] | None:
        """A string array, decoded leniently (vocabularies hold invalid UTF-8 now and then)."""
        field = self.reader.fields.get(key)
        if field is None:
            return None
        return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]


def read_gguf_config(path: str | os.PathLike) -> ModelConfig:
    """The :class:`ModelConfig` that a GGUF file's metadata describes."""
    return _config(_File(path))


def _config(f: _File) -> ModelConfig:
    arch = f.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{f.path.name}: unsupported GGUF architecture {arch!r}; infer_lab loads GGUF files of "
            f"architecture {', '.join(SUPPORTED_GGUF_ARCHITECTURES)} (Llama-shaped models)"
        )
    p = arch + "."
    if f.get(p + "expert_count"):  # Chapter 12: llama.cpp stores Mixtral as "llama" + experts
        raise UnsupportedModelError(
            f"{f.path.name} is a mixture-of-experts GGUF ({f.get(p + 'expert_count')} experts "
            "per layer); MoE GGUF files are not supported: load the model's Hugging Face "
            "checkpoint (config.json + safetensors) instead")
    if "rope_freqs.weight" in f.tensors:
        raise UnsupportedModelError(
            f"{f.path.name} carries per-frequency RoPE factors (rope_freqs, Llama 3.1-style "
            "long-context scaling), which the GGUF loader does not read; load the Hugging Face "
            "checkpoint instead"
        )
    heads = int(f.require(p + "attention.head_count"))
    hidden = int(f.require(p + "embedding_length"))
    tokens = f.reader.fields.get("tokenizer.ggml.tokens")
    vocab = f.get(p + "vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab is None and "token_embd.weight" in f.tensors:
        vocab = int(f.tensors["token_embd.weight"].shape[1])
    raw: dict[str, Any] = dict(
        model_type="llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(f.require(p + "feed_forward_length")),
        num_hidden_layers=int(f.require(p + "block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(f.get(p + "attention.head_count_kv") or heads),
        head_dim=int(f.get(p + "attention.key_length") or hidden // heads),
        max_position_embeddings=int(f.get(p + "context_length") or 2048),
        rms_norm_eps=float(f.get(p + "attention.layer_norm_rms_epsilon") or 1e-5),
        rope_theta=float(f.get(p + "rope.freq_base") or 10000.0),
        tie_word_embeddings="output.weight" not in f.tensors,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
    )
    scaling = f.get(p + "rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise UnsupportedModelError(
                f"{f.path.name}: unsupported RoPE scaling {scaling!r} (supported: none, linear)"
            )
        raw["rope_scaling"] = dict(
            rope_type="linear", factor=float(f.require(p + "rope.scaling.factor"))
        )
    rope_dims = f.get(p + "rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != raw["head_dim"]:
        raise UnsupportedModelError(
            f"{f.path.name}: partial RoPE ({rope_dims} of {raw['head_dim']} dimensions) is not "
            "supported"
        )
    return ModelConfig.from_dict(raw)


# ------------------------------------------------------------------------------------- weights


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (interleaved rotary pairs) back to Hugging Face's halves."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(f: _File, tensor: Any) -> np.ndarray:
    """The tensor as float32 numpy, rows first (out_features, in_features)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype.name not in SUPPORTED_TENSOR_TYPES:
        raise UnsupportedModelError(
            f"{f.path.name}: tensor {tensor.name!r} is of type {qtype.name}, which infer_lab does "
            f"not load; supported tensor types: {', '.join(SUPPORTED_TENSOR_TYPES)}"
        )
    shape = tuple(int(d) for d in reversed(tensor.shape))  # gguf lists the fastest axis first
    if qtype.name in ("F32", "F16"):
        out = np.asarray(tensor.data, dtype=np.float32)
    else:
        out = dequantize(np.asarray(tensor.data), qtype)
    return out.reshape(shape)


def load_gguf_model(
    path: str | os.PathLike,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> Transformer:
    """Build the model a GGUF file describes and fill it with its dequantized tensors."""
    return _load_model(_File(path), device, dtype)


@torch.no_grad()
def _load_model(
    f: _File, device: torch.device | str | None, dtype: torch.dtype | str | None
) -> Transformer:
    cfg = _config(f)
    device = torch.device(device) if device is not None else default_device()
    dtype = resolve_dtype(dtype, device)
    model = Transformer.empty(cfg, device, dtype)
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}
    unexpected: list[str] = []
    splits = {
        "self_attn.qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
        "mlp.gate_up_proj": [cfg.intermediate_size] * 2,
    }
    for name, tensor in f.tensors.items():
        base = name.removesuffix(".weight")
        parts = base.split(".")
        index: int | None = None
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
            local, index = _LAYER_TENSORS[parts[2]]
            ours = f"layers.{parts[1]}.{local}"
        elif base in _GLOBAL_TENSORS:
            ours, local = _GLOBAL_TENSORS[base], ""
        else:
            unexpected.append(name)
            continue
        if ours == "lm_head" and cfg.tie_word_embeddings:
            continue
        param = params.get(ours + ".weight")
        if param is None:
            unexpected.append(name)
            continue
        dest = param
        if index is not None:
            sizes = splits[local]
            dest = param[sum(sizes[:index]) : sum(sizes[: index + 1])]
        w = _dequantize(f, tensor)
        if w.shape != tuple(dest.shape):
            raise GGUFError(
                f"{f.path.name}: tensor {name!r} has shape {w.shape} but the metadata (hidden "
                f"{cfg.hidden_size}, {cfg.num_attention_heads} heads, {cfg.num_key_value_heads} "
                f"kv heads, head_dim {cfg.head_dim}) implies {tuple(dest.shape)}"
            )
        if parts[-1] == "attn_q":
            w = _unpermute(w, cfg.num_attention_heads)
        elif parts[-1] == "attn_k":
            w = _unpermute(w, cfg.num_key_value_heads)
        w = np.ascontiguousarray(w)
        dest.copy_(torch.from_numpy(w if w.flags.writeable else w.copy()))
        key = ours + ".weight"
        filled[key] = filled.get(key, 0) + dest.numel()
    if unexpected:
        raise UnsupportedModelError(
            f"{f.path.name} has tensors this llama model does not use: {unexpected[:8]}"
        )
    missing = [n for n, p in params.items() if filled.get(n, 0) != p.numel()]
    if missing:
        raise GGUFError(f"{f.path.name} is missing tensors for: {missing[:8]}")
    return model.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------- tokenizer


def load_gguf_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer stored in a GGUF file's metadata, as a :class:`Tokenizer`."""
    return _tokenizer(_File(path))


def _tokenizer(f: _File) -> Tokenizer:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    kind = f.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        extra = (
            " (SentencePiece vocabularies are not supported from GGUF yet: load the model's "
            "Hugging Face directory, whose tokenizer.json infer_lab reads)"
            if kind == "llama"
            else ""
        )
        raise UnsupportedModelError(
            f"{f.path.name}: unsupported GGUF tokenizer model {kind!r}; supported: "
            f"{', '.join(SUPPORTED_TOKENIZER_MODELS)} (byte-level BPE){extra}"
        )
    tokens = f.string_list("tokenizer.ggml.tokens")
    merges = f.string_list("tokenizer.ggml.merges")
    if not tokens:
        raise GGUFError(f"{f.path.name} has no tokenizer.ggml.tokens")
    if merges is None:
        raise GGUFError(f"{f.path.name}: a gpt2 tokenizer needs tokenizer.ggml.merges")
    types = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise GGUFError(f"{f.path.name}: malformed merge {m!r}")
        pairs.append((a, b))
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    pre = f.get("tokenizer.ggml.pre") or "default"
    if pre in _PRE_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in _DIGIT_SPLIT_PRES:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre in _GPT2_PRES:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        raise UnsupportedModelError(
            f"{f.path.name}: unknown pre-tokenizer {pre!r}; known: "
            f"{', '.join(sorted([*_PRE_SPLITS, *_DIGIT_SPLIT_PRES, *_GPT2_PRES]))}"
        )
    backend.decoder = decoders.ByteLevel()
    control = [t for t, k in zip(tokens, types) if k == _CONTROL]
    user = [t for t, k in zip(tokens, types) if k == _USER_DEFINED]
    if control:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    config: dict[str, Any] = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding")):
        token_id = f.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            config[name] = tokens[int(token_id)]
    config["add_bos_token"] = bool(f.get("tokenizer.ggml.add_bos_token", False))
    config["add_eos_token"] = bool(f.get("tokenizer.ggml.add_eos_token", False))
    template = f.get("tokenizer.chat_template")
    return Tokenizer(backend, config, None, template if isinstance(template, str) else None)


def load_gguf(
    path: str | os.PathLike,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> tuple[Transformer, Tokenizer]:
    """``(model, tokenizer)`` from one GGUF file, parsed once."""
    f = _File(path)
    tokenizer = _tokenizer(f)  # first: a bad tokenizer fails before seconds of dequantizing
    return _load_model(f, device, dtype), tokenizer
