"""Calibration statistics and whole-model fake quantization (Chapter 8b).

GPTQ needs each linear layer's input Hessian ``2 X^T X / n``, AWQ each input channel's mean
magnitude and a sample of inputs: :func:`collect_stats` gathers all three in one pass of the
unquantized model over calibration sequences (forward hooks on every linear of the transformer
layers). That is the one-pass variant: the original GPTQ quantizes layer by layer and feeds
each layer the *quantized* layers' outputs, which costs a pass per layer;
:func:`quantize_sequential` does that block by block and, within a block, stage by stage
(:func:`linear_stages`: the linears that read the same input, [q, k, v] or a fused qkv, then
o_proj, then [gate, up], then down_proj), as AutoGPTQ's default ``true_sequential=True``. The
original AWQ goes block by block too, but feeds each block the *unquantized* block's outputs,
which are the one pass's inputs, so the one pass is its order.

:func:`fake_quantize` then replaces every such linear's weight by its quantized-and-decoded
value: what a kernel that reads the format computes, up to the order of its additions. The
embedding (tied LM head) is left as it is, as GPTQ/AWQ/FP8 checkpoints usually leave it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from infer_lab.model.quant import FormatError

WeightFn = Callable[[str, torch.Tensor], tuple[torch.Tensor, float]]  # -> (decoded, bits/weight)


@dataclass
class LinearStats:
    """One linear layer's calibration inputs: ``X^T X`` summed, ``sum |x|``, a sample of rows."""

    xtx: torch.Tensor
    abs_sum: torch.Tensor
    sample: torch.Tensor
    rows: int = 0

    @property
    def hessian(self) -> torch.Tensor:
        return 2 * self.xtx / max(self.rows, 1)

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.rows, 1)


def layer_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The transformer layers' linears (attention and MLP), by name."""
    out = [(n, m) for n, m in model.named_modules()
           if isinstance(m, nn.Linear) and n.startswith("layers.")]
    if not out:
        raise FormatError("the model has no nn.Linear in its layers (already quantized?)")
    return out


class _Collected(Exception):
    """Raised by a hook once the linears asked for have seen this sequence: the rest of the
    forward is not needed."""


