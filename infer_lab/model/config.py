"""Model configuration read from a Hugging Face ``config.json``.

One dataclass covers every supported Llama-family model, because the families differ only in a
handful of switches (biases, q/k norms, sliding windows, RoPE scaling). Reading them into one shape
here is what lets the rest of the package be written once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infer_lab.model.moe_config import MOE_ARCHITECTURES, moe_fields, moe_parameters

# model_type -> the architecture name transformers uses for it.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **MOE_ARCHITECTURES,  # Chapter 12: Mixtral, Qwen2-MoE, Qwen3-MoE
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# The largest dimension, layer count or context a config may state: far beyond any released model
# (Llama 4 Scout's context is 10.5 M tokens); past it a value is corruption, and what is sized by
# it (a context's tables, a layer list) would exhaust memory before anything noticed.
MAX_SIZE = 1 << 24


class UnsupportedModelError(ValueError):
    """The checkpoint is of an architecture (or uses a feature) this engine does not implement."""


class ConfigError(ValueError):
    """A config field whose value no model can have; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalised from either config shape."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    """Everything the transformer needs to know about a checkpoint's shape."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # One entry per layer: the sliding-window width, or None for full attention.
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str | None = None
    # Mixture of experts (Chapter 12; infer_lab.model.moe_config): 0 experts is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is a router and experts

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def window(self, layer: int) -> int | None:
        """Sliding-window width of ``layer`` (None means the layer attends to the whole prefix)."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    def num_parameters(self) -> int:
        """Parameter count implied by the config (embeddings counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size) * self.qkv_bias + h * self.o_bias
        attn += 2 * self.head_dim * self.qk_norm
        mlp = 3 * h * i + (2 * i + h) * self.mlp_bias
        per_layer = attn + mlp + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        sparse = moe_parameters(h, self.moe_intermediate_size, self.num_experts,
                                self.shared_expert_intermediate_size) - mlp  # instead of the MLP
        return (v * h + self.num_hidden_layers * per_layer + h + head
                + len(self.moe_layers) * sparse)

    def num_active_parameters(self) -> int:
        """Parameters one token's forward uses: all but the experts it is not routed to."""
        idle = self.num_experts - self.num_experts_per_tok
        return self.num_parameters() - len(self.moe_layers) * idle * 3 * self.hidden_size * (
            self.moe_intermediate_size)

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json``; raises a clear error for anything unsupported
        (:class:`UnsupportedModelError`) or impossible (:class:`ConfigError`, naming the field)."""
        if not isinstance(raw, dict):
            raise ConfigError("config",
                              f"a model config is a JSON object, not {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            archs = raw.get("architectures") or []
            supported = ", ".join(
                f"{arch} ({mt})" for mt, arch in SUPPORTED_ARCHITECTURES.items()
            )
            raise UnsupportedModelError(
                f"unsupported architecture: model_type={model_type!r} "
                f"architectures={archs!r}; infer_lab supports {supported}"
            )
        required = (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [k for k in required if k not in raw]
        if missing:
            raise ValueError(f"config.json is missing required keys: {', '.join(missing)}")
        heads = _size("num_attention_heads", raw["num_attention_heads"])
        kv_heads = _size("num_key_value_heads", raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ConfigError(
                "num_key_value_heads",
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        hidden = _size("hidden_size", raw["hidden_size"])
        head_dim = _head_dim(raw.get("head_dim") or hidden // heads)
        layers = _size("num_hidden_layers", raw["num_hidden_layers"])
        fields: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=_size("vocab_size", raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=_size("intermediate_size", raw["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=_size(
                "max_position_embeddings", raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=_positive("rms_norm_eps", raw.get("rms_norm_eps", 1e-6)),
            rope=_read_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=_qkv_bias(raw),
            o_bias=model_type in ("llama", "qwen3") and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_windows=_read_windows(raw, model_type, layers),
            bos_token_id=_token_ids("bos_token_id", raw.get("bos_token_id")),
            eos_token_id=_token_ids("eos_token_id", raw.get("eos_token_id")),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        )
        fields.update(moe_fields(raw, layers))  # Chapter 12: experts and the MoE families' rules
        return cls(**fields)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(e.field, f"{path}: {e}") from None


def _size(field: str, value: Any) -> int:
    """A dimension, count or length: an integer from 1 to :data:`MAX_SIZE`."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
        raise ConfigError(field,
                          f"{field} must be an integer from 1 to {MAX_SIZE:,}, got {value!r}")
    return value


