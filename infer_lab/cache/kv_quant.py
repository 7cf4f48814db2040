"""The KV cache in 8 bits (Chapter 8): int8 or FP8 with a scale per token and head, or bare FP8.

The KV cache is what runs out first (Chapters 2-3): at 16 bits a token of Llama-3-8B costs 128 KiB.
Storing K and V in one byte each halves that, so the same memory admits about twice the tokens.

- ``"int8"``: each cached vector (one token, one KV head: ``head_dim`` numbers) is stored as int8
  codes with its own fp16 scale ``max|x| / 127``; a token-and-head granularity follows outliers
  in individual tokens (attention sinks) without hurting the rest. Overhead: 2 bytes per
  ``head_dim`` bytes, 1.6 % at ``head_dim`` 128.
- ``"fp8_e4m3"``: the values themselves in torch's ``float8_e4m3fn`` (3 mantissa bits, range
  ±448, out-of-range values saturate), no scale. torch 2.13 can multiply fp8 on CPU (``@``,
  ``torch._scaled_mm``) but not add it; this package does not use that path: the attention
  path upcasts what it reads.
- ``"fp8_e4m3_scaled"`` (Chapter 8b): ``float8_e4m3fn`` codes of ``x / s`` with an fp16 scale
  ``s = max|x| / 448`` per token and head, like int8's. Without a scale, E4M3 has full relative
  precision only between 2^-6 and 448: smaller values fall into its subnormals (a value near
  0.003 keeps one significant bit) and larger ones saturate. The scale puts every vector's
  largest value at the top of the range; the overhead is int8's.

Both plug into the paged attention of :mod:`infer_lab.cache.paged` without changing it: an
fp8 cache is a plain :class:`PagedKVCache` of that dtype (the attention already casts what it
gathers to the query's dtype), and an int8 (or scaled fp8) cache hands out :class:`Int8Blocks`
per layer, which
index like the float block tensors they replace: writing through ``view(-1, H, D)[slots] = x``
quantizes, reading ``blocks[table]`` dequantizes. Those views serve the torch attention path;
the Triton attention kernels read 16-bit (or fp8) tensors, so an int8 cache runs its attention
on the torch path (see :func:`attention_backend_for`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch

from infer_lab.cache.paged import PagedKVCache
from infer_lab.model.config import ModelConfig

# The one list of KV cache dtypes (``EngineConfig`` imports it: the cache never imports the engine).
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e4m3_scaled")
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def kv_storage_bytes(cfg: ModelConfig, kv_cache_dtype: str, model_dtype_bytes: int = 2) -> float:
    """Bytes one token of one sequence costs in the cache, all layers, K and V, scales included."""
    per_vector = _per_vector_bytes(cfg.head_dim, kv_cache_dtype, model_dtype_bytes)
    return per_vector * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads


def _per_vector_bytes(head_dim: int, kv_cache_dtype: str, model_dtype_bytes: int) -> float:
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return head_dim * model_dtype_bytes
    if kv_cache_dtype in ("int8", "fp8_e4m3_scaled"):
        return head_dim + 2  # the codes and one fp16 scale
    return head_dim


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def quantize_kv_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D] -> (codes int8 [..., D], scale fp16 [...])``, ``x ≈ codes * scale``."""
    scale = (x.float().abs().amax(dim=-1) / 127.0).clamp(min=1e-8).half()
    codes = torch.round(x.float() / scale.float()[..., None]).clamp(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_kv_int8(codes: torch.Tensor, scale: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (codes.float() * scale.float()[..., None]).to(dtype)


def quantize_kv_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D] -> (codes float8_e4m3fn [..., D], scale fp16 [...])``, ``x ≈ codes * scale``.

    The codes are of ``x`` divided by the fp16-rounded scale (the value stored), saturated at
    448 (that rounding can push the largest value a hair past it)."""
    scale = (x.float().abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-8).half()
    y = (x.float() / scale.float()[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return y.to(torch.float8_e4m3fn), scale


def dequantize_kv_fp8(codes: torch.Tensor, scale: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (codes.float() * scale.float()[..., None]).to(dtype)


def fake_quant_kv(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """``x [..., D]`` as a cache of ``kv_cache_dtype`` would give it back (``"fp16"``: a 16-bit
    cache of an fp32 model), in ``x``'s dtype: for measuring what each KV format costs."""
    if kv_cache_dtype == "fp16":
        return x.half().to(x.dtype)
    if kv_cache_dtype == "fp8_e4m3":
        return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype)
    if kv_cache_dtype not in _CODECS:
        raise ValueError(f"fake_quant_kv takes fp16, fp8_e4m3 or one of {tuple(_CODECS)}, "
                         f"not {kv_cache_dtype!r}")
    quantize, dequantize = _CODECS[kv_cache_dtype]
    return dequantize(*quantize(x), x.dtype)


_CODECS = {"int8": (quantize_kv_int8, dequantize_kv_int8),
           "fp8_e4m3_scaled": (quantize_kv_fp8, dequantize_kv_fp8)}


