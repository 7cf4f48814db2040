"""Weight-only quantization (Chapter 8): int8 per output channel, int4 in groups, GGUF blocks.

Decode reads every weight once per step, so its time is set by weight bytes: storing a weight in
8 or 4 bits instead of 32 or 16 moves fewer bytes per token. The formats here are round-to-nearest
(no calibration data):

- ``int8``: symmetric, one fp32 scale per output row: ``w ≈ q * s``, ``q`` in [-127, 127],
  ``s = max|w_row| / 127``. Error per weight at most ``s / 2``.
- ``int4``: asymmetric, along the input dimension in groups of ``group_size``: ``w ≈ q * s + m``
  with ``q`` in [0, 15], ``m`` the group's minimum and ``s = (max - min) / 15`` (fp16 each, as
  llama.cpp's Q4_1 stores them). Two weights per byte; 4 + 32/group_size bits per weight.
- ``gguf``: a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks and K-quant (Q4_K / Q5_K / Q6_K)
  super-blocks kept, re-laid without rounding into int4 or ``int8g`` (:func:`keep_gguf_blocks`).

Every linear layer and the embedding (which is also the LM head when tied) are quantized; the
norms, biases and RoPE tables stay in the model's dtype (they are a rounding error in bytes).
The matmuls dispatch through :mod:`infer_lab.kernels.quant`.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from infer_lab.kernels import quant as qk
from infer_lab.kernels.quant import unpack_int4
from infer_lab.model.checkpoint import Weight

PREQUANTIZED = ("gptq", "awq")  # read from a checkpoint quantized so (model.quant.prequantized)
QUANTIZATIONS = ("int8", "int4", "gguf", *PREQUANTIZED)
INT4_DEFAULT_GROUP = 32


class QuantizationError(ValueError):
    """A quantization format, group size or model that cannot go together."""


# ---------------------------------------------------------------------------- formats
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [N, K], scale fp32 [N])`` with ``w ≈ q * scale[:, None]``, per output row."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()[:, None]).to(dtype)


def check_group_size(in_features: int, group_size: int, name: str = "weight") -> None:
    """Raise :class:`QuantizationError` unless ``group_size`` is even and divides the input."""
    if group_size <= 0 or group_size % 2:
        raise QuantizationError(f"int4 group_size must be a positive even number, got {group_size}")
    if in_features % group_size:
        fits = [g for g in (16, 32, 64, 128, 256) if in_features % g == 0]
        raise QuantizationError(
            f"int4 group_size {group_size} does not divide {name}'s input dimension "
            f"{in_features}; group sizes that do: {fits or 'none of 16..256'}"
        )


def check_permutation(perm: torch.Tensor, in_features: int, fmt: str) -> None:
    """Raise :class:`QuantizationError` unless ``perm`` is an int4 layer's permutation of its
    ``in_features`` inputs (int64, each input once)."""
    if fmt != "int4":
        raise QuantizationError(f"input_perm is for int4 layers, not {fmt}")
    if perm.dtype != torch.int64 or perm.shape != (in_features,) or not torch.equal(
            torch.sort(perm).values, torch.arange(in_features, device=perm.device)):
        raise QuantizationError(f"input_perm must be a permutation of the {in_features} inputs "
                                f"(int64), got {perm.dtype} of shape {tuple(perm.shape)}")


def quantize_int4(w: torch.Tensor, group_size: int = INT4_DEFAULT_GROUP
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed uint8 [N, K/2], scale fp16 [N, K/g], minimum fp16 [N, K/g])``.

    Byte ``j`` of a row holds weight ``2j`` in its low nibble and ``2j + 1`` in its high one. The
    codes are computed against the fp16-rounded scale and minimum, the values actually stored.
    """
    n, k = w.shape
    check_group_size(k, group_size)
    g = w.float().view(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-8).half()
    minimum = lo.half()
    q = torch.round((g - minimum.float()[..., None]) / scale.float()[..., None]).clamp(0, 15)
    q = q.to(torch.uint8).view(n, k)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed.contiguous(), scale, minimum


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    q = unpack_int4(packed).float()
    n, k = q.shape
    group = k // scale.shape[1]
    w = q.view(n, -1, group) * scale.float()[..., None] + minimum.float()[..., None]
    return w.view(n, k).to(dtype)


