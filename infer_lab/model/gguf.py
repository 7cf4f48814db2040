"""llama.cpp's GGUF files: read one (:func:`read_gguf`), then ask it for its :class:`ModelConfig`,
its :class:`Tokenizer` and its tensors as :class:`~infer_lab.model.checkpoint.Weight`.

A GGUF file is the whole model in one file: hyper-parameters and the tokenizer as key-value
metadata, the weights as tensors that are usually quantized in llama.cpp's block formats. Each
tensor is dequantized (``gguf.quants``) when it is read, into the dtype asked for: the engine
computes in floating point, so a Q4_1 file costs the same memory as any fp32 checkpoint once
loaded. (``quantization="gguf"`` keeps the blocks instead: a Weight's ``blocks``.)

The header is parsed here, not by the ``gguf`` package's reader, so that every count and length
in it is checked against the bytes that remain before anything is read or allocated: a 200-byte
file that declares an array of 2^60 numbers, or a million tensors, is refused at once with a
:class:`GGUFError` naming the field. The ``gguf`` package still supplies the dequantizers and the
table of tensor types.

Two details of llama.cpp's converter are undone here. It permutes the rows of the query and key
projections (its RoPE pairs dimension ``2i`` with ``2i + 1``; Hugging Face's, and ours, pairs ``i``
with ``i + head_dim / 2``), and it stores the tokenizer as lists rather than a ``tokenizer.json``.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infer_lab.model.checkpoint import Errors, Weight
from infer_lab.model.config import ConfigError, ModelConfig, UnsupportedModelError
from infer_lab.model.tokenizer import Tokenizer

__all__ = [
    "GGUF_CONFIG_KEYS",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "SUPPORTED_TOKENIZER_MODELS",
    "GGUFError",
    "GGUFFile",
    "GGUFTensor",
    "find_gguf",
    "gguf_target",
    "is_gguf",
    "load_gguf_tokenizer",
    "read_gguf",
    "read_gguf_config",
]

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TOKENIZER_MODELS = ("gpt2",)
_MAGIC = b"GGUF"
_VERSIONS = (2, 3)

# The one map from llama.cpp's tensor names to ours: ``blk.N.<name>`` per layer, and the global
# ones. Value: (our parameter, which part of a fused one).
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
# llama.cpp permutes these rows for its RoPE; the config field that gives their head count
_PERMUTED_ROWS = {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}

# ModelConfig field -> the GGUF metadata key (after "<architecture>.") it is read from; the
# first four must be there, the others have defaults
GGUF_CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "max_position_embeddings": "context_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
}
_REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

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


def gguf_target(name: str) -> tuple[str, int | None] | None:
    """Our parameter for GGUF tensor ``name`` and the part of a fused one it is; None if the
    tensor is not one a Llama model has."""
    base = name.removesuffix(".weight")
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        local, part = _LAYER_TENSORS[parts[2]]
        return f"layers.{parts[1]}.{local}.weight", part
    if base in _GLOBAL_TENSORS and name.endswith(".weight"):
        return f"{_GLOBAL_TENSORS[base]}.weight", None
    return None


# -------------------------------------------------------------------------------- the header
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # GGUF value type -> struct format
_STRING, _ARRAY = 8, 9
_MIN_VALUE_BYTES = {_STRING: 8, _ARRAY: 12, **{t: struct.calcsize(f) for t, f in _SCALARS.items()}}
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, dims count, one dim, type, offset
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 8  # arrays of arrays of ...
_DEFAULT_ALIGNMENT = 32
# ggml types whose bytes are plain numbers (numpy dtype char); every other is a block format
_PLAIN_TYPES = {"F32": "f4", "F16": "f2", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4",
                "I64": "i8"}


class _Cursor:
    """Reads a GGUF header front to back; every length is checked against what remains."""

    def __init__(self, data: np.ndarray, path: Path) -> None:
        self.data, self.path, self.pos, self.order = data, path, 0, "<"

    @property
    def remaining(self) -> int:
        return len(self.data) - self.pos

    def fail(self, why: str) -> GGUFError:
        return GGUFError(f"{self.path} is truncated or corrupt ({len(self.data)} bytes): {why}")

    def take(self, n: int, what: str) -> np.ndarray:
        if n > self.remaining:
            raise self.fail(f"{what} needs {n:,} bytes at offset {self.pos:,} but "
                            f"{self.remaining:,} remain")
        self.pos += n
        return self.data[self.pos - n : self.pos]

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(self.order + fmt, self.take(struct.calcsize(fmt), what))[0]

    def count(self, what: str, each: int) -> int:
        """A u64 count of items of at least ``each`` bytes, refused if they cannot all fit."""
        n = self.scalar("Q", what)
        if n * each > self.remaining:
            raise self.fail(f"{what} is {n:,}, but {n:,} items of at least {each} bytes cannot "
                            f"fit in the {self.remaining:,} bytes that remain")
        return n

    def name(self, what: str) -> str:
        raw = bytes(self.take(self.count(f"the length of {what}", 1), what))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not UTF-8 ({e})") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == _STRING:
            n = self.count(f"the length of {what}", 1)
            return bytes(self.take(n, what)).decode("utf-8", errors="replace")
        if vtype == _ARRAY:
            return self.array(what, depth)
        raise self.fail(f"{what} has unknown value type {vtype}")

    def array(self, what: str, depth: int) -> Any:
        """A plain numeric array as a read-only numpy view; strings and arrays as a list."""
        if depth >= _MAX_NESTING:
            raise self.fail(f"{what} nests arrays more than {_MAX_NESTING} deep")
        itype = self.scalar("I", f"the element type of {what}")
        if itype not in _MIN_VALUE_BYTES:
            raise self.fail(f"{what} has unknown element type {itype}")
        n = self.count(f"the length of {what}", _MIN_VALUE_BYTES[itype])
        if itype in _SCALARS:
            dtype = np.dtype(self.order + _SCALARS[itype])
            return self.take(n * dtype.itemsize, what).view(dtype)
        return [self.value(itype, f"{what}[{i}]", depth + 1) for i in range(n)]


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as the file stores it: ``shape`` rows first, ``data`` a read-only view of the
    file (numbers for plain types, bytes of blocks, one row of them per output row, otherwise)."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF file's header; its tensors stay on disk (memory-mapped) until read."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != _MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    cur = _Cursor(np.memmap(path, mode="r", dtype=np.uint8), path)
    cur.pos = 4
    version = cur.scalar("I", "the version")
    if version & 0xFFFF == 0:  # written on a big-endian machine
        cur.pos, cur.order = 4, ">"
        version = cur.scalar("I", "the version")
    if version not in _VERSIONS:
        raise cur.fail(f"GGUF version {version} is not one this reader knows {_VERSIONS}")
    n_tensors = cur.count("the tensor count", _MIN_TENSOR_INFO_BYTES)
    n_fields = cur.count("the metadata count", _MIN_KV_BYTES)
    metadata = _read_metadata(cur, n_fields)
    infos = [_read_tensor_info(cur) for _ in range(n_tensors)]
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment is {alignment!r}, not a power of two")
    start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, raw_type, offset in infos:
        if name in tensors:
            raise cur.fail(f"tensor {name!r} appears twice")
        tensors[name] = _tensor(cur, name, dims, raw_type, start + offset)
    return GGUFFile(path, metadata, tensors)


def _read_metadata(cur: _Cursor, n: int) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for _ in range(n):
        key = cur.name("a metadata key")
        vtype = cur.scalar("I", f"the type of metadata {key!r}")
        if key in metadata:
            raise cur.fail(f"metadata {key!r} appears twice")
        metadata[key] = cur.value(vtype, f"metadata {key!r}")
    return metadata


def _read_tensor_info(cur: _Cursor) -> tuple[str, list[int], int, int]:
    name = cur.name("a tensor name")
    n_dims = cur.scalar("I", f"the dimension count of tensor {name!r}")
    if not 1 <= n_dims <= _MAX_DIMS:
        raise cur.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS})")
    dims = [cur.scalar("Q", f"a dimension of tensor {name!r}") for _ in range(n_dims)]
    raw_type = cur.scalar("I", f"the type of tensor {name!r}")
    offset = cur.scalar("Q", f"the offset of tensor {name!r}")
    return name, dims, raw_type, offset


def _tensor(cur: _Cursor, name: str, dims: list[int], raw_type: int, start: int) -> GGUFTensor:
    """A view of one tensor's bytes, checked to lie inside the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        raise cur.fail(f"tensor {name!r} has unknown tensor type {raw_type}") from None
    block, type_size = GGML_QUANT_SIZES[qtype]
    if dims[0] % block:
        raise cur.fail(f"tensor {name!r}: rows of {dims[0]} are not whole {qtype.name} blocks "
                       f"of {block}")
    row_bytes = dims[0] // block * type_size
    end = start + math.prod(dims[1:]) * row_bytes
    if end > len(cur.data):
        raise GGUFError(f"{cur.path} is truncated: tensor {name!r} needs bytes up to {end} but "
                        f"the file has {len(cur.data)}")
    shape = tuple(reversed(dims))  # gguf lists the fastest axis first
    raw = cur.data[start:end]
    if qtype.name in _PLAIN_TYPES:
        data = raw.view(np.dtype(cur.order + _PLAIN_TYPES[qtype.name])).reshape(shape)
    else:
        data = raw.reshape(*shape[:-1], row_bytes)
    return GGUFTensor(name, qtype.name, shape, data)