def _head_dim(value: Any) -> int:
    head_dim = _size("head_dim", value)
    if head_dim % 2:
        raise ConfigError("head_dim", f"head_dim must be even (rotary embeddings pair its "
                                      f"dimensions), got {head_dim}")
    return head_dim


def _positive(field: str, value: Any) -> float:
    """A scale or epsilon: a finite number above zero."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        0 < value < float("inf")
    ):
        raise ConfigError(field, f"{field} must be a finite number above 0, got {value!r}")
    return float(value)


def _token_ids(field: str, value: Any) -> int | list[int] | None:
    """A special token id, a list of them, or None."""
    ids = value if isinstance(value, list) else [value]
    if value is not None and not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_SIZE for i in ids
    ):
        raise ConfigError(field, f"{field} must be a token id or a list of them, got {value!r}")
    return value


def _section(raw: dict[str, Any], field: str) -> dict[str, Any]:
    value = raw.get(field) or {}
    if not isinstance(value, dict):
        raise ConfigError(field, f"{field} must be an object, got {value!r}")
    return value


def _qkv_bias(raw: dict[str, Any]) -> bool:
    """Qwen2 always has q/k/v biases, Mistral never; Llama and Qwen3 with ``attention_bias``."""
    if raw["model_type"] == "qwen2":
        return True
    if raw["model_type"] == "mistral":
        return False
    return bool(raw.get("attention_bias", False))


def _read_rope(raw: dict[str, Any]) -> RopeConfig:
    """Normalise the hub's ``rope_theta``/``rope_scaling`` and transformers 5's ``rope_parameters``.
    """
    params = _section(raw, "rope_parameters")
    scaling = _section(raw, "rope_scaling")
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported RoPE scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
        )
    original = merged.get("original_max_position_embeddings")
    rope = RopeConfig(
        theta=_positive("rope_theta", theta),
        rope_type=rope_type,
        factor=_positive("factor", merged.get("factor", 1.0)),
        low_freq_factor=_positive("low_freq_factor", merged.get("low_freq_factor", 1.0)),
        high_freq_factor=_positive("high_freq_factor", merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=(
            None if original is None else _size("original_max_position_embeddings", original)),
    )
    if rope_type == "llama3" and rope.high_freq_factor <= rope.low_freq_factor:
        raise ConfigError("high_freq_factor", "llama3 RoPE needs high_freq_factor > "
                          f"low_freq_factor, got {rope.high_freq_factor} <= {rope.low_freq_factor}")
    return rope


def _read_windows(raw: dict[str, Any], model_type: str, layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding windows, following each family's rule in transformers."""
    window = raw.get("sliding_window")
    if window:
        window = _size("sliding_window", window)
    if model_type == "mistral":
        return (window,) * layers if window else ()
    if model_type in ("qwen2", "qwen3"):
        # As in transformers: the window applies only when use_sliding_window is set.
        if not raw.get("use_sliding_window", False) or not window:
            return ()
        layer_types = raw.get("layer_types")
        if layer_types:
            if not isinstance(layer_types, list) or len(layer_types) != layers:
                raise ConfigError("layer_types", f"layer_types must list one type per layer "
                                                 f"({layers}), got {layer_types!r}")
            return tuple(window if t == "sliding_attention" else None for t in layer_types)
        first = raw.get("max_window_layers", layers)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ConfigError("max_window_layers",
                              f"max_window_layers must be a non-negative integer, got {first!r}")
        return tuple(window if i >= first else None for i in range(layers))
    return ()