class _Int8Slots:
    """``Int8Blocks.view(-1, H, D)``: the slot-indexed view that the KV store writes through."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, codec: str = "int8") -> None:
        self.codes, self.scales = codes, scales
        self.quantize, self.dequantize = _CODECS[codec]

    def __setitem__(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        c, s = self.quantize(x)
        self.codes[slots] = c
        self.scales[slots] = s

    def __getitem__(self, slots: torch.Tensor) -> torch.Tensor:
        return self.dequantize(self.codes[slots], self.scales[slots])


class Int8Blocks:
    """One layer's K (or V) blocks in int8 (or scaled fp8, ``codec``): ``[num_blocks,
    block_size, H, D]`` codes and ``[num_blocks, block_size, H]`` scales, indexed like the float
    tensor it stands for.

    ``dtype`` is the dtype reads come back in (the model's), so ``x.to(blocks.dtype)`` in the
    store is a no-op and the quantization happens in ``__setitem__``.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                 codec: str = "int8") -> None:
        self.codes, self.scales, self.dtype, self.codec = codes, scales, dtype, codec

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def view(self, *shape: int) -> _Int8Slots:
        if len(shape) != 3 or tuple(shape[1:]) != tuple(self.codes.shape[2:]):
            raise ValueError(f"an int8 KV block tensor views only as (-1, H, D), not {shape}")
        return _Int8Slots(self.codes.view(-1, *self.codes.shape[2:]),
                          self.scales.view(-1, self.scales.shape[-1]), self.codec)

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        return _CODECS[self.codec][1](self.codes[index], self.scales[index], self.dtype)

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Whole blocks (``dim`` 0) or slots, decoded: what attention's gather reads."""
        return _CODECS[self.codec][1](self.codes.index_select(dim, index),
                                      self.scales.index_select(dim, index), self.dtype)


class Int8PagedKVCache(PagedKVCache):
    """A paged cache whose K and V are int8 codes with an fp16 scale per token and head
    (``kv_cache_dtype="fp8_e4m3_scaled"``: float8_e4m3fn codes with the same scales)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = 16,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 kv_cache_dtype: str = "int8") -> None:
        if kv_cache_dtype not in _CODECS:
            raise ValueError(f"a scaled KV cache is one of {tuple(_CODECS)}, not "
                             f"{kv_cache_dtype!r}")
        codes = torch.int8 if kv_cache_dtype == "int8" else torch.float8_e4m3fn
        super().__init__(cfg, num_blocks, block_size, device, codes)
        shape = (cfg.num_hidden_layers, 2, num_blocks, block_size, cfg.num_key_value_heads)
        self.scales = torch.ones(shape, device=device, dtype=torch.float16)
        self.kv_cache_dtype, self.compute_dtype = kv_cache_dtype, dtype
        # Int8Blocks index like the tensors they stand for, on the torch attention path that
        # attention_backend_for picks for this cache: typed as those tensors
        layers = range(cfg.num_hidden_layers)
        self.k_caches = cast(list[torch.Tensor], [
            Int8Blocks(self.kv[i, 0], self.scales[i, 0], dtype, kv_cache_dtype) for i in layers])
        self.v_caches = cast(list[torch.Tensor], [
            Int8Blocks(self.kv[i, 1], self.scales[i, 1], dtype, kv_cache_dtype) for i in layers])

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.scales.numel() * self.scales.element_size()

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs:
            super().copy_blocks(pairs)
            src, dst = (torch.tensor(x, device=self.kv.device) for x in zip(*pairs, strict=True))
            self.scales[:, :, dst] = self.scales[:, :, src]

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        if src:
            super().copy_slots(src, dst)
            s, d = (torch.tensor(x, device=self.kv.device) for x in (src, dst))
            flat = self.scales.flatten(2, 3)
            flat[:, :, d] = flat[:, :, s]


def make_paged_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int = 16,
                        device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                        kv_cache_dtype: str = "auto") -> PagedKVCache:
    """The paged cache for ``kv_cache_dtype``: the model's dtype, int8 or fp8 + scales, or fp8."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype in _CODECS:
        return Int8PagedKVCache(cfg, num_blocks, block_size, device, dtype, kv_cache_dtype)
    cache = PagedKVCache(cfg, num_blocks, block_size, device,
                         torch.float8_e4m3fn if kv_cache_dtype == "fp8_e4m3" else dtype)
    cache.kv_cache_dtype = kv_cache_dtype
    return cache


def attention_backend_for(cache: PagedKVCache, backend: str | None) -> str | None:
    """The attention backend a cache can take: an int8 cache's block views need the torch path."""
    return "torch" if isinstance(cache, Int8PagedKVCache) else backend


class FakeQuantKVContext:
    """An attention context for the plain full-sequence forward that stores K and V as a
    ``kv_cache_dtype`` cache would (and reads them back) before attending: the quality cost of a
    KV format, measured without building a cache (Chapter 8b)."""

    logits_indices = None

    def __init__(self, kv_cache_dtype: str) -> None:
        fake_quant_kv(torch.zeros(1), kv_cache_dtype)  # refuse an unknown name now
        self.kv_cache_dtype = kv_cache_dtype

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None) -> torch.Tensor:
        from infer_lab.model.attention import causal_attention

        k, v = (fake_quant_kv(t, self.kv_cache_dtype) for t in (k, v))
        return causal_attention(q, k, v, window)


def with_kv_cache_dtype(model: torch.nn.Module, kv_cache_dtype: str
                        ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``ids [1, S] -> logits [1, S, vocab]`` of ``model`` with its K and V in that format."""
    ctx = FakeQuantKVContext(kv_cache_dtype)

    def logits(ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
        return model(ids, positions, ctx)

    return logits
