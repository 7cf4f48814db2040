"""Load a model: the one pipeline every way in goes through (``il.load``, ``il.LLM``, the server).

1. **Read the checkpoint**: :func:`resolve_model_path` turns the name into a path (the bundled
   model, a directory, a ``.gguf`` file, a named model fetched once, or a hub id), and
   :func:`open_checkpoint` opens it as a Hugging Face directory
   (:mod:`infer_lab.model.hf_checkpoint`) or a GGUF file (:mod:`infer_lab.model.gguf`): a config,
   a tokenizer, and the tensors as :class:`~infer_lab.model.checkpoint.Weight`.
2. **Build the model**: the tensors are checked against the config before anything is allocated,
   then read one by one straight into a model allocated on the target device, so a checkpoint is
   never held twice in memory (:mod:`infer_lab.model.checkpoint`).
3. **Transform it** if asked: ``quantization="int8"``/``"int4"`` quantizes the built model,
   ``"gguf"`` puts a GGUF file's own blocks in place of the matrices, which are then never
   dequantized (:mod:`infer_lab.model.quantize`). A checkpoint quantized before it was shipped
   (GPTQ or AWQ, its ``config.json`` says so) is read straight into the engine's int4
   (:mod:`infer_lab.model.quant.prequantized`).

Each step is a module that knows nothing of the others; only this one calls them in order.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch

from infer_lab.device import default_device, resolve_dtype
from infer_lab.model import registry
from infer_lab.model.checkpoint import (
    Checkpoint,
    CheckpointError,
    Weight,
    allocate,
    fill,
    plan_fill,
)
from infer_lab.model.config import ModelConfig
from infer_lab.model.gguf import GGUFFile, find_gguf, read_gguf
from infer_lab.model.hf_checkpoint import HFCheckpoint
from infer_lab.model.quant.prequantized import QuantConfig, load_prequantized, read_quant_config
from infer_lab.model.quantize import (
    GGUF_BLOCK_TYPES,
    INT4_DEFAULT_GROUP,
    PREQUANTIZED,
    QuantizationError,
    check_quantization_name,
    keep_gguf_blocks,
    quantize_model,
)
from infer_lab.model.tokenizer import Tokenizer
from infer_lab.model.transformer import Transformer

__all__ = [
    "BUNDLED_MODEL_DIR", "CheckpointError", "load", "load_model", "open_checkpoint",
    "random_named_model", "resolve_model_path",
]

BUNDLED_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny-kjv"
# Other models shipped in the package, by name (Chapter 12: a small trained mixture of experts).
BUNDLED_MODELS = {"tiny-moe": BUNDLED_MODEL_DIR.parent / "tiny-moe"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def load(
    model: str | os.PathLike | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    quantization: str | None = None,
    group_size: int = INT4_DEFAULT_GROUP,
) -> tuple[Transformer, Tokenizer]:
    """Load a model and its tokenizer: the bundled model by default, else a directory, a ``.gguf``
    file (or a directory holding one), a named model such as ``"smollm2-135m-instruct"``, or a hub
    id. ``quantization``: ``"int8"``, ``"int4"`` (in groups of ``group_size``) or ``"gguf"`` (a
    GGUF file's blocks kept as they are); see :mod:`infer_lab.model.quantize`. A GPTQ or AWQ
    checkpoint loads as its int4 (``quantization`` None or its method, ``"gptq"``/``"awq"``)."""
    check_quantization_name(quantization)  # before seconds of reading
    path = resolve_model_path(model)
    if not is_random_stand_in(path) and (qc := read_quant_config(path)) is not None:
        return _load_prequantized(path, qc, quantization, device, dtype)
    if quantization in PREQUANTIZED:
        raise QuantizationError(f"quantization={quantization!r} reads a checkpoint quantized with "
                                f"{quantization.upper()}; {path} has no quantization_config")
    if is_random_stand_in(path):
        if quantization == "gguf":
            raise QuantizationError(f"quantization='gguf' needs the real {path} file; the random "
                                    "stand-in has no GGUF blocks (use int4 or int8)")
        built, tokenizer = random_named_model(str(path), device, dtype)
    else:
        checkpoint = open_checkpoint(path)
        keep_blocks = quantization == "gguf"
        if keep_blocks and not isinstance(checkpoint, GGUFFile):
            raise QuantizationError(f"quantization='gguf' keeps a GGUF file's blocks, and {path} "
                                    "is a safetensors checkpoint; use 'int8' or 'int4'")
        checkpoint.config()  # the config and the tokenizer first: each fails in a moment
        tokenizer = checkpoint.tokenizer()
        weights = list(checkpoint.weights())
        built = build_model(checkpoint, weights, device, dtype, leave_matrices=keep_blocks)
        if keep_blocks:
            return keep_gguf_blocks(built, weights), tokenizer
    if quantization is not None:
        built = quantize_model(built, quantization, group_size)
    return built, tokenizer


def _load_prequantized(path: Path, qc: QuantConfig, quantization: str | None,
                       device: torch.device | str | None, dtype: torch.dtype | str | None
                       ) -> tuple[Transformer, Tokenizer]:
    """A GPTQ/AWQ checkpoint's model in the engine's int4, and its tokenizer."""
    if quantization not in (None, qc.method):
        raise QuantizationError(f"{path} is already quantized with {qc.method.upper()} (its "
                                f"quantization_config); quantization={quantization!r} cannot "
                                f"apply: pass None or {qc.method!r}")
    checkpoint = HFCheckpoint(path)
    checkpoint.config()  # the config and the tokenizer first: each fails in a moment
    tokenizer = checkpoint.tokenizer()
    return load_prequantized(checkpoint, qc, device, dtype), tokenizer


def cpu_serving_quantization(model: str | os.PathLike | None,
                             device: torch.device | str | None = None) -> str | None:
    """What a server on a CPU runs a checkpoint in when nobody asked: ``"gguf"`` (the file's own
    blocks, kept) for a GGUF file whose every matrix is of a type kept as blocks (Q4_0, Q4_1,
    Q8_0 and the K-quants Q4_K, Q5_K, Q6_K: :data:`~infer_lab.model.quantize.GGUF_BLOCK_TYPES`),
    else None (dense: a file with an F16 or F32 matrix, say).

    The dense model of such a file *is* its blocks dequantized, so keeping them changes no
    weight: what changes is that the matmuls read 4-8 bits a weight instead of 32 and feed bf16
    activations (:mod:`infer_lab.kernels.quant`); the KL divergence this costs against the fp32
    model is measured for SmolLM2's Q4_1/Q8_0 file in ``benchmarks/results/peers.json`` and for
    a Q4_K_M file made from it in ``benchmarks/results/kquant_file.json``. On a GPU the default
    stays dense.
    """
    if (torch.device(device) if device is not None else default_device()).type != "cpu":
        return None
    path = resolve_model_path(model)
    if is_random_stand_in(path) or (path / "config.json").is_file():
        return None
    gguf_file = find_gguf(path)
    if gguf_file is None:
        return None
    types = {t.type_name for t in read_gguf(gguf_file).tensors.values() if len(t.shape) == 2}
    return "gguf" if types and types <= set(GGUF_BLOCK_TYPES) else None


def open_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint at ``path``: a directory with a ``config.json`` (safetensors), else the
    ``.gguf`` file it is or holds."""
    if not (path / "config.json").is_file():
        gguf_file = find_gguf(path)
        if gguf_file is not None:
            return read_gguf(gguf_file)
    return HFCheckpoint(path)


@torch.no_grad()
def build_model(
    checkpoint: Checkpoint,
    weights: list[Weight],
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    leave_matrices: bool = False,
) -> Transformer:
    """The model ``checkpoint`` describes, filled from ``weights``, every tensor checked against
    the config before anything is allocated. ``leave_matrices``: fill only the vectors (norms,
    biases), for a transform that puts its own matrices in place."""
    cfg = checkpoint.config()
    copies = plan_fill(cfg, weights, checkpoint.errors)
    if leave_matrices:
        copies = [c for c in copies if len(c.weight.shape) != 2]
    device = torch.device(device) if device is not None else default_device()
    model = allocate(cfg, device, resolve_dtype(dtype, device), checkpoint.errors)
    fill(model, copies)
    return model.eval().requires_grad_(False)


def load_model(
    path: str | os.PathLike,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> Transformer:
    """The model of the checkpoint at ``path`` (a directory or a ``.gguf`` file), no tokenizer."""
    checkpoint = open_checkpoint(Path(path))
    return build_model(checkpoint, list(checkpoint.weights()), device, dtype)


def is_random_stand_in(path: Path) -> bool:
    """True for a named model whose random stand-in was asked for (no file behind it)."""
    return str(path) in registry.NAMED_MODELS and not path.exists()


def _named_path(name: str) -> Path | None:
    """The path of a bundled or named model called ``name``; None if there is none by that name."""
    if name == BUNDLED_MODEL_DIR.name:
        return resolve_model_path(None)
    if name in BUNDLED_MODELS:
        return BUNDLED_MODELS[name]
    if name in registry.NAMED_MODELS:
        return Path(name) if registry.random_requested(name) else registry.fetch(name)
    return None


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
    if not path.exists() and (named := _named_path(str(model))) is not None:
        return named
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
