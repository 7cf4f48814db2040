"""Load a checkpoint into :class:`Transformer`: a Hugging Face directory (safetensors only), a
GGUF file (see :mod:`infer_lab.model.gguf`) or a named model (see :mod:`infer_lab.model.registry`).

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
from infer_lab.model import registry
from infer_lab.model.config import ModelConfig
from infer_lab.model.gguf import find_gguf, load_gguf
from infer_lab.model.moe import expert_checkpoint_target
from infer_lab.model.tokenizer import Tokenizer
from infer_lab.model.transformer import Transformer

BUNDLED_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny-kjv"
# Other models shipped in the package, by name (Chapter 12: a small trained mixture of experts).
BUNDLED_MODELS = {"tiny-moe": BUNDLED_MODEL_DIR.parent / "tiny-moe"}
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
    """A local path for ``model``: the bundled model (None or ``"tiny-kjv"``), a directory, a
    ``.gguf`` file, a named model (fetched into the cache once) or a hub id (online).

    A named model with random weights requested (``INFER_LAB_SMOLLM2=random``) resolves to its
    bare name, which :func:`load` recognises; no file is touched.
    """
    if model is None:
        if (BUNDLED_MODEL_DIR / "config.json").is_file():
            return BUNDLED_MODEL_DIR
        raise FileNotFoundError(
            f"no default model yet: the bundled model is missing from {BUNDLED_MODEL_DIR}; "
            "pass a checkpoint directory or hub id to load()"
        )
    path = Path(model).expanduser()
    if str(model) == BUNDLED_MODEL_DIR.name and not path.exists():
        return resolve_model_path(None)
    if str(model) in BUNDLED_MODELS and not path.exists():
        return BUNDLED_MODELS[str(model)]
    if str(model) in registry.NAMED_MODELS and not path.exists():
        if registry.random_requested(str(model)):
            return Path(str(model))
        return registry.fetch(str(model))
    if path.is_dir():
        return path
    if path.is_file():
        if find_gguf(path) is not None:
            return path
        raise NotADirectoryError(
            f"{path} is a file but not a GGUF file; pass a checkpoint's directory or a .gguf file"
        )
    if _HUB_ID.match(str(model)):
        return _download(str(model))
    named = ", ".join([BUNDLED_MODEL_DIR.name, *BUNDLED_MODELS, *registry.NAMED_MODELS])
    raise FileNotFoundError(
        f"model {str(model)!r} is not a directory, a .gguf file or a named model ({named})"
    )


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
                shape = tuple(f.get_slice(name).get_shape())
                # Chapter 12: an expert's tensor goes into its slot of the stacked [E, ...] weights
                moe = expert_checkpoint_target(name, shape, cfg)
                if moe is not None:
                    ours, expert, offset, rows = moe
                else:
                    (ours, offset, rows), expert = _target(name, cfg), None
                if ours == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue  # tied: the embedding matrix is the head
                param = params.get(ours)
                if param is None:
                    unexpected.append(name)
                    continue
                dest = param if expert is None else param[expert]
                dest = dest[offset : offset + rows] if rows else dest
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
    quantization: str | None = None,
    group_size: int = 32,
) -> tuple[Transformer, Tokenizer]:
    """Load a model and its tokenizer: the bundled model by default, else a directory, a ``.gguf``
    file (or a directory holding one), a named model such as ``"smollm2-135m-instruct"``, or a hub
    id. ``quantization``: ``"int8"``, ``"int4"`` (in groups of ``group_size``) or ``"gguf"`` (a
    GGUF file's blocks kept as they are); see :mod:`infer_lab.model.quantize`."""
    if quantization is not None:
        from infer_lab.model.quantize import load_quantized

        return load_quantized(model, device, dtype, quantization, group_size)
    path = resolve_model_path(model)
    if str(path) in registry.NAMED_MODELS and not path.exists():
        return random_named_model(str(path), device, dtype)
    if not (path / "config.json").is_file():
        gguf_file = find_gguf(path)
        if gguf_file is not None:
            return load_gguf(gguf_file, device, dtype)
    return load_model(path, device, dtype), Tokenizer.from_dir(path)


# SmolLM2-135M-Instruct's shape, as its GGUF metadata states it, for the random stand-in.
_SMOLLM2_SHAPE = dict(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)


def random_named_model(
    name: str,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> tuple[Transformer, Tokenizer]:
    """Random weights of ``name``'s shape with the bundled tokenizer, announced on stderr.

    For timing where the real file cannot go; the text it produces is noise (token ids past the
    bundled vocabulary decode to nothing).
    """
    import sys

    from infer_lab.model.random import random_model

    if name != "smollm2-135m-instruct":
        raise KeyError(f"no random stand-in is defined for {name!r}")
    print(
        f"infer_lab: {registry.RANDOM_ENV}=random -- {name} is RANDOM WEIGHTS of SmolLM2-135M's "
        "shape with the bundled tokenizer (timings only; its text is noise)",
        file=sys.stderr, flush=True,
    )
    cfg = ModelConfig.from_dict(_SMOLLM2_SHAPE)
    return random_model(cfg, device, dtype), Tokenizer.from_dir(BUNDLED_MODEL_DIR)
