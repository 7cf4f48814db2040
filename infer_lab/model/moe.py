"""The sparse MLP of a mixture-of-experts model: a router, ``E`` experts, maybe a shared expert.

A :class:`SparseMoeBlock` stands where a dense layer's MLP stands (the transformer picks one per
layer from :attr:`ModelConfig.moe_layers`). For each token the router's logits choose ``k`` experts
and their weights (:func:`~infer_lab.kernels.moe.select_experts`), the experts run on the tokens
routed to them (:func:`~infer_lab.kernels.moe.fused_experts`), and each token gets the weighted sum
of its ``k`` outputs; Qwen2-MoE adds a shared expert that every token goes through, scaled by a
sigmoid gate. The block takes ``[..., H]`` and flattens: a plain batch ``[B, S, H]`` and the
engine's flat ragged batch ``[T, H]`` are the same to it, which is why nothing else in the engine
changes for an MoE model.

The experts' weights are stacked: ``w13_weight [E, 2I, H]`` (gate rows, then up rows) and
``w2_weight [E, H, I]``, vLLM's names. :func:`expert_checkpoint_target` maps a checkpoint's tensors
onto them: the hub's one tensor per expert and projection (Mixtral's ``w1``/``w3``/``w2``, Qwen's
``gate_proj``/``up_proj``/``down_proj``) and transformers 5's fused ``gate_up_proj``/``down_proj``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from infer_lab.kernels import silu_and_mul
from infer_lab.kernels.moe import fused_experts, select_experts
from infer_lab.model.config import ModelConfig
from infer_lab.model.linear import Linear
from infer_lab.model.moe_config import MoEConfigError

RouterHook = Callable[[int, torch.Tensor, torch.Tensor], None]


class FusedMoE(nn.Module):
    """The ``E`` experts of one layer, stacked (vLLM's ``FusedMoE`` weights, no router)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = (
            num_experts, hidden, intermediate)
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP of its own size (Qwen2-MoE's shared expert), gate/up fused."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router + experts (+ a gated shared expert): the MLP of one MoE layer."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = SharedExpert(cfg.hidden_size, shared) if shared else None
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False) if shared else None
        # Called with (layer, topk_ids, router_logits) on every forward when set: how Chapter 12
        # counts tokens per expert on real text without touching the forward.
        self.router_hook: RouterHook | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        router_logits = self.gate(x)
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        if self.router_hook is not None:
            self.router_hook(self.layer, topk_ids, router_logits)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """The sparse MLP blocks of ``model``, layer by layer."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


# ----------------------------------------------------------------------------- checkpoint names
_EXPERT = re.compile(
    r"^(?:model\.)?layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERTS = re.compile(
    r"^(?:model\.)?layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight$")
_SHARED = re.compile(
    r"^(?:model\.)?layers\.(\d+)\.mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight$")
_SHARED_GATE = re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.shared_expert_gate\.weight$")
_GATE_OR_UP = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}
# (our parameter, the expert's slot in it or None, the rows of that slot it fills or None)
Target = tuple[str, "int | None", "slice | None"]


def _experts_key(cfg: ModelConfig) -> str:
    return "num_local_experts" if cfg.model_type == "mixtral" else "num_experts"


def _size_key(cfg: ModelConfig) -> str:
    return "intermediate_size" if cfg.model_type == "mixtral" else "moe_intermediate_size"


def _sparse_layer(cfg: ModelConfig, layer: int, name: str) -> None:
    if not cfg.is_moe_layer(layer):
        raise MoEConfigError(
            f"checkpoint tensor {name!r} belongs to an MoE block, but by the config layer {layer} "
            f"is dense (moe layers: {list(cfg.moe_layers)}; see decoder_sparse_step and "
            "mlp_only_layers)")


def _router(m: re.Match, shape: tuple[int, ...], cfg: ModelConfig) -> Target:
    layer, e, h = int(m.group(1)), cfg.num_experts, cfg.hidden_size
    _sparse_layer(cfg, layer, m.string)
    if shape != (e, h):
        raise MoEConfigError(
            f"router {m.string!r} has shape {shape}: {shape[0]} experts, but the config says "
            f"{_experts_key(cfg)}={e} (and hidden_size={h})")
    return f"layers.{layer}.mlp.gate.weight", None, None


def _one_expert(m: re.Match, shape: tuple[int, ...], cfg: ModelConfig) -> Target:
    layer, expert, proj = int(m.group(1)), int(m.group(2)), m.group(3)
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    _sparse_layer(cfg, layer, m.string)
    if expert >= cfg.num_experts:
        raise MoEConfigError(
            f"checkpoint has expert {expert} in layer {layer} ({m.string!r}) but the config says "
            f"{_experts_key(cfg)}={cfg.num_experts}")
    want = (h, i) if proj in ("w2", "down_proj") else (i, h)
    if shape != want:
        raise MoEConfigError(
            f"expert tensor {m.string!r} has shape {shape}, but {_size_key(cfg)}={i} and "
            f"hidden_size={h} imply {want}")
    if proj in ("w2", "down_proj"):
        return f"layers.{layer}.mlp.experts.w2_weight", expert, None
    part = _GATE_OR_UP[proj]
    return f"layers.{layer}.mlp.experts.w13_weight", expert, slice(part * i, (part + 1) * i)


def _fused_experts(m: re.Match, shape: tuple[int, ...], cfg: ModelConfig) -> Target:
    layer, proj = int(m.group(1)), m.group(2)
    h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    _sparse_layer(cfg, layer, m.string)
    want = (e, 2 * i, h) if proj == "gate_up_proj" else (e, h, i)
    if shape != want:
        raise MoEConfigError(
            f"fused expert tensor {m.string!r} has shape {shape}, but {_experts_key(cfg)}={e}, "
            f"{_size_key(cfg)}={i} and hidden_size={h} imply {want}")
    ours = "w13_weight" if proj == "gate_up_proj" else "w2_weight"
    return f"layers.{layer}.mlp.experts.{ours}", None, None


def _shared_expert(m: re.Match, shape: tuple[int, ...], cfg: ModelConfig) -> Target:
    layer, proj, s, h = m.group(1), m.group(2), cfg.shared_expert_intermediate_size, cfg.hidden_size
    want = (h, s) if proj == "down_proj" else (s, h)
    if shape != want:
        raise MoEConfigError(
            f"shared expert tensor {m.string!r} has shape {shape}, but "
            f"shared_expert_intermediate_size={s} and hidden_size={h} imply {want}")
    if proj == "down_proj":
        return f"layers.{layer}.mlp.shared_expert.down_proj.weight", None, None
    part = _GATE_OR_UP[proj]
    return (f"layers.{layer}.mlp.shared_expert.gate_up_proj.weight", None,
            slice(part * s, (part + 1) * s))


def _shared_gate(m: re.Match, shape: tuple[int, ...], cfg: ModelConfig) -> Target:
    return f"layers.{m.group(1)}.mlp.shared_expert_gate.weight", None, None


_TARGETS: tuple[tuple[re.Pattern, Callable[[re.Match, tuple[int, ...], ModelConfig], Target]], ...]
_TARGETS = ((_ROUTER, _router), (_EXPERT, _one_expert), (_FUSED_EXPERTS, _fused_experts),
            (_SHARED, _shared_expert), (_SHARED_GATE, _shared_gate))


def expert_checkpoint_target(name: str, shape: tuple[int, ...], cfg: ModelConfig
                             ) -> Target | None:
    """Where checkpoint tensor ``name`` goes in an MoE model, or None if it is not an MoE tensor.

    Returns ``(parameter, expert or None, rows or None)``: the tensor is copied into
    ``parameter[expert][rows]`` (None: the whole parameter, the whole expert slot).
    Raises :class:`MoEConfigError`, naming the config field, when the tensor's shape or index
    disagrees with the config (an expert past the count, a router of another width, ...).
    """
    if not cfg.num_experts:
        return None
    for pattern, target in _TARGETS:
        if m := pattern.match(name):
            return target(m, shape, cfg)
    return None


@torch.no_grad()
def route(block: SparseMoeBlock, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing ``block`` would choose for hidden states ``x [T, H]``: (weights, ids)."""
    return select_experts(F.linear(x, block.gate.weight), block.top_k, block.renormalize)