# ---------------------------------------------------------------------------- modules
class QuantizedLinear(nn.Module):
    """A linear layer whose weight is stored in ``int8`` or ``int4``; computes in ``x``'s dtype.

    ``backend`` and ``impl`` go to :func:`infer_lab.kernels.quant.quant_linear`: None follows the
    global kernel setting (Triton on CUDA; on CPU torch's int8/int4 kernels), ``impl="reference"``
    forces dequantize-then-matmul.

    ``input_perm`` (int4 only): the stored weight's column ``j`` is input ``input_perm[j]`` (a
    GPTQ act-order checkpoint's columns sorted by group so that groups are consecutive); the
    kernels gather ``x``'s columns so before multiplying, and :meth:`dequantize` puts the columns
    back, so the layer still stands for the checkpoint's weight.
    """

    def __init__(self, fmt: str, tensors: dict[str, torch.Tensor], in_features: int,
                 out_features: int, bias: torch.Tensor | None = None, group_size: int = 0,
                 input_perm: torch.Tensor | None = None) -> None:
        super().__init__()
        if fmt not in ("int8", "int4", "int8g"):
            raise QuantizationError(f"unknown weight format {fmt!r}")
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        self.group_size = group_size
        for name, t in tensors.items():
            self.register_buffer(name, t)
        if input_perm is not None:
            check_permutation(input_perm, in_features, fmt)
        self.input_perm: torch.Tensor | None
        self.register_buffer("input_perm", input_perm)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.backend: str | None = None
        self.impl: str | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, group_size: int = INT4_DEFAULT_GROUP,
                    name: str = "weight") -> QuantizedLinear:
        w = linear.weight.detach()
        n, k = w.shape
        if fmt == "int8":
            q, s = quantize_int8(w)
            tensors = {"qweight": q, "scale": s}
            group_size = 0
        elif fmt == "int4":
            check_group_size(k, group_size, name)
            p, s, m = quantize_int4(w, group_size)
            tensors = {"qweight": p, "scale": s, "minimum": m}
        else:
            raise QuantizationError(f"unknown weight format {fmt!r}; use int8 or int4")
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(fmt, tensors, k, n, bias, group_size)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the quantized weight and its scales (the bias, if any, included)."""
        return sum(b.numel() * b.element_size() for b in self.buffers()) + (
            0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[out, in]`` weight this layer stands for (columns in the inputs' order)."""
        if self.fmt == "int8":
            return dequantize_int8(self.qweight, self.scale, dtype)
        if self.fmt == "int8g":
            return self.dequantize_rows(slice(None), dtype)
        w = dequantize_int4(self.qweight, self.scale, self.minimum, dtype)
        if self.input_perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.input_perm] = w
        return out

    def dequantize_rows(self, rows: torch.Tensor | slice,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``rows`` of the weight; for ``int8g`` (GGUF Q8_0, Q5_K, Q6_K: int8 codes stored
        group-major ``[K/g, N, g]``, a scale per row and group ``[N, K/g]``, and for Q5_K a
        minimum too: ``w = q * scale + minimum``)."""
        codes = self.qweight[:, rows].float()  # [G, n, g]
        w = codes * self.scale[rows].t().float()[..., None]
        minimum = getattr(self, "minimum", None)
        if minimum is not None:
            w = w + minimum[rows].t().float()[..., None]
        return w.permute(1, 0, 2).reshape(w.shape[1], -1).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return qk.quant_linear(x, self, backend=self.backend, impl=self.impl)

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.group_size else ""
        g += ", input_perm" if self.input_perm is not None else ""
        return f"{self.fmt}, in={self.in_features}, out={self.out_features}{g}"


class QuantizedEmbedding(nn.Module):
    """An embedding table stored quantized, looked up row by row and dequantized on the fly.

    Rows are the table's output channels, so one int8 scale per token row (or int4 groups along
    the hidden dimension) serves both the lookup and, when tied, the LM head: ``as_linear``
    is the same storage seen as a :class:`QuantizedLinear`.
    """

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.out_dtype = dtype

    @property
    def num_embeddings(self) -> int:
        return self.table.out_features

    @property
    def weight_bytes(self) -> int:
        return self.table.weight_bytes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.table
        flat = ids.reshape(-1)
        if t.fmt == "int8":
            rows = t.qweight[flat].float() * t.scale[flat, None]
        elif t.fmt == "int4":
            rows = dequantize_int4(t.qweight[flat], t.scale[flat], t.minimum[flat])
        else:
            rows = t.dequantize_rows(flat)
        return rows.to(self.out_dtype).view(*ids.shape, rows.shape[-1])


def model_weight_bytes(model: nn.Module) -> int:
    """Every byte of the model's weights: parameters and buffers, each storage counted once.

    The RoPE frequency table (computed, not loaded) is left out.
    """
    seen: set[int] = set()
    total = 0
    tensors = [t for n, t in model.named_parameters(remove_duplicate=False)]
    tensors += [t for n, t in model.named_buffers(remove_duplicate=False)
                if not n.endswith("inv_freq")]
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


# ---------------------------------------------------------------------------- the model
_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def check_quantization_name(quantization: str | None) -> None:
    """Raise :class:`QuantizationError` unless ``quantization`` is one of :data:`QUANTIZATIONS`
    or None."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise QuantizationError(
            f"quantization must be one of {QUANTIZATIONS} (or None), got {quantization!r}")


