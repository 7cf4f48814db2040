"""An EAGLE draft head: one decoder layer that predicts the target's next feature.

EAGLE (Li et al. 2024) drafts at the level of features, not tokens. The *feature* of position p
is what the target's LM head reads there: its last hidden state, after the final norm. The head
takes the feature of position p - 1 and the embedding of token p, concatenated, maps them back to
the hidden size (``fc``), runs one decoder layer of the target's own shape over them (attending
to its earlier positions through a KV cache of its own) and outputs its guess of the feature of
position p; the target's frozen LM head turns that guess into a guess of token p + 1. Drafting k
tokens feeds each guessed feature back in as the next input.

The target's embedding and LM head are reused, not copied into the head's file: only ``fc`` and
the layer are trained. To keep each draft step cheap the head scores a *draft vocabulary*, the
tokens it saw most often in training (EAGLE-3's reduced vocabulary); a token outside it is never
proposed, which costs acceptance, never correctness: the target verifies every guess.

A head file is a safetensors file (bf16 weights, ``draft_vocab`` int32) whose metadata names the
target's shape; :func:`load_eagle_head` refuses a head whose shape does not match the target.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infer_lab.model.config import ModelConfig
from infer_lab.model.linear import Linear
from infer_lab.model.transformer import DecoderLayer, Transformer

FORMAT = "infer_lab-eagle-1"
ASSETS = Path(__file__).resolve().parents[1] / "assets"
# Heads shipped with the package, by name (``speculative_config["model"]``).
BUNDLED_HEADS = {"eagle-smollm2-135m-instruct": ASSETS / "eagle-smollm2-135m-instruct"}
HEAD_FILE = "head.safetensors"
# The target's shape the head must match, and what a head file records of it.
SHAPE_KEYS = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size")


def layer_config(target: ModelConfig) -> ModelConfig:
    """The head's one layer: the target's layer shape, no sliding window."""
    return dataclasses.replace(target, num_hidden_layers=1, sliding_windows=())


class EagleHead(nn.Module):
    """``fc`` and one decoder layer; the embedding and the LM head are the target's.

    ``draft_vocab`` (int64 ``[V']``): the target token ids the head may propose, most frequent
    first. ``trained_depth``: the chain length its acceptance was validated at after training
    (training itself looks one token ahead, teacher-forced); the engine refuses a deeper draft.
    """

    draft_vocab: torch.Tensor  # a buffer (registered in __init__)

    def __init__(self, cfg: ModelConfig, draft_vocab: torch.Tensor, trained_depth: int,
                 meta: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.config = layer_config(cfg)
        h = cfg.hidden_size
        self.fc = Linear(2 * h, h, bias=True)
        self.layer = DecoderLayer(self.config, 0)
        self.register_buffer("draft_vocab", draft_vocab.long(), persistent=False)
        self.trained_depth = int(trained_depth)
        self.meta = dict(meta or {})
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)

    def bind(self, target: Transformer) -> EagleHead:
        """Share the target's RoPE frequencies, device and dtype (after a shape check)."""
        check_matches(self, target.config)
        self.to(device=target.device, dtype=target.dtype)
        self.inv_freq = target.inv_freq
        return self

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                ctx: Any = None) -> torch.Tensor:
        """Guessed features ``[..., H]`` from the embeddings of tokens p and the features of
        p - 1 (``ctx``: a paged context with the head's cache; None: plain causal, training)."""
        h = self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))
        out, residual = self.layer(h, None, positions, self.inv_freq, ctx)
        return out + residual


def check_matches(head: EagleHead, target: ModelConfig) -> None:
    """A clear error for a head trained on a model of another shape or vocabulary."""
    shape = head.meta.get("target_shape") or {k: getattr(head.config, k) for k in SHAPE_KEYS}
    check_shape(shape, target, head.meta.get("target", "another model"))
    if int(head.draft_vocab.max()) >= target.vocab_size or int(head.draft_vocab.min()) < 0:
        raise ValueError("the EAGLE head's draft vocabulary has token ids outside the target's "
                         f"vocabulary of {target.vocab_size}")


def check_shape(shape: dict[str, Any], target: ModelConfig, name: str) -> None:
    for key in SHAPE_KEYS:
        if int(shape.get(key, -1)) != getattr(target, key):
            raise ValueError(
                f"this EAGLE head was trained for {name} with {key}={shape.get(key)}, but the "
                f"target model has {key}={getattr(target, key)}: a head only drafts for the "
                f"model whose features it learned")


def save_eagle_head(head: EagleHead, path: str | Path, dtype: torch.dtype = torch.bfloat16
                    ) -> Path:
    """Write ``head`` as one safetensors file (weights in ``dtype``, shape in the metadata)."""
    from safetensors.torch import save_file

    path = Path(path)
    if path.suffix != ".safetensors":
        path = path / HEAD_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()}
    tensors["draft_vocab"] = head.draft_vocab.to("cpu", torch.int32).contiguous()
    meta = {**head.meta, "format": FORMAT, "trained_depth": head.trained_depth,
            "target_shape": {k: getattr(head.config, k) for k in SHAPE_KEYS},
            "rms_norm_eps": head.config.rms_norm_eps}
    save_file(tensors, str(path), metadata={"eagle": json.dumps(meta)})
    return path


def resolve_head_path(model: str | Path) -> Path:
    """A bundled head's name, a directory holding ``head.safetensors``, or the file itself."""
    path = BUNDLED_HEADS.get(str(model), Path(model))
    if path.is_dir():
        path = path / HEAD_FILE
    if not path.is_file():
        known = ", ".join(BUNDLED_HEADS)
        raise FileNotFoundError(f"no EAGLE head at {model!s} (a bundled head: {known}; or a "
                                f"directory with {HEAD_FILE}, or the .safetensors file)")
    return path


def load_eagle_head(model: str | Path, target: Transformer) -> EagleHead:
    """Load a head file for ``target``: its shape checked against the target's, then bound."""
    from safetensors import safe_open

    path = resolve_head_path(model)
    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get("eagle")
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open's API
    if raw is None:
        raise ValueError(f"{path} is not an EAGLE head file (no 'eagle' metadata)")
    meta = json.loads(raw)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown EAGLE head format {meta.get('format')!r} "
                         f"(this version reads {FORMAT!r})")
    check_shape(meta.get("target_shape", {}), target.config, meta.get("target", str(path)))
    head = EagleHead(target.config, tensors.pop("draft_vocab"), meta["trained_depth"], meta)
    missing, unexpected = head.load_state_dict(
        {k: v.to(target.dtype) for k, v in tensors.items()}, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: tensors missing {missing} or unexpected {unexpected}")
    return head.bind(target)
