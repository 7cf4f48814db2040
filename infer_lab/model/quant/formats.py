"""Every weight format of Chapters 8 and 8b as one function ``(name, w) -> (decoded, bits)``.

The benchmark and the chapter compare formats through these: each returns the weight as the
format stores it, decoded to float32, and its bits per weight with scales, minimums and zeros
counted. K-quants need rows of 256: a tensor whose rows are not (SmolLM2's 576-wide inputs) gets
llama.cpp's fallback type, Q5_0 for Q4_K, Q5_1 for Q5_K and Q8_0 for Q6_K (encoded by
``gguf.quants``), as ``llama-quantize`` does.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from infer_lab.model.quant.fp8 import quantize_fp8
from infer_lab.model.quant.gptq import rtn_int4
from infer_lab.model.quant.kquants import BITS_PER_WEIGHT, QK_K, fake_quant_kquant
from infer_lab.model.quant.mx import quantize_mx, quantize_nvfp4
from infer_lab.model.quantize import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

Decoded = tuple[torch.Tensor, float]
KQUANT_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _fp8(fmt: str, granularity: str) -> Callable[[str, torch.Tensor], Decoded]:
    def fn(name: str, w: torch.Tensor) -> Decoded:
        t = quantize_fp8(w, fmt, granularity, name=name)
        return t.dequantize(name), t.bits_per_weight
    return fn


def _mx(fmt: str) -> Callable[[str, torch.Tensor], Decoded]:
    def fn(name: str, w: torch.Tensor) -> Decoded:
        t = quantize_mx(w, fmt, name)
        return t.dequantize(name), t.bits_per_weight
    return fn


def _nvfp4(name: str, w: torch.Tensor) -> Decoded:
    t = quantize_nvfp4(w, name)
    return t.dequantize(name), t.bits_per_weight


def _gguf_legacy(qtype: str, w: torch.Tensor) -> Decoded:
    from gguf import GGMLQuantizationType, quants

    t = GGMLQuantizationType[qtype]
    blocks = quants.quantize(w.numpy().astype(np.float32), t)
    back = torch.from_numpy(quants.dequantize(blocks, t).copy()).view(w.shape)
    return back, 8 * blocks.nbytes / w.numel()


def _kquant(qtype: str) -> Callable[[str, torch.Tensor], Decoded]:
    def fn(name: str, w: torch.Tensor) -> Decoded:
        if w.shape[1] % QK_K:
            return _gguf_legacy(KQUANT_FALLBACK[qtype], w)
        return fake_quant_kquant(w, qtype, name), BITS_PER_WEIGHT[qtype]
    return fn


def _int8(name: str, w: torch.Tensor) -> Decoded:
    q, s = quantize_int8(w)
    return dequantize_int8(q, s), 8 + 32 / w.shape[1]


def _int4_q41(name: str, w: torch.Tensor) -> Decoded:
    p, s, m = quantize_int4(w, 32)
    return dequantize_int4(p, s, m), 4 + 32 / 32


def _rtn(group: int) -> Callable[[str, torch.Tensor], Decoded]:
    def fn(name: str, w: torch.Tensor) -> Decoded:
        t = rtn_int4(w, group, name)
        return t.dequantize(name), t.bits_per_weight
    return fn


WEIGHT_FORMATS: dict[str, Callable[[str, torch.Tensor], Decoded]] = {
    "bf16": lambda name, w: (w.bfloat16().float(), 16.0),
    "fp8_e4m3 tensor": _fp8("fp8_e4m3", "tensor"),
    "fp8_e4m3 channel": _fp8("fp8_e4m3", "channel"),
    "fp8_e4m3 block128": _fp8("fp8_e4m3", "block"),
    "fp8_e5m2 channel": _fp8("fp8_e5m2", "channel"),
    "int8 channel": _int8,
    "mxfp8": _mx("mxfp8"),
    "Q6_K": _kquant("Q6_K"),
    "Q5_K": _kquant("Q5_K"),
    "Q4_K": _kquant("Q4_K"),
    "int4 g32 (Q4_1 grid)": _int4_q41,
    "int4 g128 RTN": _rtn(128),
    "int4 g32 RTN": _rtn(32),
    "nvfp4": _nvfp4,
    "mxfp4": _mx("mxfp4"),
}