def check_quantization(model: nn.Module, quantization: str, group_size: int) -> None:
    """Raise :class:`QuantizationError` if ``model`` cannot take ``quantization``; no change."""
    check_quantization_name(quantization)
    if quantization == "gguf":
        raise QuantizationError(f"quantize_model does {QUANTIZATIONS[:2]}; 'gguf' keeps a GGUF "
                                "file's blocks and needs a .gguf model")
    if quantization in PREQUANTIZED:
        raise QuantizationError(f"quantize_model does {QUANTIZATIONS[:2]}; {quantization!r} "
                                "reads a checkpoint quantized so: load its directory")
    if getattr(model, "quantization", None):
        raise QuantizationError(f"the model is already quantized ({model.quantization})")
    if getattr(model.config, "num_experts", 0):  # Chapter 12
        raise QuantizationError(
            f"this is a mixture-of-experts model ({model.config.num_experts} experts per layer); "
            "quantized experts are not supported: load it without quantization")
    if model.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise QuantizationError(f"cannot quantize a {model.dtype} model")
    if quantization == "int4":
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear):
                check_group_size(mod.in_features, group_size, name)
        check_group_size(model.config.hidden_size, group_size, "embed_tokens")


@torch.no_grad()
def quantize_model(model: nn.Module, quantization: str, group_size: int = INT4_DEFAULT_GROUP
                   ) -> nn.Module:
    """Quantize ``model`` (a :class:`~infer_lab.model.transformer.Transformer`) in place.

    Every linear layer and the embedding / LM head become quantized modules; a tied head shares
    the embedding's quantized storage. Everything is checked before anything changes, so a bad
    combination (e.g. int4 groups of 128 on SmolLM2's 576-wide layers) raises and leaves the
    model as it was. Returns the model, with ``model.quantization`` set.
    """
    check_quantization(model, quantization, group_size)
    dtype = model.dtype
    for i, layer in enumerate(model.layers):
        for path in _LINEARS:
            parent_name, attr = path.split(".")
            parent = getattr(layer, parent_name)
            lin = getattr(parent, attr)
            setattr(parent, attr, QuantizedLinear.from_linear(
                lin, quantization, group_size, f"layers.{i}.{path}"))
    emb_linear = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    emb_linear.weight = model.embed_tokens.weight
    table = QuantizedLinear.from_linear(emb_linear, quantization, group_size, "embed_tokens")
    model.embed_tokens = QuantizedEmbedding(table, dtype)
    if model.lm_head is None:
        model.lm_head = table  # tied: the head *is* the quantized table
    else:
        model.lm_head = QuantizedLinear.from_linear(model.lm_head, quantization, group_size,
                                                    "lm_head")
    model.quantization = quantization if quantization != "int4" else f"int4-g{group_size}"
    return model


# ---------------------------------------------------------------------------- GGUF blocks
GGUF_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
K_QUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")
# weights and bytes per block
_GGUF_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144),
                "Q5_K": (256, 176), "Q6_K": (256, 210)}


