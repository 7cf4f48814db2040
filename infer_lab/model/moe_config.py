"""The mixture-of-experts part of a ``config.json``: Mixtral, Qwen2-MoE and Qwen3-MoE (Chapter 12).

Each MoE family is a dense family whose MLP became a router and experts in some layers: Mixtral is
Mistral's attention, Qwen2-MoE is Qwen2's (q/k/v bias, here switchable by ``qkv_bias``) plus a
shared expert behind a sigmoid gate, Qwen3-MoE is Qwen3's (q/k RMSNorm). :func:`moe_fields` reads
what differs into :class:`~infer_lab.model.config.ModelConfig`'s fields, following transformers'
rules, and refuses a config that cannot describe a working model, naming the field.

Plain Python, no torch: the config module imports this one.
"""

from __future__ import annotations

from typing import Any

# model_type -> the architecture name transformers uses for it.
MOE_ARCHITECTURES: dict[str, str] = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# transformers' defaults where a hub config.json leaves a key out.
_QWEN2_MOE_SHARED_DEFAULT = 5632


class MoEConfigError(ValueError):
    """A mixture-of-experts config whose expert fields cannot describe a model."""


def _int_field(raw: dict[str, Any], name: str, model_type: str) -> int:
    if raw.get(name) is None:
        raise MoEConfigError(f"config.json of a {model_type} model needs {name!r}")
    value = raw[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise MoEConfigError(f"{name}={value!r} in config.json must be an integer")
    return value


def _num_experts(raw: dict[str, Any], model_type: str) -> tuple[int, str]:
    """The expert count and the key it came from (transformers 5 writes Qwen3-MoE's under
    Mixtral's name, ``num_local_experts``; the hub's files say ``num_experts``)."""
    keys = ("num_local_experts",) if model_type == "mixtral" else (
        "num_experts", "num_local_experts")
    for key in keys:
        if raw.get(key) is not None:
            return _int_field(raw, key, model_type), key
    raise MoEConfigError(f"config.json of a {model_type} model needs {keys[0]!r}")


def moe_layer_indices(raw: dict[str, Any], layers: int, num_experts: int) -> tuple[int, ...]:
    """Layers whose MLP is sparse: Mixtral's all; Qwen's by ``decoder_sparse_step`` and
    ``mlp_only_layers``, exactly as transformers' ``Qwen2MoeDecoderLayer`` decides."""
    if raw["model_type"] == "mixtral":
        return tuple(range(layers))
    step = raw.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise MoEConfigError(f"decoder_sparse_step={step!r} must be an integer >= 1")
    dense_only = raw.get("mlp_only_layers") or []
    bad = [i for i in dense_only if not isinstance(i, int) or not 0 <= i < layers]
    if bad:
        raise MoEConfigError(f"mlp_only_layers names layers {bad} outside 0..{layers - 1}")
    if num_experts == 0:
        return ()
    return tuple(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0)


def _windows(raw: dict[str, Any], model_type: str, layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding windows by each MoE family's own rule in transformers."""
    window = raw.get("sliding_window")
    if model_type == "mixtral":
        return (int(window),) * layers if window else ()
    if not raw.get("use_sliding_window", False) or not window:
        return ()
    if model_type == "qwen3_moe":  # every layer (Qwen3MoeAttention takes config.sliding_window)
        return (int(window),) * layers
    types = raw.get("layer_types") or [  # Qwen2MoeConfig's default layer_types
        "sliding_attention" if (i + 1) % 2 and i < raw.get("max_window_layers", 28)
        else "full_attention" for i in range(layers)]
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def moe_fields(raw: dict[str, Any], layers: int) -> dict[str, Any]:
    """ModelConfig fields for an MoE ``config.json`` (empty for a dense one).

    Besides the expert fields this sets the attention switches that differ from the dense
    family's rule in ``config.py``: Qwen2-MoE's ``qkv_bias`` key, Qwen3-MoE's q/k norm and
    output bias, and the sliding windows.
    """
    model_type = raw.get("model_type")
    if model_type not in MOE_ARCHITECTURES:
        return {}
    experts, experts_key = _num_experts(raw, model_type)
    if experts < 0 or (experts == 0 and model_type == "mixtral"):
        raise MoEConfigError(f"{experts_key}={experts}: a mixture of experts needs at least one")
    top_k = _int_field(raw, "num_experts_per_tok", model_type)
    if experts and not 1 <= top_k <= experts:
        raise MoEConfigError(
            f"num_experts_per_tok={top_k} must be between 1 and the {experts} experts "
            f"({experts_key}): a token cannot be routed to more experts than there are")
    size_key = "intermediate_size" if model_type == "mixtral" else "moe_intermediate_size"
    expert_size = _int_field(raw, size_key, model_type) if experts else 0
    if experts and expert_size < 1:
        raise MoEConfigError(f"{size_key}={expert_size} must be at least 1")
    shared = 0
    if model_type == "qwen2_moe":
        shared = int(raw.get("shared_expert_intermediate_size", _QWEN2_MOE_SHARED_DEFAULT))
    fields: dict[str, Any] = dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=expert_size,
        norm_topk_prob=model_type == "mixtral" or bool(raw.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=shared,
        moe_layers=moe_layer_indices(raw, layers, experts),
        sliding_windows=_windows(raw, model_type, layers),
    )
    if model_type == "mixtral":
        fields.update(qkv_bias=False, o_bias=False)
    elif model_type == "qwen2_moe":
        fields.update(qkv_bias=bool(raw.get("qkv_bias", True)), o_bias=False)
    else:
        bias = bool(raw.get("attention_bias", False))
        fields.update(qkv_bias=bias, o_bias=bias, qk_norm=True)
    return fields


def moe_parameters(hidden: int, expert_size: int, experts: int, shared: int) -> int:
    """Parameters of one sparse MLP block: router, experts, shared expert and its gate."""
    shared_params = 3 * hidden * shared + hidden if shared else 0
    return experts * hidden + experts * 3 * hidden * expert_size + shared_params
