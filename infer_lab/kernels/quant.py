"""Matmuls with quantized weights: the dispatch, the CPU fast paths and the torch reference.

``quant_linear(x, layer)`` computes ``x @ W.T (+ bias)`` for a layer whose ``W`` is stored in int8
(per-row scale), int4 (groups with scale and minimum) or a GGUF block format. Which code runs:

- ``impl="reference"``: dequantize the whole weight to ``x``'s dtype, then ``F.linear``. This is
  the definition every other path is tested against.
- Triton (CUDA, or forced with ``backend="triton"``, interpreted on CPU): kernels that dequantize
  *inside* the matmul (:mod:`infer_lab.kernels.triton_quant`), a GEMV when there are few rows
  (decode) and a tiled GEMM otherwise (prefill).
- torch on CPU: the fastest correct kernels torch offers, ``aten._weight_int8pack_mm`` and
  ``aten._weight_int4pack_mm_for_cpu``, both fed *bf16* activations. That choice is measured
  (``benchmarks/results/quantization_kernels.json``): on the machine that took it their fp32
  activation paths ran about 3-60x slower than the bf16 ones (medians per shape), slower than a
  plain fp32 matmul, while with bf16 activations they beat it at batch 1. Rounding the
  activations to bf16 keeps 8 significant bits (2-3 decimal digits), as running the model in
  bf16 does; ``CPU_ACTIVATION`` names the choice
  so a test or the chapter can change it (None: use ``x``'s own dtype).
- GGUF's Q8_0, Q6_K and Q5_K (``int8g``, int8 with a scale per group of 32, or of 16 for
  Q6_K, and for Q5_K a minimum) on CPU: for one row, the int8
  kernel once per group, partial sums added in fp32; for more rows (a batch of decodes, a
  prefill), a bf16 copy of the weight dequantized once and a dense bf16 matmul, because the
  per-group calls do the output's fp32 additions once per group (18 times for SmolLM2's head)
  and lost to the dense matmul from two rows on (``head_q8_0_ms`` in
  ``benchmarks/results/peers.json``). The copy costs twice the codes' bytes, made the first time
  a Q8_0 layer sees more rows (in SmolLM2's file only the embedding, which is also the LM head).
  The calls also cost a fixed amount per group, so a row with many groups (Q6_K's 16-wide
  groups, any K-quant layer of a wide model) takes the copy even at one row: the calls only
  while a row has at most ``INT8G_GROUP_CALLS_MAX_GROUPS`` groups
  (``benchmarks/results/kquant_cpu.json``).
- anything else (int4 with an output size that is not a multiple of 16 or a group size other
  than 32-256, which the CPU kernel refuses): the reference.

A layer with an ``input_perm`` (a GPTQ act-order checkpoint's, its weight's columns stored sorted
by group) has every kernel above fed ``x``'s columns in that order (:func:`stored_order`); the
reference multiplies ``x`` by the weight in its own order (``layer.dequantize()``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from infer_lab.kernels.dispatch import resolve_backend, triton_module

IMPLS = (None, "reference", "fast")
CPU_ACTIVATION: torch.dtype | None = torch.bfloat16  # None: feed x's own dtype
TRITON_GEMV_MAX_ROWS = 16  # at most this many rows of x: the GEMV kernel (decode)
INT8G_GROUP_CALLS_MAX_ROWS = 1  # CPU Q8_0: up to this many rows per-group int8 calls, then bf16
INT8G_GROUP_CALLS_MAX_GROUPS = 32  # ... and only while a row has at most this many groups
CPU_INT4_GROUPS = (32, 64, 128, 256)  # the group sizes _weight_int4pack_mm_for_cpu takes


def quant_linear(x: torch.Tensor, layer: Any, *, backend: str | None = None,
                 impl: str | None = None) -> torch.Tensor:
    """``x [..., K] -> [..., N]`` through a quantized layer (see the module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if x.shape[-1] != layer.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the layer takes {layer.in_features}")
    if impl == "reference":
        return quant_linear_ref(x, layer)
    # A decode step makes about 120 of these calls on one row each, so the Python around the
    # kernel counts: a 2-D x skips the reshape and view, and the device is looked up once.
    flat = x.dim() == 2
    x2 = x if flat else x.reshape(-1, x.shape[-1])
    xs = stored_order(x2, layer)  # what the stored codes multiply (an act-order layer's gather)
    fmt, on_cpu = layer.fmt, x.device.type == "cpu"
    if resolve_backend(backend, x) == "triton" and triton_takes(layer):
        tq = triton_module("triton_quant")
        if fmt == "int8":
            y = tq.w8_linear(xs, layer.qweight, layer.scale)
        else:
            y = tq.w4_linear(xs, layer.qweight, layer.scale, layer.minimum, layer.group_size)
        return _finish(y, x, layer, flat)
    if on_cpu and fmt == "int4" and layer.out_features % 16 == 0 \
            and layer.group_size in CPU_INT4_GROUPS:
        y = int4_linear_cpu(xs, layer)
    elif on_cpu and fmt == "int8":
        y = int8_linear_cpu(xs, layer.qweight, layer.scale)
    elif on_cpu and fmt == "int8g":
        few = x2.shape[0] <= INT8G_GROUP_CALLS_MAX_ROWS and \
            layer.qweight.shape[0] <= INT8G_GROUP_CALLS_MAX_GROUPS  # qweight: [groups, N, size]
        y = int8g_linear_cpu(xs, layer) if few else dense_linear_cpu(x2, layer)
    else:
        return quant_linear_ref(x, layer)
    return _finish(y, x, layer, flat)


def _finish(y: torch.Tensor, x: torch.Tensor, layer: Any, flat: bool) -> torch.Tensor:
    """``y [M, N]`` plus the layer's bias, in ``x``'s leading shape."""
    if layer.bias is not None:
        y = y + layer.bias.to(y.dtype)
    return y if flat else y.view(*x.shape[:-1], y.shape[-1])


def stored_order(x: torch.Tensor, layer: Any) -> torch.Tensor:
    """``x [M, K]`` with its columns in the order the layer stores its weight's inputs.

    A GPTQ act-order checkpoint groups inputs that are not consecutive; the loader sorts the
    weight's columns by group (:mod:`infer_lab.model.quant.gptq_checkpoint`) and keeps the order
    as ``input_perm``, so gathering the activation's columns the same way makes the product
    exact (``x[:, p] @ W[:, p].T == x @ W.T``), as exllama and vLLM do. Other layers: ``x``.
    """
    perm = getattr(layer, "input_perm", None)
    return x if perm is None else x.index_select(1, perm)


def triton_takes(layer: Any) -> bool:
    """Do the Triton kernels cover this layer? int8 always; int4 in power-of-two groups >= 32."""
    g = getattr(layer, "group_size", 0)
    return layer.fmt == "int8" or (layer.fmt == "int4" and g >= 32 and g & (g - 1) == 0)


def quant_linear_ref(x: torch.Tensor, layer: Any) -> torch.Tensor:
    """Dequantize-then-matmul, in ``x``'s dtype."""
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    return F.linear(x, layer.dequantize(x.dtype), bias)


def int8_linear_cpu(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                    act_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``aten._weight_int8pack_mm`` with activations (and the scale) in ``act_dtype``."""
    act = act_dtype or CPU_ACTIVATION or x.dtype
    y = torch.ops.aten._weight_int8pack_mm(x.to(act).contiguous(), qweight, scale.to(act))
    return y.to(x.dtype)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The codes ``[N, K]`` (0..15, uint8) of a nibble-packed ``[N, K/2]`` matrix (low nibble:
    even column)."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def int8g_linear_cpu(x: torch.Tensor, layer: Any) -> torch.Tensor:
    """GGUF Q8_0 / Q6_K / Q5_K (int8 codes, one scale per row and group of 32 or 16) with the
    int8 CPU kernel, one call per group: ``y = sum_g int8mm(x_g, q_g, s_g)``. Each call reads its
    group's codes once, so the whole weight is read once, as in one call; the partial sums add
    up in fp32. A layer with a minimum per group (Q5_K) adds ``sum_g (sum_k x_gk) m_g``: the
    activations' group sums ``[M, G]`` times the minimums ``[G, N]``, one small matmul."""
    act = CPU_ACTIVATION or x.dtype
    scales = getattr(layer, "_cpu_int8g_scale", None)
    if scales is None or scales.dtype != act:
        scales = layer.scale.t().to(act).contiguous()  # [G, N]
        layer._cpu_int8g_scale = scales
    xa = x.to(act)
    group = layer.qweight.shape[-1]
    parts = xa.reshape(x.shape[0], -1, group).transpose(0, 1).contiguous()  # [G, M, group]
    y = torch.ops.aten._weight_int8pack_mm(parts[0], layer.qweight[0], scales[0]).float()
    for g in range(1, layer.qweight.shape[0]):
        # add_ widens each bf16 partial to fp32 itself: no .float() copy per group (the same
        # sum, about 5% of a head's time at one row)
        y.add_(torch.ops.aten._weight_int8pack_mm(parts[g], layer.qweight[g], scales[g]))
    minimum = getattr(layer, "minimum", None)
    if minimum is not None:
        sums = xa.float().view(x.shape[0], -1, group).sum(-1)  # [M, G]
        y += sums @ minimum.float().t()
    return y.to(x.dtype)


def dense_linear_cpu(x: torch.Tensor, layer: Any, act_dtype: torch.dtype | None = None
                     ) -> torch.Tensor:
    """``x @ W.T`` with ``W`` dequantized once into ``act_dtype`` and kept on the layer."""
    act = act_dtype or CPU_ACTIVATION or x.dtype
    dense = layer.__dict__.setdefault("_cpu_dense", {})
    w = dense.get(act)
    if w is None:
        w = dense[act] = layer.dequantize(act)
    return F.linear(x.to(act), w).to(x.dtype)


def int4_cpu_pack(layer: Any, act: torch.dtype = torch.float32
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU int4 kernel's own layout of ``layer``'s weight, built once and cached on it.

    ``_weight_int4pack_mm_for_cpu`` wants its nibbles interleaved its own way and computes
    ``(q - 8) * scale + zero`` per group, so our minimum becomes ``zero = minimum + 8 * scale``
    (in the activations' dtype ``act``, as the kernel requires). The repacked copy is as large
    as the weight; it lives only on CPU.
    """
    packs = layer.__dict__.setdefault("_cpu_int4", {})  # one per activation dtype
    cached = packs.get(act)
    if cached is None:
        codes = unpack_int4(layer.qweight).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        scale = layer.scale.float()
        zero = layer.minimum.float() + 8.0 * scale
        sz = torch.stack([scale.t(), zero.t()], dim=-1).to(act).contiguous()  # [K/g, N, 2]
        cached = packs[act] = (packed, sz)
    return cached


def int4_linear_cpu(x: torch.Tensor, layer: Any, act_dtype: torch.dtype | None = None
                    ) -> torch.Tensor:
    """``aten._weight_int4pack_mm_for_cpu`` with activations (and scales) in ``act_dtype``."""
    act = act_dtype or CPU_ACTIVATION or x.dtype
    packed, sz = int4_cpu_pack(layer, act)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(act).contiguous(), packed,
                                                   layer.group_size, sz)
    return y.to(x.dtype)