@torch.inference_mode()
def collect_stats(model: nn.Module, sequences: Iterable[torch.Tensor],
                  sample_rows: int = 512, seed: int = 0, *, only: set[str] | None = None,
                  stop_after: nn.Module | None = None) -> dict[str, LinearStats]:
    """Run ``model`` over ``sequences`` (1-D token tensors) and gather every linear's inputs
    (or only those named in ``only``; with ``stop_after``, each forward ends once that module
    has run)."""
    stats: dict[str, LinearStats] = {}
    gen = torch.Generator().manual_seed(seed)
    hooks = []

    def hook(name: str, k: int) -> Callable:
        def fn(_mod: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach().reshape(-1, k).float()
            st = stats.setdefault(name, LinearStats(torch.zeros(k, k, dtype=torch.float64),
                                                    torch.zeros(k, dtype=torch.float64),
                                                    torch.empty(0, k)))
            st.xtx += (x.t() @ x).double()  # fp32 per sequence, summed in fp64
            st.abs_sum += x.abs().sum(0).double()
            st.rows += x.shape[0]
            take = torch.randperm(x.shape[0], generator=gen)[: max(1, sample_rows // 16)]
            st.sample = torch.cat([st.sample, x[take].float()])[-sample_rows:]
        return fn

    def stop(*_: object) -> None:
        raise _Collected

    for name, mod in layer_linears(model):
        if only is None or name in only:
            hooks.append(mod.register_forward_pre_hook(hook(name, mod.in_features)))
    if stop_after is not None:
        hooks.append(stop_after.register_forward_hook(stop))
    try:
        for seq in sequences:
            with contextlib.suppress(_Collected):
                model(torch.as_tensor(seq, dtype=torch.long)[None])
    finally:
        for h in hooks:
            h.remove()
    return stats


def blocks_of(model: nn.Module) -> dict[str, list[tuple[str, nn.Linear]]]:
    """The layer linears grouped by transformer block (``layers.3``), in the model's order."""
    blocks: dict[str, list[tuple[str, nn.Linear]]] = {}
    for name, mod in layer_linears(model):
        blocks.setdefault(".".join(name.split(".")[:2]), []).append((name, mod))
    return blocks


def _version(x: torch.Tensor) -> int | None:
    """The tensor's in-place version counter (None for an inference-mode tensor, which has none)."""
    try:
        return x._version
    except RuntimeError:
        return None


@torch.no_grad()
def linear_stages(model: nn.Module, block: nn.Module, linears: list[tuple[str, nn.Linear]],
                  sequence: torch.Tensor) -> tuple[list[list[str]], bool]:
    """``block``'s linears in stages of those that read the same input, in the order they run,
    found from one forward of ``sequence`` (stopped after the block), not from their names: a
    Llama block gives [q, k, v] (or a fused qkv), [o_proj], [gate, up], [down_proj].

    "The same input" is the same storage, view, dtype and in-place version: a stage's input was
    made before any of its linears ran, so it depends only on earlier stages, and calibrating
    a stage after quantizing those is GPTQ's order. Returns the stages and True; where a linear
    runs more than once or not at all in that forward no grouping is safe, so one linear per
    stage in the model's order and False (then each stage's forward must run the whole block).
    """
    calls: list[tuple[str, torch.Tensor, int | None]] = []

    def hook(name: str) -> Callable:
        def fn(_mod: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            calls.append((name, args[0], _version(args[0])))  # kept: no storage is reused
        return fn

    def stop(*_: object) -> None:
        raise _Collected

    hooks = [m.register_forward_pre_hook(hook(n)) for n, m in linears]
    hooks.append(block.register_forward_hook(stop))
    try:
        with torch.inference_mode(False), contextlib.suppress(_Collected):
            model(torch.as_tensor(sequence, dtype=torch.long)[None])
    finally:
        for h in hooks:
            h.remove()
    names = [n for n, _ in linears]
    if sorted(n for n, _, _ in calls) != sorted(names):
        return [[n] for n in names], False
    stages: dict[tuple, list[str]] = {}
    for name, x, version in calls:
        key = (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(),
               x.dtype, version)
        stages.setdefault(key, []).append(name)
    return list(stages.values()), True


@torch.no_grad()
def quantize_sequential(model: nn.Module, sequences: list[torch.Tensor],
                        weight_fn_for: Callable[[dict[str, LinearStats]], WeightFn],
                        sample_rows: int = 512, seed: int = 0, *,
                        true_sequential: bool = True) -> tuple[nn.Module, float]:
    """GPTQ's original order, block by block: each transformer block's linears are calibrated
    on the inputs that the blocks before it, *already quantized*, produce, and quantized
    before the next block is calibrated, so a block's rounding can make up for the error the
    earlier blocks left in its inputs. :func:`collect_stats` + :func:`fake_quantize` is the
    one-pass variant (every block calibrated on the unquantized model's inputs).

    With ``true_sequential`` (AutoGPTQ's default) the same holds inside a block: its linears
    are taken in :func:`linear_stages` (q/k/v, o_proj, gate/up, down_proj) and each stage is
    calibrated after the earlier stages of the block were quantized, so o_proj sees the
    attention output of the quantized q/k/v and down_proj the activations of the quantized
    gate/up. Each stage costs one more forward of the calibration sequences up to it (four a
    Llama block instead of one, plus one sequence's forward to find its stages). Without it
    every linear of a block is calibrated on that block's inputs in one pass (AutoGPTQ's
    ``true_sequential=False``): a forward up to each block.

    ``weight_fn_for(stats)`` gives the :data:`WeightFn` for one block's statistics (one
    stage's with ``true_sequential``). Returns the quantized copy and its bits per weight.
    """
    q = copy.deepcopy(model)
    bits = numel = 0.0
    for block, linears in blocks_of(q).items():
        mod = q.get_submodule(block)
        by_name = dict(linears)
        stages, grouped = (linear_stages(q, mod, linears, sequences[0]) if true_sequential
                           else ([list(by_name)], False))
        for stage in stages:  # a grouped stage's forward ends after its last linear ran
            stats = collect_stats(q, sequences, sample_rows, seed, only=set(stage),
                                  stop_after=by_name[stage[-1]] if grouped else mod)
            fn = weight_fn_for(stats)
            for name in stage:
                lin = by_name[name]
                bits += _replace_weight(name, lin, fn) * lin.weight.numel()
                numel += lin.weight.numel()
    return q, bits / numel


def _replace_weight(name: str, mod: nn.Linear, weight_fn: WeightFn) -> float:
    """Put ``weight_fn``'s decoded weight into ``mod`` (checked); return its bits per weight."""
    w_hat, b = weight_fn(name, mod.weight.detach().float())
    if w_hat.shape != mod.weight.shape or not torch.isfinite(w_hat).all():
        raise FormatError(f"{name}: the quantized weight is {tuple(w_hat.shape)} or not finite")
    mod.weight.copy_(w_hat.to(mod.weight.dtype))
    return b


@torch.no_grad()
def fake_quantize(model: nn.Module, weight_fn: WeightFn) -> tuple[nn.Module, float]:
    """A copy of ``model`` with every layer linear's weight replaced by ``weight_fn``'s decoded
    one; returns it and the bits per weight over those linears (scales and zeros counted)."""
    q = copy.deepcopy(model)
    bits = numel = 0.0
    for name, mod in layer_linears(q):
        bits += _replace_weight(name, mod, weight_fn) * mod.weight.numel()
        numel += mod.weight.numel()
    return q, bits / numel


ActivationFn = Callable[[str, torch.Tensor], torch.Tensor]  # [T, K] -> decoded [T, K]


def with_activation_format(model: nn.Module, act_fn: ActivationFn
                           ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``ids -> logits`` of ``model`` with every layer linear's *input* passed through
    ``act_fn`` (e.g. FP8 with a scale per token): W8A8's activation half, on its own."""

    def hook(name: str) -> Callable:
        def fn(mod: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            x = args[0]
            return (act_fn(name, x.reshape(-1, x.shape[-1])).view(x.shape).to(x.dtype),
                    *args[1:])
        return fn

    def logits(ids: torch.Tensor) -> torch.Tensor:
        hooks = [m.register_forward_pre_hook(hook(n)) for n, m in layer_linears(model)]
        try:
            return model(ids)
        finally:
            for h in hooks:
                h.remove()

    return logits