def gguf_block_tensors(data: np.ndarray, qtype: str, rows: int, cols: int,
                       name: str = "weight") -> tuple[str, dict[str, torch.Tensor]]:
    """A GGUF matrix's llama.cpp blocks re-laid into this module's formats *without rounding*:
    every weight :meth:`QuantizedLinear.dequantize` gives is the one ``gguf``'s dequantizer
    gives, bit for bit.

    - Q4_1 (20 bytes: fp16 ``d``, fp16 ``m``, 16 bytes of nibbles; weight ``j`` is the low
      nibble of byte ``j``, weight ``j + 16`` its high nibble; ``w = q * d + m``): int4, g32, with
      ``scale = d`` and ``minimum = m``, the same bits in another order.
    - Q4_0 (18 bytes, ``w = (q - 8) * d``): int4 g32 with ``minimum = -8 d`` (exact in fp16).
    - Q8_0 (34 bytes: fp16 ``d``, 32 int8, ``w = q * d``): ``int8g``, int8 codes with one fp16
      scale per row and group of 32.
    - The K-quants (:func:`_k_block_tensors`): Q4_K as int4 g32, Q5_K as ``int8g`` g32 with a
      minimum, Q6_K as ``int8g`` g16, each with float32 scales.

    A NaN or infinite scale raises :class:`QuantizationError` naming ``name``.
    """
    if qtype not in GGUF_BLOCK_TYPES:
        raise QuantizationError(f"{name}: GGUF tensors of type {qtype} are not kept as blocks; "
                                f"quantization='gguf' keeps {', '.join(GGUF_BLOCK_TYPES)}")
    per, size = _GGUF_BLOCKS[qtype]
    if cols % per:
        raise QuantizationError(f"{name}: rows of {cols} weights are not whole {qtype} blocks "
                                f"of {per}")
    blocks = np.ascontiguousarray(data).reshape(rows, cols // per, size)
    if qtype in K_QUANT_TYPES:
        fmt, t = _k_block_tensors(blocks, qtype, rows, cols)
    else:
        fmt, t = _legacy_block_tensors(blocks, qtype, rows, cols)
    _check_block_scales(t, name, qtype, cols)
    return fmt, t


def _llama_nibbles_to_ours(qs: np.ndarray) -> np.ndarray:
    """Bytes ``[..., L]`` in llama.cpp's order (weight ``i < L`` the low nibble of byte ``i``,
    weight ``L + i`` its high nibble) re-packed in ours (byte ``j``: weights ``2j``, ``2j + 1``)."""
    even, odd = qs[..., 0::2], qs[..., 1::2]
    return np.concatenate([(even & 15) | ((odd & 15) << 4), (even >> 4) | (odd & 0xF0)], -1)


def _f16_field(blocks: np.ndarray, at: int) -> torch.Tensor:
    """The fp16 field at byte ``at`` of every block ``[..., size]``, as a tensor ``[...]``."""
    return torch.from_numpy(blocks[..., at:at + 2].copy().view(np.float16)[..., 0])


def _legacy_block_tensors(blocks: np.ndarray, qtype: str, rows: int, cols: int
                          ) -> tuple[str, dict[str, torch.Tensor]]:
    """Q4_0, Q4_1 and Q8_0 blocks ``[rows, cols / 32, size]`` (see :func:`gguf_block_tensors`)."""
    d = _f16_field(blocks, 0)  # [rows, nb]
    if qtype == "Q8_0":
        codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8))  # [rows, nb, 32]
        return "int8g", {"qweight": codes.permute(1, 0, 2).contiguous(), "scale": d}
    start = 4 if qtype == "Q4_1" else 2
    packed = torch.from_numpy(_llama_nibbles_to_ours(blocks[..., start:]).reshape(rows, cols // 2))
    minimum = _f16_field(blocks, 2) if qtype == "Q4_1" else -8 * d
    return "int4", {"qweight": packed, "scale": d, "minimum": minimum}


def q4k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of each Q4_K/Q5_K block's 12 scale bytes ``[B, 12]``
    (here, not in :mod:`.quant.kquants`, which imports this module)."""
    s = s.long()
    lo_sc, lo_m, mid = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo_sc & 63, (mid & 15) | ((lo_sc >> 6) << 4)], dim=1)
    m = torch.cat([lo_m & 63, (mid >> 4) | ((lo_m >> 6) << 4)], dim=1)
    return sc, m


def _k_block_tensors(blocks: np.ndarray, qtype: str, rows: int, cols: int
                     ) -> tuple[str, dict[str, torch.Tensor]]:
    """K-quant super-blocks ``[rows, cols / 256, size]`` (layouts: :mod:`.quant.kquants`) in the
    formats whose kernels exist, each weight exactly what ``gguf`` dequantizes.

    A sub-block's scale is ``d * sc`` (fp16 times a 6-bit, or for Q6_K a signed 8-bit, integer):
    up to 18 significant bits, which fp16 (11) cannot hold and float32 (24) holds exactly; so
    are ``dmin * m``, and a code times the scale (at most 23 bits). ``gguf`` computes
    ``(d * sc) * q - dmin * m`` in float32, rounding once at the subtraction; the layers compute
    ``q * scale + minimum`` with ``minimum = -(dmin * m)``, the same single rounding. Hence:

    - Q4_K: int4 in groups of 32 (a sub-block) with ``scale = d * sc`` and
      ``minimum = -dmin * m``, float32 each: Q4_1's layout with wider scales, on the int4 kernel.
    - Q5_K: codes 0..31 have no 5-bit kernel; as ``int8g`` codes in groups of 32 with the same
      scale and minimum (the int8 kernel per group, plus the group sums of ``x`` times the
      minimum).
    - Q6_K: codes ``q - 32`` (-32..31) as ``int8g`` in groups of 16 (its sub-blocks) with
      ``scale = d * sc``; no minimum.
    """
    nb = cols // 256
    b = blocks.reshape(rows * nb, -1)
    if qtype == "Q6_K":
        ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
        low = np.concatenate([ql & 15, ql >> 4], axis=2)  # [B, 2 halves, 128]
        high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
        codes = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
        sc = torch.from_numpy(b[:, 192:208].copy().view(np.int8)).float()  # [B, 16]
        scale = _f16_field(b, 208).float()[:, None] * sc
        return "int8g", {"qweight": _group_major(codes, rows, 16),
                         "scale": scale.reshape(rows, nb * 16)}
    sc, m = q4k_scale_min(torch.from_numpy(b[:, 4:16].copy()))  # [B, 8] each
    scale = (_f16_field(b, 0).float()[:, None] * sc.float()).reshape(rows, nb * 8)
    minimum = -(_f16_field(b, 2).float()[:, None] * m.float()).reshape(rows, nb * 8)
    if qtype == "Q4_K":
        packed = _llama_nibbles_to_ours(b[:, 16:].reshape(rows, nb * 4, 32))
        return "int4", {"qweight": torch.from_numpy(packed.reshape(rows, cols // 2)),
                        "scale": scale, "minimum": minimum}
    ql = b[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]  # [B, 4, 2, 32]
    high = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [B, 8, 32]
    codes = ((ql & 15).reshape(-1, 8, 32) | (high << 4)).astype(np.int8)
    return "int8g", {"qweight": _group_major(codes, rows, 32), "scale": scale,
                     "minimum": minimum}


def _group_major(codes: np.ndarray, rows: int, group: int) -> torch.Tensor:
    """Codes in row order re-laid as ``int8g`` stores them: ``[groups, rows, group]``."""
    return torch.from_numpy(codes.reshape(rows, -1, group)).permute(1, 0, 2).contiguous()


def _check_block_scales(t: dict[str, torch.Tensor], name: str, qtype: str, cols: int) -> None:
    """Raise :class:`QuantizationError` naming tensor ``name`` if a block's scale (or minimum)
    is NaN or infinite: a corrupt file, whose every product would be NaN."""
    for key in ("scale", "minimum"):
        v = t.get(key)
        if v is None or bool(torch.isfinite(v).all()):
            continue
        bad = ~torch.isfinite(v)
        row, group = (int(i) for i in bad.nonzero()[0])
        width = cols // v.shape[1]
        raise QuantizationError(
            f"{name}: {int(bad.sum())} {qtype} sub-block(s) with a NaN or infinite {key} (the "
            f"first at row {row}, columns {group * width}-{(group + 1) * width - 1}); the "
            "file's blocks are corrupt")


class ConcatLinear(nn.Module):
    """A fused projection (q/k/v, gate/up) whose GGUF pieces are in different formats: each run
    of pieces of one layout is its own :class:`QuantizedLinear`, and their outputs are
    concatenated. A Q4_K_M file has Q4_K q/k and, in some layers, a Q6_K v; this keeps each on
    its own kernel rather than widening q and k to v's format."""

    def __init__(self, parts: list[QuantizedLinear], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def weight_bytes(self) -> int:
        return sum(p.weight_bytes for p in self.parts) + (
            0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[out, in]`` weight: the parts' rows, in order."""
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias.to(y.dtype)


@torch.no_grad()
def keep_gguf_blocks(model: nn.Module, weights: Iterable[Weight]) -> nn.Module:
    """Replace the model's linears and embedding by a GGUF file's own blocks
    (:data:`GGUF_BLOCK_TYPES`).

    ``weights`` are the file's tensors (:meth:`~infer_lab.model.gguf.GGUFFile.weights`): each
    matrix's blocks, rows already in the model's order; the norms stay as they are in
    ``model``. Fused projections (q/k/v, gate/up) concatenate their pieces' rows when the pieces
    share a layout, else become a :class:`ConcatLinear`.
    """
    if getattr(model, "quantization", None):
        raise QuantizationError(f"the model is already quantized ({model.quantization})")
    pieces: dict[str, list[tuple[int, str, dict[str, torch.Tensor]]]] = {}
    label = "the file"
    for w in weights:
        if w.blocks is None or len(w.shape) != 2 or w.param is None:
            continue  # a norm: it stays in the model's dtype
        rows, cols = w.shape
        fmt, t = gguf_block_tensors(w.blocks(), w.type_name, rows, cols, f"{w.where}: {w.name}")
        pieces.setdefault(w.param.removesuffix(".weight"), []).append((w.part or 0, fmt, t))
        label = w.where
    for name, parts in sorted(pieces.items()):
        _set_block_layer(model, name, parts)
    left = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if left or not isinstance(model.embed_tokens, QuantizedEmbedding):
        raise QuantizationError(f"{label}: no GGUF blocks for {left or ['embed_tokens']}")
    model.quantization = "gguf"
    return model


def _layout(fmt: str, t: dict[str, torch.Tensor]) -> tuple[str, int, bool]:
    """What pieces must share to be one layer: format, groups per row, a minimum or not."""
    return fmt, t["scale"].shape[1], "minimum" in t


def _concat_runs(parts: list[tuple[str, dict[str, torch.Tensor]]]
                 ) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """Consecutive pieces of one layout joined (rows appended); scales of different dtypes
    (Q4_0's fp16, Q4_K's float32) are joined in the wider one, which holds both exactly."""
    runs: list[list[tuple[str, dict[str, torch.Tensor]]]] = []
    for p in parts:
        if runs and _layout(*runs[-1][0]) == _layout(*p):
            runs[-1].append(p)
        else:
            runs.append([p])
    out = []
    for run in runs:
        fmt = run[0][0]
        joined = {}
        for key in run[0][1]:
            ts = [t[key] for _, t in run]
            dtype = ts[0].dtype
            for x in ts[1:]:
                dtype = torch.promote_types(dtype, x.dtype)
            dim = 1 if key == "qweight" and fmt == "int8g" else 0
            joined[key] = torch.cat([x.to(dtype) for x in ts], dim=dim)
        out.append((fmt, joined))
    return out


def _block_linear(fmt: str, t: dict[str, torch.Tensor], k_in: int, device: torch.device,
                  bias: torch.Tensor | None = None) -> QuantizedLinear:
    """A :class:`QuantizedLinear` of re-laid blocks ``t`` (its group size from its scales)."""
    t = {k: v.to(device) for k, v in t.items()}
    rows, groups = t["scale"].shape
    return QuantizedLinear(fmt, t, k_in, rows, bias, k_in // groups)


def _set_block_layer(model: nn.Module, name: str,
                     parts: list[tuple[int, str, dict[str, torch.Tensor]]]) -> None:
    """Module ``name`` (a linear, or the embedding) becomes the concatenation of its pieces."""
    parts.sort(key=lambda p: p[0])
    runs = _concat_runs([(fmt, t) for _, fmt, t in parts])
    hidden = model.config.hidden_size
    if name == "embed_tokens":  # one GGUF tensor, never fused: one run
        layer = _block_linear(*runs[0], hidden, model.device)
        model.embed_tokens = QuantizedEmbedding(layer, model.dtype)
        if model.lm_head is None:
            model.lm_head = layer
        return
    old = model.get_submodule(name)
    bias = None if getattr(old, "bias", None) is None else old.bias.detach().clone()
    k_in = hidden if name == "lm_head" else old.in_features
    new: nn.Module
    if len(runs) == 1:
        new = _block_linear(*runs[0], k_in, model.device, bias)
    else:
        new = ConcatLinear([_block_linear(f, t, k_in, model.device) for f, t in runs], bias)
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def check_model_quantization(model: object, quantization: str | None) -> None:
    """The engine's check: a ``quantization`` option must match the model it is given."""
    check_quantization_name(quantization)
    if quantization is None:
        return
    have = getattr(model, "quantization", None)
    if have is None or have.split("-")[0] != quantization:
        raise QuantizationError(
            f"quantization={quantization!r} but the model is "
            + (f"quantized as {have}" if have else "not quantized")
            + ": load it with il.load(..., quantization=...) or il.LLM(path, quantization=...)")
