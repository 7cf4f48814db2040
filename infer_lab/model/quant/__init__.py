"""The quantization formats production uses, bit-exact (Chapter 8b).

Chapter 8's :mod:`infer_lab.model.quantize` stores weights in the engine's int8/int4 and keeps a
GGUF file's Q4_0/Q4_1/Q8_0 blocks. This package holds the formats a reader meets elsewhere, each an
encoder and a decoder that follow the format's specification bit for bit (its rounding, its
saturation, its scale encoding), so that they can be checked against independent references
(torch's float8 dtypes, the ``gguf`` package's quantizers and dequantizers):

- :mod:`.minifloat`: FP8 E4M3 / E5M2, FP4 E2M1 and the E8M0 scale as codes;
- :mod:`.fp8`: FP8 weights and activations with per-tensor, per-channel and 128x128 block scales;
- :mod:`.mx`: the OCP microscaling formats MXFP8 and MXFP4, and NVIDIA's NVFP4;
- :mod:`.kquants`: llama.cpp's Q4_K, Q5_K and Q6_K super-blocks;
- :mod:`.gptq` and :mod:`.awq`: calibrated int4 (error feedback; activation-aware scales);
- :mod:`.gptq_checkpoint`, :mod:`.awq_checkpoint` and :mod:`.prequantized`: GPTQ and AWQ
  checkpoints (``quantization_config``) read by ``il.load`` into the engine's int4.

Bad input (a zero or infinite scale, NaN weights, a block that does not divide a row, an MX
exponent out of range) raises :class:`FormatError` naming the tensor.
"""

from infer_lab.model.quantize import QuantizationError


class FormatError(QuantizationError):
    """A tensor that cannot be encoded, or codes and scales that do not decode, in a format."""


__all__ = ["FormatError"]