# -------------------------------------------------------------------------------- the file
class GGUFFile:
    """A parsed GGUF file: its metadata (plain values; numeric arrays as numpy views) and its
    tensors by name. It is a :class:`~infer_lab.model.checkpoint.Checkpoint`."""

    def __init__(self, path: Path, metadata: dict[str, Any], tensors: dict[str, GGUFTensor]):
        self.path, self.metadata, self.tensors = path, metadata, tensors
        self.errors = Errors(path.name, bad=GGUFError, unexpected=UnsupportedModelError,
                             word="tensor")

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path} lacks the metadata key {key!r} that a model needs")
        return value

    def config(self) -> ModelConfig:
        """The :class:`ModelConfig` the metadata describes."""
        return self._config

    @cached_property
    def _config(self) -> ModelConfig:
        return _read_config(self)

    def tokenizer(self) -> Tokenizer:
        """The tokenizer stored in the metadata."""
        return _read_tokenizer(self)

    def weights(self) -> Iterator[Weight]:
        """Every tensor, mapped to our parameters; an unsupported tensor type is refused here,
        before anything is allocated."""
        for t in self.tensors.values():
            if t.type_name not in SUPPORTED_TENSOR_TYPES:
                raise UnsupportedModelError(
                    f"{self.path.name}: tensor {t.name!r} is of type {t.type_name}, which "
                    "infer_lab does not load; supported tensor types: "
                    f"{', '.join(SUPPORTED_TENSOR_TYPES)}")
            target = gguf_target(t.name)
            param, part = target if target else (None, None)
            order = self._row_order(t)
            yield Weight(t.name, param, part, t.shape, _dequantizer(t, order), self.path.name,
                         t.type_name, _block_reader(t, order))

    def _row_order(self, t: GGUFTensor) -> Callable[[], np.ndarray] | None:
        """For the query and key projections, the rows' order back in Hugging Face's layout."""
        field = _PERMUTED_ROWS.get(t.name.removesuffix(".weight").split(".")[-1])
        if field is None:
            return None
        return lambda: hf_row_order(t.shape[0], getattr(self.config(), field))


