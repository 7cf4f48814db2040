"""Hostile model files (issue 24, "Model files"): every length, count and dimension a GGUF file,
a safetensors file or a ``config.json`` states is checked before it is trusted, and a bad one is
refused at once with an error that names the field, never a hang, a runaway allocation or a raw
``RuntimeError`` / ``MemoryError`` / ``TypeError``.

Every file is built here, in ``tmp_path``: GGUF headers byte by byte (so that a count can claim
2^60 items in 200 bytes), small valid GGUF files with ``gguf.GGUFWriter``, safetensors files with
a hand-written header. A refusal takes milliseconds. The two files that used to run away (an array
of 2^60 numbers grew the loader's memory without end; a million layers took a minute) are loaded
in a child process under a memory limit and a deadline, so that a regression fails the test
instead of taking the machine with it.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import infer_lab as il
from infer_lab.model.gguf import GGUFError
from infer_lab.model.loader import CheckpointError
from tests.helpers import make_checkpoint

U8, U32, STRING, ARRAY = 0, 4, 8, 9  # GGUF value types
SHAPE = dict(hidden=64, heads=4, kv_heads=2, inter=128, layers=2)
CHILD_MEMORY = 3 << 30  # bytes of address space for a child load: torch needs about 1.5 GiB
CHILD_DEADLINE_S = 300  # generous on a loaded machine; the refusal itself takes milliseconds


def refused(path: Path, error: Any, match: str, **kwargs: Any) -> Exception:
    """Load ``path``; expect ``error`` (a type or a tuple of them) matching ``match``."""
    with pytest.raises(error, match=match) as info:
        il.load(path, device="cpu", dtype=torch.float32, **kwargs)
    return info.value


def load_in_child(paths: list[Path]) -> list[str]:
    """What loading each of ``paths`` ends in (``"ExceptionName: message"``), in one child
    process under a memory limit and a deadline, for the files that used to run away."""
    code = (
        "import json, resource, sys, torch, infer_lab as il\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({CHILD_MEMORY}, {CHILD_MEMORY}))\n"
        "for path in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        il.load(path, device='cpu', dtype=torch.float32)\n"
        "        print('loaded', flush=True)\n"
        "    except Exception as e:\n"
        "        print(f'{type(e).__name__}: {e}'.replace('\\n', ' '), flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, json.dumps([str(p) for p in paths])],
                          capture_output=True, text=True, timeout=CHILD_DEADLINE_S)
    assert done.returncode == 0, done.stderr[-2000:]
    outcomes = done.stdout.splitlines()
    assert len(outcomes) == len(paths), done.stdout
    return outcomes


RUNAWAYS = ("gguf_array_2^60", "gguf_block_count_10^6", "config_layers_10^6",
            "config_layers_2^40")


@pytest.fixture(scope="module")
def runaways(tmp_path_factory, ckpt) -> dict[str, str]:
    """The files that ran away before, built and loaded once (one child process for all)."""
    root = tmp_path_factory.mktemp("runaway")
    array = root / "array.gguf"  # issue 24's 200-byte file
    array.write_bytes(GGUF_LIES[RAN_AWAY][0].ljust(200, b"\0"))
    paths = [
        array,
        write_tiny_gguf(root / "layers.gguf", {"llama.block_count": 10**6}, layers=0),
        with_config(ckpt, root / "a", num_hidden_layers=10**6),
        with_config(ckpt, root / "b", num_hidden_layers=2**40),
    ]
    return dict(zip(RUNAWAYS, load_in_child(paths), strict=True))


# ---------------------------------------------------------------------- GGUF, byte by byte
def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def header(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def tensor_info(name: str, dims: list[int], ggml_type: int = 0, offset: int = 0,
                n_dims: int | None = None) -> bytes:
    n = len(dims) if n_dims is None else n_dims
    return (s(name) + struct.pack("<I", n) + b"".join(struct.pack("<Q", d) for d in dims)
            + struct.pack("<IQ", ggml_type, offset))


ARCH = kv("general.architecture", STRING, s("llama"))

# name -> (file bytes, what the error must say); each one lies about a length or a count
GGUF_LIES = {
    "array of 2^60 u32 (issue 24)": (
        header(0, 2) + ARCH + kv("x", ARRAY, struct.pack("<IQ", U32, 2**60)),
        r"length of metadata 'x' is 1,152,921,504,606,846,976"),
    "array of 2^60 strings": (
        header(0, 1) + kv("x", ARRAY, struct.pack("<IQ", STRING, 2**60)), "metadata 'x'"),
    "array of 2^60 arrays": (
        header(0, 1) + kv("x", ARRAY, struct.pack("<IQ", ARRAY, 2**60)), "metadata 'x'"),
    "tensor count 2^63": (header(2**63, 0), "the tensor count is"),
    "metadata count 2^63": (header(0, 2**63), "the metadata count is"),
    "key length 2^62": (header(0, 1) + struct.pack("<Q", 2**62) + b"\0" * 16, "a metadata key"),
    "string length 2^62": (
        header(0, 1) + s("k") + struct.pack("<IQ", STRING, 2**62), "metadata 'k'"),
    "string past the end": (header(0, 1) + s("k") + struct.pack("<IQ", STRING, 50) + b"abc",
                            "length of metadata 'k' is 50"),
    "arrays nested 100 deep": (
        header(0, 1) + s("k") + struct.pack("<I", ARRAY) + struct.pack("<IQ", ARRAY, 1) * 100,
        "nests arrays"),
    "unknown value type": (header(0, 1) + kv("k", 99, b"\0" * 8), "unknown value type 99"),
    "unknown array element type": (
        header(0, 1) + kv("k", ARRAY, struct.pack("<IQ", 77, 1) + b"\0" * 8),
        "unknown element type 77"),
    "duplicate key": (header(0, 2) + ARCH + ARCH, "appears twice"),
    "key not UTF-8": (header(0, 1) + s(b"\xff\xfe") + struct.pack("<IB", U8, 0), "not UTF-8"),
    "tensor name length 2^62": (header(1, 0) + struct.pack("<Q", 2**62) + b"\0" * 32,
                                "a tensor name"),
    "tensor with 0 dimensions": (header(1, 0) + tensor_info("t", [], n_dims=0) + b"\0" * 8,
                                 "0 dimensions"),
    "tensor with 2^31 dimensions": (
        header(1, 0) + tensor_info("t", [32], n_dims=2**31) + b"\0" * 64, "dimensions"),
    "unknown tensor type": (header(1, 0) + tensor_info("t", [32], ggml_type=99) + b"\0" * 64,
                            "unknown tensor type 99"),
    "rows that are not whole blocks": (
        header(1, 0) + tensor_info("t", [33], ggml_type=2) + b"\0" * 64, "not whole Q4_0"),
    "tensor dimensions of 2^40": (
        header(1, 0) + tensor_info("t", [2**40, 2**40]) + b"\0" * 64, "truncated: tensor 't'"),
    "tensor offset past the end": (
        header(1, 0) + tensor_info("t", [4], offset=2**50) + b"\0" * 64, "truncated: tensor 't'"),
    "alignment 0": (header(0, 1) + kv("general.alignment", U32, struct.pack("<I", 0)),
                    "general.alignment is 0"),
    "alignment 3": (header(0, 1) + kv("general.alignment", U32, struct.pack("<I", 3)),
                    "not a power of two"),
    "duplicate tensor": (header(2, 0) + tensor_info("t", [4]) * 2 + b"\0" * 64, "twice"),
    "version 99": (b"GGUF" + struct.pack("<IQQ", 99, 0, 0), "version 99"),
}


RAN_AWAY = "array of 2^60 u32 (issue 24)"  # loaded in a child process (``runaways``)


@pytest.mark.parametrize("case", [case for case in GGUF_LIES if case != RAN_AWAY])
def test_a_gguf_header_that_lies_is_refused_at_once(case, tmp_path):
    data, match = GGUF_LIES[case]
    path = tmp_path / "lie.gguf"
    path.write_bytes(data)
    assert len(data) < 2000
    error = refused(path, GGUFError, match)
    assert str(path) in str(error)


def test_the_200_byte_file_with_2_to_the_60_numbers_cannot_run_away(runaways):
    """Issue 24: the reader did not advance at the end of the file and grew ~100 MB/s."""
    assert re.match(r"GGUFError: .*length of metadata 'x' is 1,152,921,504,606,846,976",
                    runaways["gguf_array_2^60"])


def test_every_cut_of_a_valid_header_is_refused_cleanly(tiny_gguf_file, tmp_path):
    """Truncated anywhere in its header, a file is refused with GGUFError, never anything else."""
    data = tiny_gguf_file.read_bytes()
    header_end = gguf.GGUFReader(tiny_gguf_file).data_offset
    cut = tmp_path / "cut.gguf"
    for n in range(4, header_end, max(1, header_end // 200)):
        cut.write_bytes(data[:n])
        refused(cut, GGUFError, "truncated")


# ---------------------------------------------------------------- GGUF, valid but absurd
TOKENS = ["<s>", "</s>", *sorted(set("abcdefghijklmnopqrstuvwxyz Ġ")), "ab"]


def write_tiny_gguf(path: Path, metadata: dict[str, Any] | None = None, *,
                    layers: int | None = None, drop: tuple[str, ...] = (),
                    tokens: Any = None) -> Path:
    """A small valid llama GGUF (random F32 tensors); ``metadata`` overrides or adds keys (None
    removes one), ``layers`` writes tensors for that many layers only."""
    h, heads, kv_heads, inter = SHAPE["hidden"], SHAPE["heads"], SHAPE["kv_heads"], SHAPE["inter"]
    n_layers = SHAPE["layers"] if layers is None else layers
    rng = np.random.default_rng(0)
    vocab = len(TOKENS)
    meta: dict[str, Any] = {
        "llama.block_count": SHAPE["layers"], "llama.context_length": 256,
        "llama.embedding_length": h, "llama.feed_forward_length": inter,
        "llama.attention.head_count": heads, "llama.attention.head_count_kv": kv_heads,
        "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 10000.0,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1,
    }
    meta.update(metadata or {})
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        if value is None:
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            (w.add_uint64 if value >= 0 else w.add_int64)(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, value)
    if tokens is None:
        w.add_token_list(TOKENS)
        w.add_token_types([3, 3] + [1] * (vocab - 2))
        w.add_token_merges(["a b"])
    else:
        tokens(w)
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,),
              "output.weight": (vocab, h)}
    for i in range(n_layers):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.ffn_norm.weight": (h,),
            f"blk.{i}.attn_q.weight": (h, h), f"blk.{i}.attn_k.weight": (h // 2, h),
            f"blk.{i}.attn_v.weight": (h // 2, h), f"blk.{i}.attn_output.weight": (h, h),
            f"blk.{i}.ffn_gate.weight": (inter, h), f"blk.{i}.ffn_up.weight": (inter, h),
            f"blk.{i}.ffn_down.weight": (h, inter),
        })
    for name, shape in shapes.items():
        if name not in drop:
            w.add_tensor(name, rng.normal(size=shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf_file(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def test_the_tiny_gguf_loads_and_generates(tiny_gguf_file):
    model, tok = il.load(tiny_gguf_file, device="cpu", dtype=torch.float32)
    assert model.config.num_hidden_layers == 2 and tok.vocab_size == len(TOKENS)
    assert len(il.generate_naive(model, tok, [0, 5, 6], max_tokens=3).token_ids) == 3


def test_a_million_layers_without_tensors_is_refused_before_building_any(runaways, tmp_path):
    """Issue 24: block_count = 10^6 built layers for a minute before noticing no tensors."""
    assert re.match(r"GGUFError: .*asks for 1,000,000 layers but it holds tensors for 0",
                    runaways["gguf_block_count_10^6"])
    path = write_tiny_gguf(tmp_path / "m2.gguf", {"llama.block_count": 3})
    refused(path, GGUFError, r"asks for 3 layers but it holds tensors for 2")


GGUF_FIELDS = {  # metadata -> what the error must name
    "llama.embedding_length": (2**40, "llama.embedding_length"),
    "llama.context_length": (2**40, "llama.context_length"),
    "llama.feed_forward_length": (0, "llama.feed_forward_length"),
    "llama.attention.head_count": (0, "llama.attention.head_count"),
    "llama.attention.head_count_kv": (3, "head_count_kv"),
    "llama.attention.key_length": (2**33, "llama.attention.key_length"),
    "llama.vocab_size": (2**40, "llama.vocab_size"),
    "llama.block_count": (-1, "llama.block_count"),
    "llama.attention.layer_norm_rms_epsilon": (-1.0, "layer_norm_rms_epsilon"),
    "llama.rope.freq_base": ("fast", "llama.rope.freq_base"),
    "tokenizer.ggml.eos_token_id": ("two", "tokenizer.ggml.eos_token_id"),
}


@pytest.mark.parametrize("key", GGUF_FIELDS)
def test_an_impossible_metadata_value_is_refused_by_name(key, tmp_path):
    value, name = GGUF_FIELDS[key]
    path = write_tiny_gguf(tmp_path / "m.gguf", {key: value})
    refused(path, GGUFError, name)


def test_dimensions_that_disagree_with_the_tensors_allocate_nothing(tmp_path, monkeypatch):
    """A huge (but bounded) dimension against small tensors is caught on the meta device."""
    import infer_lab.model.transformer as tr

    def no_allocation(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("allocated before checking")

    monkeypatch.setattr(tr.Transformer, "empty", no_allocation)
    for key, value in [("llama.embedding_length", 2**20), ("llama.feed_forward_length", 2**22),
                       ("llama.vocab_size", 2**23), ("llama.attention.head_count", 2**10)]:
        path = write_tiny_gguf(tmp_path / "m.gguf", {key: value})
        refused(path, (GGUFError, il.UnsupportedModelError), "shape|head_dim|partial RoPE")


def test_tokenizer_metadata_of_the_wrong_shape(tmp_path):
    def numbers_for_tokens(w: gguf.GGUFWriter) -> None:
        w.add_array("tokenizer.ggml.tokens", list(range(10)))
        w.add_token_merges(["a b"])

    path = write_tiny_gguf(tmp_path / "a.gguf", tokens=numbers_for_tokens)
    refused(path, GGUFError, "tokenizer.ggml.tokens' is not an array of strings")

    def merge_of_unknown_tokens(w: gguf.GGUFWriter) -> None:
        w.add_token_list(TOKENS)
        w.add_token_merges(["zz qq"])

    path = write_tiny_gguf(tmp_path / "b.gguf", tokens=merge_of_unknown_tokens)
    refused(path, GGUFError, "vocabulary and merges do not agree")
    path = write_tiny_gguf(tmp_path / "c.gguf", {"tokenizer.ggml.add_bos_token": "yes"})
    refused(path, GGUFError, "add_bos_token")


def test_quantization_gguf_path_checks_the_same_way(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", {"llama.block_count": 3})
    refused(path, GGUFError, "asks for 3 layers", quantization="gguf")
    path = write_tiny_gguf(tmp_path / "n.gguf", drop=("blk.1.attn_k.weight",))
    refused(path, GGUFError, r"missing tensors.*layers\.1\.self_attn\.qkv_proj",
            quantization="gguf")


# ------------------------------------------------------------------------------ safetensors
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt")
    make_checkpoint(path, "llama3")
    return path


def copy_of(ckpt: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "copy"
    shutil.copytree(ckpt, dest)
    return dest


def with_header(path: Path, edit: Any) -> None:
    """Rewrite model.safetensors with ``edit(header)`` applied to its JSON header."""
    file = path / "model.safetensors"
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    new = edit(header)
    raw = json.dumps(new).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def first(header: dict[str, Any]) -> str:
    return next(k for k in header if k != "__metadata__")


SAFETENSORS_LIES = {
    "header not an object": (lambda h: [1, 2], "not a JSON object"),
    "entry not an object": (lambda h: {**h, first(h): 5}, "described by int"),
    "dtype unknown": (lambda h: {**h, first(h): {**h[first(h)], "dtype": "F99"}}, "dtype 'F99'"),
    "dtype missing": (lambda h: {**h, first(h): {k: v for k, v in h[first(h)].items()
                                                 if k != "dtype"}}, "dtype None"),
    "shape not a list": (lambda h: {**h, first(h): {**h[first(h)], "shape": "64x64"}}, "shape"),
    "shape negative": (lambda h: {**h, first(h): {**h[first(h)], "shape": [-64, -64]}}, "shape"),
    "shape of floats": (lambda h: {**h, first(h): {**h[first(h)], "shape": [1.5]}}, "shape"),
    "shape 2^40": (lambda h: {**h, first(h): {**h[first(h)], "shape": [2**40, 2**40]}},
                   "needs"),
    "offsets one number": (lambda h: {**h, first(h): {**h[first(h)], "data_offsets": [0]}},
                           "data_offsets"),
    "offsets backwards": (lambda h: {**h, first(h): {**h[first(h)], "data_offsets": [9, 1]}},
                          "data_offsets"),
    "offsets as text": (lambda h: {**h, first(h): {**h[first(h)], "data_offsets": ["0", "8"]}},
                        "data_offsets"),
    "offsets past the end": (lambda h: {**h, first(h): {
        **h[first(h)], "data_offsets": [0, 2**50]}}, "truncated"),
    "metadata not text": (lambda h: {**h, "__metadata__": {"format": 5}}, "cannot be read"),
}


@pytest.mark.parametrize("case", SAFETENSORS_LIES)
def test_a_safetensors_header_that_lies_is_refused(case, ckpt, tmp_path):
    edit, match = SAFETENSORS_LIES[case]
    path = copy_of(ckpt, tmp_path)
    with_header(path, edit)
    refused(path, CheckpointError, match)


def test_overlapping_tensors_are_refused(ckpt, tmp_path):
    path = copy_of(ckpt, tmp_path)
    weights = path / "model.safetensors"
    save_file({"a": torch.zeros(4), "b": torch.zeros(4)}, weights)

    def overlap(h: dict[str, Any]) -> dict[str, Any]:
        h["b"]["data_offsets"] = h["a"]["data_offsets"]
        return h

    with_header(path, overlap)
    refused(path, CheckpointError, "cannot be read|corrupt")


@pytest.mark.parametrize("weight_map", [
    [1, 2], {"w": 5}, {"w": "../outside.safetensors"}, {"w": "/etc/passwd"}, {"w": ".."},
])
def test_a_shard_index_that_lies_is_refused(weight_map, ckpt, tmp_path):
    path = copy_of(ckpt, tmp_path)
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(path, CheckpointError, "weight_map")
    (path / "model.safetensors.index.json").write_text("[not json")
    refused(path, CheckpointError, "weight_map")


# ------------------------------------------------------------------------------ config.json
DIMENSIONS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
BAD_SIZES = [0, -1, 2**40, "64", 2.5, True, [64], {"n": 64}]


def with_config(ckpt: Path, tmp_path: Path, **changes: Any) -> Path:
    path = copy_of(ckpt, tmp_path)
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("field", DIMENSIONS)
def test_every_dimension_in_config_json_is_checked(field, ckpt, tmp_path):
    for i, value in enumerate(BAD_SIZES):
        if field in ("num_key_value_heads", "head_dim") and value == 0:
            continue  # 0 means "derive it" (from the query heads, the hidden size)
        if field == "num_hidden_layers" and value == 2**40:
            continue  # built layers without end before: loaded in a child (``runaways``)
        path = with_config(ckpt, tmp_path / str(i), **{field: value})
        error = refused(path, ValueError, field)
        assert not isinstance(error, (TypeError, RuntimeError, MemoryError))


def test_a_2_to_the_40_context_is_refused_at_load(ckpt, tmp_path):
    path = with_config(ckpt, tmp_path, max_position_embeddings=2**40)
    refused(path, ValueError, r"max_position_embeddings must be an integer from 1 to 16,777,216")


def test_a_million_layers_in_config_json_is_refused_before_building(runaways):
    assert re.match(r"CheckpointError: .*asks for 1,000,000 layers but it holds weights for 2",
                    runaways["config_layers_10^6"])
    assert re.match(r"ConfigError: .*num_hidden_layers must be an integer from 1 to 16,777,216",
                    runaways["config_layers_2^40"])


def test_a_huge_dimension_that_disagrees_with_the_weights_allocates_nothing(ckpt, tmp_path,
                                                                            monkeypatch):
    import infer_lab.model.transformer as tr

    def no_allocation(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("allocated before checking")

    monkeypatch.setattr(tr.Transformer, "empty", no_allocation)
    for field, value in [("hidden_size", 2**22), ("intermediate_size", 2**23),
                         ("vocab_size", 2**24)]:
        path = with_config(ckpt, tmp_path / field, **{field: value})
        refused(path, (CheckpointError, ValueError), "shape|head_dim")


CONFIG_LIES = {
    "rms_norm_eps": (-1e-6, "rms_norm_eps"),
    "rope_scaling": ("linear", "rope_scaling must be an object"),
    "rope_parameters": ({"rope_type": "default", "rope_theta": 0}, "rope_theta"),
    "eos_token_id": ("</s>", "eos_token_id"),
    "bos_token_id": ([1, "x"], "bos_token_id"),
    "sliding_window": (-8, "sliding_window"),
}


@pytest.mark.parametrize("field", CONFIG_LIES)
def test_other_config_fields_of_the_wrong_kind(field, ckpt, tmp_path):
    value, match = CONFIG_LIES[field]
    path = with_config(ckpt, tmp_path, **{field: value})
    refused(path, ValueError, match)


def test_llama3_rope_with_equal_frequency_factors(ckpt, tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 4.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}
    path = with_config(ckpt, tmp_path, rope_parameters=rope)
    refused(path, ValueError, "high_freq_factor > low_freq_factor")


def test_qwen_layer_types_of_the_wrong_length(tmp_path):
    path = tmp_path / "qwen"
    make_checkpoint(path, "qwen3", use_sliding_window=True, sliding_window=8,
                    layer_types=["sliding_attention"] * 2)
    raw = json.loads((path / "config.json").read_text())
    raw["layer_types"] = ["sliding_attention"]
    (path / "config.json").write_text(json.dumps(raw))
    refused(path, ValueError, "layer_types must list one type per layer")


@pytest.mark.parametrize("content", [b"[1, 2, 3]", b"\xff\xfe\x00garbage", b"null"])
def test_a_config_json_that_is_not_an_object(content, ckpt, tmp_path):
    path = copy_of(ckpt, tmp_path)
    (path / "config.json").write_bytes(content)
    refused(path, ValueError, "config")


def test_a_model_too_big_for_memory_says_so(ckpt, monkeypatch):
    import infer_lab.model.transformer as tr

    def out_of_memory(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(tr.Transformer, "empty", out_of_memory)
    refused(ckpt, CheckpointError, r"could not be allocated on cpu: DefaultCPUAllocator")
