"""Load a Hugging Face-layout checkpoint (safetensors only) into :class:`Transformer`.

Weights are read tensor by tensor straight into a model allocated on the target device, so a
checkpoint is never held twice in memory; the checkpoint's separate q/k/v and gate/up tensors are
spliced into the model's fused matrices. Pickled ``.bin`` files are refused: loading them would
run arbitrary code.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from infer_lab.device import default_device, resolve_dtype
from infer_lab.model.config import ModelConfig
from infer_lab.model.tokenizer import Tokenizer
from infer_lab.model.transformer import Transformer

BUNDLED_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny-kjv"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# checkpoint projection name -> (fused parameter, index of its slice)
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """The checkpoint's files are unreadable or do not match its config."""


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """A local directory for ``model``: the bundled model, a directory, or a hub id (online)."""
    if model is None:
        if (BUNDLED_MODEL_DIR / "config.json").is_file():
            return BUNDLED_MODEL_DIR
        raise FileNotFoundError(
            f"no default model yet: the bundled model is missing from {BUNDLED_MODEL_DIR}; "
            "pass a checkpoint directory or hub id to load()"
        )
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise NotADirectoryError(f"{path} is a file; pass the checkpoint's directory")
    if _HUB_ID.match(str(model)):
        return _download(str(model))
    raise FileNotFoundError(f"model directory {path} does not exist")


def _download(repo_id: str) -> Path:
    """Fetch config, tokenizer and safetensors (nothing else) from the Hugging Face hub."""
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
        )
    except Exception as e:  # network, auth, missing repo: all mean "cannot get it"
        raise FileNotFoundError(
            f"{repo_id!r} is not a local directory and could not be fetched from the Hugging Face "
            f"hub ({type(e).__name__}: {e})"
        ) from e
    return Path(local)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: single file, sharded with an index, or a glob."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
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


def check_safetensors(file: Path) -> None:
    """Raise if ``file`` is shorter than its own header says (an interrupted download)."""
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
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file} is corrupt: its header is not valid JSON ({e})") from e
    data_end = max(
        (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0
    )
    if 8 + header_len + data_end > size:
        raise CheckpointError(
            f"{file} is truncated: its tensors need {8 + header_len + data_end} bytes but the "
            f"file has only {size}"
        )


def _target(name: str, cfg: ModelConfig) -> tuple[str, int, int]:
    """Map a checkpoint tensor name to (our parameter, row offset, row count); count 0 = whole."""
    ours = name.removeprefix("model.")
    parts = ours.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, idx = _FUSED[parts[-2]]
        parts[-2] = fused
        sizes = (
            [cfg.q_size, cfg.kv_size, cfg.kv_size]
            if fused == "qkv_proj"
            else [cfg.intermediate_size] * 2
        )
        return ".".join(parts), sum(sizes[:idx]), sizes[idx]
    return ours, 0, 0


@torch.no_grad()
def load_model(
    path: str | os.PathLike,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> Transformer:
    """Build the model described by ``path/config.json`` and fill it from its safetensors."""
    path = Path(path)
    cfg = ModelConfig.from_file(path)
    device = torch.device(device) if device is not None else default_device()
    dtype = resolve_dtype(dtype, device)
    files = weight_files(path)
    for file in files:
        check_safetensors(file)

    model = Transformer.empty(cfg, device, dtype)
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}
    unexpected: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if _IGNORED.search(name):
                    continue
                ours, offset, rows = _target(name, cfg)
                if ours == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue  # tied: the embedding matrix is the head
                param = params.get(ours)
                if param is None:
                    unexpected.append(name)
                    continue
                dest = param[offset : offset + rows] if rows else param
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(dest.shape):
                    raise CheckpointError(
                        f"weight {name!r} in {file.name} has shape {shape} but the config "
                        f"({cfg.model_type}, hidden {cfg.hidden_size}, {cfg.num_attention_heads} "
                        f"heads, {cfg.num_key_value_heads} kv heads, head_dim {cfg.head_dim}) "
                        f"implies {tuple(dest.shape)}"
                    )
                dest.copy_(f.get_tensor(name))
                filled[ours] = filled.get(ours, 0) + dest.numel()
    if unexpected:
        raise CheckpointError(
            f"{path} has weights this {cfg.model_type} config does not use: {unexpected[:8]}"
        )
    missing = [n for n, p in params.items() if filled.get(n, 0) != p.numel()]
    if missing:
        raise CheckpointError(f"{path} is missing weights: {missing[:8]}")
    return model.eval().requires_grad_(False)


def load(
    model: str | os.PathLike | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> tuple[Transformer, Tokenizer]:
    """Load a model and its tokenizer: the bundled model by default, else a directory or hub id."""
    path = resolve_model_path(model)
    return load_model(path, device, dtype), Tokenizer.from_dir(path)
