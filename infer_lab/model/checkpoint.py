"""What a checkpoint gives the loader, whatever its format, and the one place a model is filled.

A reader (:mod:`infer_lab.model.hf_checkpoint` for safetensors, :mod:`infer_lab.model.gguf` for
GGUF) turns its file into a :class:`ModelConfig`, a tokenizer and a stream of :class:`Weight`:
each tensor's own name, the parameter of ours it fills (and which slice of a fused one), its
shape, and a way to read its values. :func:`plan_fill` then checks the tensors against the config
*before* anything is allocated: tensors for every layer the config asks for (a 200-byte file
declaring a million layers is refused at once), every tensor a parameter of ours with the right
shape, every parameter covered exactly. Only then are the weights allocated (:func:`allocate`)
and copied (:func:`fill`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from infer_lab.model.config import ModelConfig
from infer_lab.model.tokenizer import Tokenizer
from infer_lab.model.transformer import Transformer

# fused parameter -> the checkpoint pieces it concatenates, in order
FUSED_PARTS = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}


class CheckpointError(ValueError):
    """The checkpoint's files are unreadable or do not match its config."""


@dataclass(frozen=True)
class Weight:
    """One tensor of a checkpoint and where it goes.

    ``read`` gives its values in our layout (dequantized, rows in Hugging Face's order);
    ``blocks`` (GGUF only) its quantized bytes as stored, one row per output row, rows in the
    same order, and ``type_name`` the format of those bytes.
    """

    name: str
    param: str | None  # our parameter; None when no parameter of ours takes it
    part: int | None  # which slice of a fused parameter (q/k/v, gate/up); None: all of it
    shape: tuple[int, ...]  # rows first
    read: Callable[[], torch.Tensor]
    where: str  # the file it is in, for messages
    type_name: str = ""
    blocks: Callable[[], np.ndarray] | None = None
    expert: int | None = None  # Chapter 12: the expert's slot of a stacked [E, ...] parameter
    rows: slice | None = None  # the rows of that slot it fills, when not a fused part's

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=object))


@dataclass(frozen=True)
class Errors:
    """How a format names its problems: the exception for a bad file, for a tensor that no
    parameter takes, and the word for a tensor ("weight", "tensor")."""

    label: str
    bad: type[Exception] = CheckpointError
    unexpected: type[Exception] = CheckpointError
    word: str = "weight"


class Checkpoint(Protocol):
    """A checkpoint opened for loading: config first, tensors when asked."""

    errors: Errors

    def config(self) -> ModelConfig: ...

    def tokenizer(self) -> Tokenizer: ...

    def weights(self) -> Iterable[Weight]: ...


@dataclass(frozen=True)
class Copy:
    """One step of a fill: ``weight`` goes to ``rows`` of parameter ``param`` (None: all), or of
    its slot ``expert``."""

    weight: Weight
    param: str
    rows: slice | None
    expert: int | None = None


def fused_rows(cfg: ModelConfig, param: str, part: int | None) -> slice | None:
    """The rows of fused parameter ``param`` that piece ``part`` fills; None when not fused."""
    if part is None:
        return None
    module = param.split(".")[-2]
    if module == "qkv_proj":
        sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
    elif module == "gate_up_proj":
        sizes = [cfg.intermediate_size] * 2
    else:
        raise ValueError(f"{param} is not a fused parameter")
    return slice(sum(sizes[:part]), sum(sizes[: part + 1]))


def describe(cfg: ModelConfig) -> str:
    return (f"{cfg.model_type}, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads, "
            f"{cfg.num_key_value_heads} kv heads, head_dim {cfg.head_dim}")


def check_layers(cfg: ModelConfig, weights: list[Weight], errors: Errors) -> None:
    """Refuse a config that asks for more layers than the checkpoint has tensors for, before any
    module is built: building a million empty layers takes a minute, so the layer count must be
    bounded by the file (every other dimension costs nothing on the meta device)."""
    layers = {w.param.split(".")[1] for w in weights if w.param and w.param.startswith("layers.")}
    if cfg.num_hidden_layers > len(layers):
        raise errors.bad(
            f"{errors.label} is missing {errors.word}s: its config asks for "
            f"{cfg.num_hidden_layers:,} layers but it holds {errors.word}s for {len(layers):,}")


def plan_fill(
    cfg: ModelConfig, weights: Iterable[Weight], errors: Errors
) -> list[Copy]:
    """Match every weight to the rows it fills and check that they cover every parameter exactly
    once, on a model built on the meta device: nothing is allocated yet."""
    weights = list(weights)
    check_layers(cfg, weights, errors)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Transformer(cfg).named_parameters()}
    copies: list[Copy] = []
    filled: dict[str, int] = {}
    unexpected: list[str] = []
    for w in weights:
        if w.param == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the embedding matrix is the head
        if w.param not in shapes:
            unexpected.append(w.name)
            continue
        rows = w.rows if w.rows is not None else fused_rows(cfg, w.param, w.part)
        whole = shapes[w.param] if w.expert is None else shapes[w.param][1:]
        want = whole if rows is None else (rows.stop - rows.start, *whole[1:])
        if w.shape != want:
            raise errors.bad(
                f"{errors.word} {w.name!r} in {w.where} has shape {w.shape} but the config "
                f"({describe(cfg)}) implies {want}")
        copies.append(Copy(w, w.param, rows, w.expert))
        filled[w.param] = filled.get(w.param, 0) + w.numel
    if unexpected:
        raise errors.unexpected(
            f"{errors.label} has {errors.word}s this {cfg.model_type} config does not use: "
            f"{unexpected[:8]}")
    missing = [n for n, s in shapes.items() if filled.get(n, 0) != int(np.prod(s))]
    if missing:
        raise errors.bad(f"{errors.label} is missing {errors.word}s: {missing[:8]}")
    return copies


def allocate(
    cfg: ModelConfig, device: torch.device, dtype: torch.dtype, errors: Errors
) -> Transformer:
    """The model, uninitialised, on ``device``; a clear error when it does not fit."""
    try:
        return Transformer.empty(cfg, device, dtype)
    except (RuntimeError, MemoryError) as e:
        need = cfg.num_parameters() * dtype.itemsize
        raise errors.bad(
            f"{errors.label}: the model ({cfg.num_parameters():,} parameters, {need / 2**30:.1f} "
            f"GiB in {dtype}) could not be allocated on {device}: {e}") from e


@torch.no_grad()
def fill(model: nn.Module, copies: Iterable[Copy]) -> None:
    """Copy each weight into its rows, reading it only now (the checkpoint is never held twice)."""
    params = dict(model.named_parameters())
    for c in copies:
        dest = params[c.param] if c.expert is None else params[c.param][c.expert]
        dest = dest if c.rows is None else dest[c.rows]
        dest.copy_(c.weight.read())
