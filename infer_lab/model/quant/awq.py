"""AWQ: scale up the input channels that carry large activations before rounding to int4.

A weight column that multiplies a large activation matters more to the output than one that
multiplies a small one, but round-to-nearest gives every column of a group the same absolute
step. AWQ (Lin et al., 2024) multiplies column ``k`` by ``s_k = mean|x_k|^alpha`` before
quantizing and divides the activation by it (folded into the op that produces the input, so
the product is unchanged and nothing is added at run time): ``y = (x / s) Q(W diag(s))^T``.
:func:`fold_input_scales` does that fold: into the RMSNorm before ``qkv_proj`` and
``gate_up_proj``, into ``up``'s rows before ``down_proj``, into ``v``'s rows before ``o_proj``.
The last needs one V channel per ``o_proj`` input: under grouped-query attention a V channel
feeds several query heads, so an arbitrary ``s`` cannot fold there, and (as AutoAWQ and llm-awq
do) ``o_proj`` is then left unscaled: :func:`scales_fold` says which linears can take ``s``.
The salient columns are then rounded on a finer relative grid. ``alpha`` is searched on a grid
in [0, 1] per layer, minimizing the layer's output error on calibration activations; ``alpha=0``
is plain RTN, so the search never does worse than RTN *on the calibration data*.

Here the effective weight ``Q(W diag(s)) diag(1/s)`` is returned (what the folded model
computes); the int4 grid and groups are :func:`~infer_lab.model.quant.gptq.rtn_int4`'s.
The original's weight-clipping search is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from infer_lab.model.config import ModelConfig
from infer_lab.model.quant import FormatError
from infer_lab.model.quant.fp8 import check_finite
from infer_lab.model.quant.gptq import Int4Groups, rtn_int4

ALPHAS = tuple(i / 20 for i in range(21))


@dataclass
class AWQResult:
    """The int4 weight of ``W diag(scales)`` and the per-input-channel ``scales`` it divides by."""

    int4: Int4Groups
    scales: torch.Tensor
    alpha: float

    @property
    def bits_per_weight(self) -> float:
        return self.int4.bits_per_weight  # the scales fold into the op before: no bytes

    def dequantize(self, name: str = "weight") -> torch.Tensor:
        return self.int4.dequantize(name) / self.scales[None, :]


@torch.no_grad()
def awq_int4(w: torch.Tensor, x_mean_abs: torch.Tensor, x_sample: torch.Tensor,
             group_size: int = 128, alphas: tuple[float, ...] = ALPHAS,
             name: str = "weight") -> AWQResult:
    """AWQ of ``w [N, K]`` from its inputs' mean magnitude per channel ``[K]`` and a sample of
    inputs ``[T, K]`` on which the output error is measured."""
    k = w.shape[1]
    if x_mean_abs.shape != (k,) or x_sample.dim() != 2 or x_sample.shape[1] != k:
        raise FormatError(f"{name}: activation statistics {tuple(x_mean_abs.shape)} / "
                          f"{tuple(x_sample.shape)} do not match {k} inputs")
    check_finite(x_mean_abs, f"{name} activations")
    w = w.detach().float()
    x = x_sample.float()
    ref = x @ w.t()
    best: AWQResult | None = None
    best_err = float("inf")
    stat = x_mean_abs.float().clamp(min=1e-8)
    for alpha in alphas:
        s = stat.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centred around 1, as the original does
        q = rtn_int4(w * s[None, :], group_size, name)
        out = x @ (q.dequantize() / s[None, :]).t()
        err = float((out - ref).pow(2).mean())
        if err < best_err:
            best_err, best = err, AWQResult(q, s, alpha)
    assert best is not None
    return best


def scales_fold(name: str, config: ModelConfig) -> bool:
    """Whether AWQ's ``1/s`` on linear ``name``'s input folds into the op that produces it: yes
    for every layer linear except ``o_proj`` under grouped-query attention (see the module)."""
    return not (name.endswith("o_proj")
                and config.num_attention_heads != config.num_key_value_heads)


@torch.no_grad()
def fold_input_scales(layer: nn.Module, name: str, s: torch.Tensor,
                      config: ModelConfig) -> None:
    """Multiply linear ``name``'s input columns (in decoder ``layer``) by ``s`` and divide the
    op that produces that input by ``s``, in place: the layer's outputs are unchanged."""
    if not scales_fold(name, config):
        raise FormatError(f"{name}: under grouped-query attention ({config.num_attention_heads} "
                          f"query heads, {config.num_key_value_heads} KV heads) a V channel "
                          "feeds several o_proj inputs; a per-channel scale cannot fold into it")
    attn, mlp = layer.self_attn, layer.mlp
    if name.endswith("qkv_proj"):
        before, consumer = layer.input_layernorm.weight, attn.qkv_proj
    elif name.endswith("gate_up_proj"):
        before, consumer = layer.post_attention_layernorm.weight, mlp.gate_up_proj
    elif name.endswith("down_proj"):  # silu(gate) * up: up's rows (the second half) carry it
        up = mlp.gate_up_proj
        half = up.out_features // 2
        before, consumer = up.weight[half:], mlp.down_proj
        if up.bias is not None:
            up.bias[half:] /= s
    elif name.endswith("o_proj"):  # attention is linear in V: V's rows carry it
        q, kv = config.q_size, config.kv_size
        before, consumer = attn.qkv_proj.weight[q + kv:], attn.o_proj
        if attn.qkv_proj.bias is not None:
            attn.qkv_proj.bias[q + kv:] /= s
    else:
        raise FormatError(f"{name}: no fold for this linear")
    if s.shape != (consumer.in_features,):
        raise FormatError(f"{name}: {tuple(s.shape)} scales for {consumer.in_features} inputs")
    before.div_(s if before.dim() == 1 else s[:, None])
    consumer.weight.mul_(s[None, :])