def hf_row_order(rows: int, heads: int) -> np.ndarray:
    """Row ``i`` of the Hugging Face matrix is row ``order[i]`` of llama.cpp's: it interleaves
    each head's two rotary halves (pairs ``2i, 2i + 1``), Hugging Face keeps them apart."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)


def _dequantizer(t: GGUFTensor, order: Callable[[], np.ndarray] | None
                 ) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        if t.type_name in ("F32", "F16"):
            w = np.asarray(t.data, dtype=np.float32)
        else:
            w = dequantize(np.asarray(t.data), GGMLQuantizationType[t.type_name])
        w = w.reshape(t.shape)
        w = np.ascontiguousarray(w if order is None else w[order()])
        return torch.from_numpy(w if w.flags.writeable else w.copy())

    return read


def _block_reader(t: GGUFTensor, order: Callable[[], np.ndarray] | None
                  ) -> Callable[[], np.ndarray]:
    def read() -> np.ndarray:
        return t.data if order is None else t.data[order()]

    return read


# -------------------------------------------------------------------------------- metadata
def _int(f: GGUFFile, key: str) -> int | None:
    """Metadata ``key`` as an int (None when absent); a clear error for any other type."""
    value = f.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFError(f"{f.path.name}: metadata {key!r} is {value!r}, not an integer")
    return value


def _float(f: GGUFFile, key: str) -> float | None:
    value = f.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GGUFError(f"{f.path.name}: metadata {key!r} is {value!r}, not a number")
    return float(value)


def _read_config(f: GGUFFile) -> ModelConfig:
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
    raw: dict[str, Any] = {}
    for field, key in GGUF_CONFIG_KEYS.items():
        value = (_float if field in ("rms_norm_eps", "rope_theta") else _int)(f, p + key)
        if field in _REQUIRED_FIELDS:
            raw[field] = f.require(p + key) if value is None else value
        elif value:  # absent (or 0): the default
            raw[field] = value
    raw.setdefault("vocab_size", _vocab_size(f))
    raw.setdefault("max_position_embeddings", 2048)
    raw.setdefault("rms_norm_eps", 1e-5)
    raw.setdefault("rope_theta", 10000.0)
    raw.update(
        model_type="llama",
        tie_word_embeddings="output.weight" not in f.tensors,
        bos_token_id=_int(f, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_int(f, "tokenizer.ggml.eos_token_id"),
        rope_scaling=_rope_scaling(f, p),
    )
    try:
        cfg = ModelConfig.from_dict(raw)
    except ConfigError as e:
        key = GGUF_CONFIG_KEYS.get(e.field)
        raise GGUFError(f"{f.path.name}: metadata {p + key if key else e.field!r}: {e}") from e
    rope_dims = _int(f, p + "rope.dimension_count")
    if rope_dims is not None and rope_dims != cfg.head_dim:
        raise UnsupportedModelError(
            f"{f.path.name}: partial RoPE ({rope_dims} of {cfg.head_dim} dimensions) is not "
            "supported"
        )
    return cfg


def _vocab_size(f: GGUFFile) -> int | None:
    tokens = f.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens)
    if "token_embd.weight" in f.tensors:
        return f.tensors["token_embd.weight"].shape[0]
    return None


def _rope_scaling(f: GGUFFile, p: str) -> dict[str, Any] | None:
    """RoPE scaling: none, or linear with its factor."""
    scaling = f.get(p + "rope.scaling.type")
    if scaling in (None, "none"):
        return None
    if scaling != "linear":
        raise UnsupportedModelError(
            f"{f.path.name}: unsupported RoPE scaling {scaling!r} (supported: none, linear)"
        )
    factor = _float(f, p + "rope.scaling.factor")
    return dict(rope_type="linear", factor=f.require(p + "rope.scaling.factor") if factor is None
                else factor)


# ------------------------------------------------------------------------------- tokenizer
def _read_tokenizer(f: GGUFFile) -> Tokenizer:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

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
    tokens = _string_list(f, "tokenizer.ggml.tokens")
    merges = _string_list(f, "tokenizer.ggml.merges")
    if not tokens:
        raise GGUFError(f"{f.path.name} has no tokenizer.ggml.tokens")
    if merges is None:
        raise GGUFError(f"{f.path.name}: a gpt2 tokenizer needs tokenizer.ggml.merges")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise GGUFError(f"{f.path.name}: malformed merge {m!r}")
        pairs.append((a, b))
    try:
        backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                     byte_fallback=False))
    except Exception as e:  # the tokenizers library raises a bare Exception
        raise GGUFError(f"{f.path.name}: its vocabulary and merges do not agree ({e})") from e
    _set_pre_tokenizer(f, backend)
    _add_special_tokens(f, backend, tokens)
    template = f.get("tokenizer.chat_template")
    return Tokenizer(backend, _tokenizer_config(f, tokens), None,
                     template if isinstance(template, str) else None)


def _string_list(f: GGUFFile, key: str) -> list[str] | None:
    value = f.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise GGUFError(f"{f.path.name}: metadata {key!r} is not an array of strings")
    return value


def _set_pre_tokenizer(f: GGUFFile, backend: Any) -> None:
    from tokenizers import Regex, decoders, pre_tokenizers

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


def _add_special_tokens(f: GGUFFile, backend: Any, tokens: list[str]) -> None:
    from tokenizers import AddedToken

    types = f.get("tokenizer.ggml.token_type")
    types = [1] * len(tokens) if types is None else list(types)
    control = [t for t, k in zip(tokens, types) if k == _CONTROL]
    user = [t for t, k in zip(tokens, types) if k == _USER_DEFINED]
    if control:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _tokenizer_config(f: GGUFFile, tokens: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding")):
        token_id = _int(f, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[name] = tokens[token_id]
    for flag in ("add_bos_token", "add_eos_token"):
        value = f.get(f"tokenizer.ggml.{flag}", False)
        if not isinstance(value, (bool, int)):
            raise GGUFError(f"{f.path.name}: metadata 'tokenizer.ggml.{flag}' is {value!r}, "
                            "not a boolean")
        config[flag] = bool(value)
    return config


# ------------------------------------------------------------------------ one-call helpers
def read_gguf_config(path: str | os.PathLike) -> ModelConfig:
    """The :class:`ModelConfig` that a GGUF file's metadata describes."""
    return read_gguf(path).config()


def load_gguf_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer stored in a GGUF file's metadata, as a :class:`Tokenizer`."""
    return read_gguf(path).tokenizer()
