"""A Hugging Face checkpoint directory: ``config.json``, the tokenizer and safetensors shards.

Pickled ``.bin`` files are refused: loading them would run arbitrary code. Every safetensors
header is checked before a byte of it is trusted (:func:`check_safetensors`): a header length
past the end of the file, an entry that is not a tensor description, offsets that do not match
the shape and dtype, all give a :class:`CheckpointError` naming the file and the entry. The
checkpoint's names map to ours in :func:`hf_target`; its separate q/k/v and gate/up tensors are
the parts of our fused matrices.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from infer_lab.model.checkpoint import FUSED_PARTS, CheckpointError, Errors, Weight
from infer_lab.model.config import ModelConfig
from infer_lab.model.moe import expert_checkpoint_target
from infer_lab.model.tokenizer import Tokenizer

# bytes per element of each safetensors dtype
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
# checkpoint projection -> (our fused projection, which part of it)
_PART_OF = {f"{part}_proj": (fused, i) for fused, parts in FUSED_PARTS.items()
            for i, part in enumerate(parts)}
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def hf_target(name: str) -> tuple[str, int | None] | None:
    """Our parameter for checkpoint tensor ``name`` and the part of a fused one it is; None for
    a tensor that carries nothing to load (a saved RoPE table)."""
    if _IGNORED.search(name):
        return None
    parts = name.removeprefix("model.").split(".")
    if len(parts) >= 2 and parts[-2] in _PART_OF:
        fused, index = _PART_OF[parts[-2]]
        parts[-2] = fused
        return ".".join(parts), index
    return ".".join(parts), None


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: single file, sharded with an index, or a glob."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        files = [path / name for name in sorted(set(_weight_map(index).values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        raise CheckpointError(
            f"{path} holds only pickled weights (.bin/.pt); infer_lab loads safetensors only, "
            "since unpickling can run arbitrary code. Convert the checkpoint to safetensors."
        )
    raise FileNotFoundError(f"no model.safetensors (or shards) in {path}")


def _weight_map(index: Path) -> dict[str, str]:
    """The index's ``weight_map``: tensor name -> shard file name in the same folder."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise CheckpointError(f"{index} is not a JSON object with a weight_map ({e})") from e
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) and v == Path(v).name and v not in ("", ".", "..")
        for v in weight_map.values()
    ):
        raise CheckpointError(
            f"{index}: weight_map must map tensor names to file names in the checkpoint's folder")
    return weight_map


def check_safetensors(file: Path) -> dict[str, Any]:
    """The header of ``file``, every entry checked against the file; raise if any is wrong."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file} is truncated or not a safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise CheckpointError(
                f"{file} is truncated: its header claims {header_len} bytes but the file has "
                f"{size} bytes in all"
            )
        if header_len > MAX_HEADER_BYTES:
            raise CheckpointError(f"{file}: its header claims {header_len:,} bytes, more than "
                                  f"the {MAX_HEADER_BYTES:,} a safetensors header may have")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file} is corrupt: its header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{file} is corrupt: its header is not a JSON object")
    data_size = size - 8 - header_len
    for name, entry in header.items():
        if name != "__metadata__":
            _check_entry(file, name, entry, data_size)
    return header


def _check_entry(file: Path, name: str, entry: Any, data_size: int) -> None:
    """One header entry: ``{"dtype": ..., "shape": [...], "data_offsets": [begin, end]}``."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{file} is corrupt: tensor {name!r} {why}")

    if not isinstance(entry, dict):
        raise bad(f"is described by {type(entry).__name__}, not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise bad(f"has dtype {dtype!r}; known: {', '.join(DTYPE_SIZES)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad(f"has shape {shape!r}, not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))
            and offsets[0] <= offsets[1]):
        raise bad(f"has data_offsets {offsets!r}, not [begin, end] with begin <= end")
    if offsets[1] > data_size:
        raise CheckpointError(
            f"{file} is truncated: tensor {name!r} needs bytes up to {offsets[1]} of the data "
            f"but the file holds {data_size}")
    if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_SIZES[dtype]:
        raise bad(f"has {offsets[1] - offsets[0]} bytes of data but shape {shape} of {dtype} "
                  f"needs {math.prod(shape) * DTYPE_SIZES[dtype]}")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class HFCheckpoint:
    """A checkpoint directory opened for loading (see :class:`~.checkpoint.Checkpoint`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.errors = Errors(str(path))

    def config(self) -> ModelConfig:
        return self._config

    @cached_property
    def _config(self) -> ModelConfig:
        return ModelConfig.from_file(self.path)

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_dir(self.path)

    def weights(self) -> Iterator[Weight]:
        """Every tensor of every shard; files checked first, each shard opened once."""
        from safetensors import safe_open

        files = weight_files(self.path)
        headers = {file: check_safetensors(file) for file in files}
        for file, header in headers.items():
            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
            except Exception as e:  # the library's own error type is not a public name
                raise CheckpointError(f"{file} cannot be read ({type(e).__name__}: {e})") from e
            for name in sorted(header.keys() - {"__metadata__"}):
                shape = tuple(header[name]["shape"])
                # Chapter 12: an expert's tensor goes into its slot of the stacked [E, ...] weights
                moe = expert_checkpoint_target(name, shape, self._config)
                if moe is not None:
                    yield Weight(name, moe[0], None, shape, _reader(handle, name), file.name,
                                 expert=moe[1], rows=moe[2])
                elif (target := hf_target(name)) is not None:
                    yield Weight(name, target[0], target[1], shape, _reader(handle, name),
                                 file.name)


def _reader(handle: Any, name: str) -> Any:
    def read() -> torch.Tensor:
        return handle.get_tensor(name)

    return read
