"""The production quantization formats (Chapter 8b), each against an independent reference:
torch's float8 dtypes for FP8 and E8M0, ``gguf.quants``' MXFP4 quantizer and its NVFP4, Q4_K and
Q6_K dequantizers; K-quant encoders by round trip and their error bound; bad input refused with
the tensor's name. Plus the FP8 KV cache with scales."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf import quants as gq

from infer_lab.cache.kv_quant import (
    Int8PagedKVCache,
    dequantize_kv_fp8,
    kv_storage_bytes,
    make_paged_kv_cache,
    quantize_kv_fp8,
)
from infer_lab.model.quant import FormatError
from infer_lab.model.quant.fp8 import FP8Tensor, dequantize_fp8, quantize_fp8
from infer_lab.model.quant.kquants import (
    BLOCK_BYTES,
    CODECS,
    dequantize_q4_k,
    dequantize_q6_k,
    q4k_scale_min,
    quantize_q4_k,
)
from infer_lab.model.quant.minifloat import E2M1, E4M3, E5M2, e8m0_decode, e8m0_encode
from infer_lab.model.quant.mx import (
    dequantize_mx,
    mxfp4_to_ggml,
    nvfp4_to_ggml,
    quantize_mx,
    quantize_nvfp4,
)
from infer_lab.model.random import llama_config

GEN = torch.Generator().manual_seed(0)


def spread(n: int, k: int) -> torch.Tensor:
    """Rows of very different magnitude (1e-4 .. 1e2), plus a few outliers."""
    w = torch.randn(n, k, generator=GEN) * torch.logspace(-4, 2, n)[:, None]
    w[0, 3] = 40 * w[0].abs().max()
    return w


# ------------------------------------------------------------------ minifloats
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_fp8_codes_decode_like_torch(fmt):
    codes = torch.arange(256, dtype=torch.uint8)
    ref = codes.view(fmt.torch_dtype).float()
    mine = fmt.decode(codes)
    assert torch.equal(torch.isnan(ref), torch.isnan(mine))
    assert torch.equal(ref.nan_to_num(0.0), mine.nan_to_num(0.0))


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_fp8_encode_is_torchs_round_to_nearest_even_with_saturation(fmt):
    grid = fmt.decode(torch.arange(256, dtype=torch.uint8))
    grid = grid[torch.isfinite(grid)].sort().values
    midpoints = (grid[1:] + grid[:-1]) / 2  # exact ties: to the even mantissa
    x = torch.cat([torch.randn(50_000, generator=GEN) * torch.logspace(-12, 6, 50_000),
                   grid, midpoints, torch.tensor([1e9, -1e9, 0.0, -0.0])])
    ref = x.clamp(-fmt.max_finite, fmt.max_finite).to(fmt.torch_dtype).view(torch.uint8)
    assert torch.equal(fmt.encode(x), ref)
    assert fmt.encode(torch.tensor([1e9]))[0] == fmt.encode(torch.tensor([fmt.max_finite]))[0]


def test_e2m1_grid_and_ties_to_even():
    assert E2M1.values().tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    # ggml's table of E2M1 values (doubled) is an independent statement of the same grid
    assert (2 * E2M1.decode(torch.arange(16, dtype=torch.uint8))).tolist() == list(
        gq.MXFP4.kvalues)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.75])
    assert E2M1.round(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -1.0]


def test_e8m0_against_torch_and_its_range():
    codes = torch.arange(255, dtype=torch.uint8)
    ref = codes.view(torch.float8_e8m0fnu).float()
    assert torch.equal(e8m0_decode(codes), ref)
    assert torch.equal(e8m0_encode(torch.arange(-127, 128)), codes)
    with pytest.raises(FormatError, match=r"w\.scale.*0xFF"):
        e8m0_decode(torch.tensor([255], dtype=torch.uint8), "w.scale")
    with pytest.raises(FormatError, match="out of E8M0's range"):
        e8m0_encode(torch.tensor([128]))


# ------------------------------------------------------------------ FP8 with scales
def _torch_fp8(w, scale_full, dtype, top):
    return (w / scale_full).clamp(-top, top).to(dtype).float() * scale_full


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_weights_match_torch_cast_at_every_granularity(fmt, granularity):
    f = E4M3 if fmt == "fp8_e4m3" else E5M2
    w = spread(300, 200)  # neither divisible by 128: edge tiles are partial
    t = quantize_fp8(w, fmt, granularity)
    if granularity == "tensor":
        assert t.scale.shape == () and t.scale == w.abs().max() / f.max_finite
        full = t.scale.expand(w.shape)
    elif granularity == "channel":
        assert t.scale.shape == (300,)
        full = t.scale[:, None].expand(w.shape)
    else:
        assert t.scale.shape == (3, 2)
        full = torch.empty_like(w)
        for i in range(3):
            for j in range(2):
                tile = (slice(128 * i, 128 * i + 128), slice(128 * j, 128 * j + 128))
                assert t.scale[i, j] == w[tile].abs().max() / f.max_finite
                full[tile] = t.scale[i, j]
    assert torch.equal(t.dequantize(), _torch_fp8(w, full, f.torch_dtype, f.max_finite))
    assert t.bits_per_weight == 8 + 32 * t.scale.numel() / w.numel()


def test_finer_fp8_scales_keep_small_rows():
    w = spread(256, 256)
    err = {g: ((quantize_fp8(w, "fp8_e4m3", g).dequantize() - w).norm(dim=1) / w.norm(dim=1))
           for g in ("tensor", "channel")}
    # the smallest rows underflow a per-tensor scale; a per-channel one keeps them
    assert err["tensor"][:8].mean() > 10 * err["channel"][:8].mean()
    assert err["channel"].max() < 0.05


def test_fp8_activations_per_token():
    x = torch.randn(5, 64, generator=GEN) * torch.tensor([1e-3, 1, 10, 100, 1e4])[:, None]
    t = quantize_fp8(x, "fp8_e4m3", "channel", name="act")
    rel = (t.dequantize() - x).abs() / x.abs().amax(1, keepdim=True)
    assert rel.max() <= 2**-4  # half a step at the top binade: 1/16 of the row's max


# ------------------------------------------------------------------ MX and NVFP4
def test_mxfp4_bytes_equal_gguf_quantizer():
    w = spread(64, 256)
    t = quantize_mx(w, "mxfp4")
    ref = gq.quantize(w.numpy(), GT.MXFP4).reshape(-1, 17)
    assert np.array_equal(mxfp4_to_ggml(t).numpy(), ref)
    back = gq.dequantize(ref.reshape(64, -1), GT.MXFP4)
    assert np.array_equal(back, t.dequantize().numpy())
    assert t.bits_per_weight == 4.25


def test_mxfp8_matches_torch_e4m3_cast_with_power_of_two_scales():
    w = spread(16, 128)
    t = quantize_mx(w, "mxfp8")
    amax = w.view(16, 4, 32).abs().amax(-1)
    exp = torch.floor(torch.log2(amax)) - 8  # the OCP spec's shared exponent, E4M3's emax 8
    assert torch.equal(t.scale.long(), (exp + 127).long())
    scale = torch.exp2(exp).repeat_interleave(32, 1)
    ref = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    assert torch.equal(dequantize_mx(t), ref)
    assert t.bits_per_weight == 8.25


def test_nvfp4_decodes_like_gguf_and_beats_mxfp4():
    w = spread(32, 128)
    t = quantize_nvfp4(w)
    assert t.tensor_scale == w.abs().max() / (448 * 6)
    # gguf's NVFP4 (ggml) has no tensor scale: its values are ours divided by it
    g = gq.dequantize(nvfp4_to_ggml(t).numpy().reshape(32, -1), GT.NVFP4)
    assert np.array_equal(g * t.tensor_scale.item(), t.dequantize().numpy())
    # each block's scale is the E4M3 rounding of amax / 6 / tensor scale
    want = E4M3.encode(w.view(32, -1, 16).abs().amax(-1) / 6 / t.tensor_scale)
    assert torch.equal(t.block_scale, want)
    x = torch.randn(64, 256, generator=GEN)
    e_nv = (quantize_nvfp4(x).dequantize() - x).norm()
    e_mx = (quantize_mx(x, "mxfp4").dequantize() - x).norm()
    assert e_nv < e_mx  # finer blocks and a non-power-of-two scale: closer, for 0.25 more bits


# ------------------------------------------------------------------ K-quants
ENCODERS = {t: enc for t, (enc, _) in CODECS.items()}
DECODERS = {t: dec for t, (_, dec) in CODECS.items()}


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_kquant_decoders_match_gguf_on_arbitrary_blocks(qtype):
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(24, BLOCK_BYTES[qtype]), dtype=np.uint8)
    d = np.float16(rng.random((24, 2)) * 0.01).view(np.uint8)
    if qtype == "Q6_K":
        raw[:, 208:210] = d[:, :2]
    else:
        raw[:, 0:4] = d
    ref = gq.dequantize(raw, GT[qtype]).reshape(-1)
    assert np.array_equal(DECODERS[qtype](raw).numpy(), ref)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_kquant_encoders_round_trip_within_half_a_step(qtype):
    w = spread(12, 512) + 0.05
    enc, dec = ENCODERS[qtype], DECODERS[qtype]
    blocks = enc(w)
    assert blocks.shape == (12 * 2, BLOCK_BYTES[qtype]) and blocks.dtype == torch.uint8
    back = torch.from_numpy(gq.dequantize(blocks.numpy().reshape(12, -1), GT[qtype]))
    assert torch.equal(dec(blocks).view(12, 512), back)  # gguf reads our bytes as we do
    b = blocks.long()
    if qtype == "Q6_K":
        d = b[:, 208:210].to(torch.uint8).contiguous().view(torch.float16).float()
        sc = b[:, 192:208].to(torch.uint8).view(torch.int8).float()
        step = (d * sc).repeat_interleave(16, 1)
    else:
        d = b[:, 0:2].to(torch.uint8).contiguous().view(torch.float16).float()
        sc, _ = q4k_scale_min(b[:, 4:16])
        step = (d * sc).repeat_interleave(32, 1)
    err = (back.view(-1, 256) - w.view(-1, 256)).abs()
    assert (err <= step / 2 * (1 + 1e-4) + 1e-12).all()
    # the error ordering of the three: each extra bit of code is closer
    errs = {t: (DECODERS[t](ENCODERS[t](w)).view(12, 512) - w).norm() for t in ENCODERS}
    assert errs["Q4_K"] > errs["Q5_K"] > errs["Q6_K"]
    if qtype == "Q5_K":  # the fifth bit is really used: codes above 15 in every block
        assert (b[:, 16:48] != 0).any(1).all()


def test_q4k_scale_bytes_round_trip_every_6_bit_value():
    w = torch.zeros(1, 256)
    blocks = quantize_q4_k(w)
    assert torch.equal(dequantize_q4_k(blocks), w.view(-1))  # zeros stay exact
    sc = torch.arange(64).view(8, 8)
    m = 63 - sc
    packed = torch.cat([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
                        (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
                        (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], 1)
    got_sc, got_m = q4k_scale_min(packed)
    assert torch.equal(got_sc, sc) and torch.equal(got_m, m)


# ------------------------------------------------------------------ bad input
def test_bad_input_names_the_tensor():
    w = torch.randn(4, 64)
    nan = w.clone()
    nan[1, 2] = float("nan")
    for fn in (lambda x: quantize_fp8(x, name="layers.3.mlp"),
               lambda x: quantize_mx(x, "mxfp4", name="layers.3.mlp"),
               lambda x: quantize_nvfp4(x, name="layers.3.mlp")):
        with pytest.raises(FormatError, match=r"layers\.3\.mlp.*NaN"):
            fn(nan)
    with pytest.raises(FormatError, match=r"layers\.0\.o.*do not divide.*48"):
        quantize_mx(torch.randn(2, 48), name="layers.0.o")
    with pytest.raises(FormatError, match=r"down.*Q4_K blocks of 256 do not divide"):
        quantize_q4_k(torch.randn(2, 576), name="down")
    t = quantize_fp8(w, granularity="channel")
    for bad in (0.0, float("inf"), float("nan")):
        s = t.scale.clone()
        s[1] = bad
        with pytest.raises(FormatError, match="lm_head scale.*finite and positive"):
            dequantize_fp8(FP8Tensor(t.codes, s, t.fmt, t.granularity), "lm_head")
    tiny = torch.full((1, 32), 1e-39)  # subnormal fp32: an MX exponent below -127
    with pytest.raises(FormatError, match=r"emb.*out of E8M0's range"):
        quantize_mx(tiny, "mxfp4", name="emb")
    with pytest.raises(FormatError, match="not whole Q6_K blocks"):
        dequantize_q6_k(np.zeros(100, np.uint8), "w")


# ------------------------------------------------------------------ FP8 KV with scales
CFG = llama_config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def test_scaled_fp8_kv_keeps_small_and_large_vectors():
    x = torch.randn(6, 2, 32, generator=GEN) * torch.tensor(
        [1e-4, 1e-2, 1, 10, 300, 3000])[:, None, None]
    codes, scale = quantize_kv_fp8(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float16
    scaled = dequantize_kv_fp8(codes, scale)
    bare = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    rel = lambda y: ((y - x).norm(dim=(1, 2)) / x.norm(dim=(1, 2)))  # noqa: E731
    assert rel(scaled).max() < 0.05  # every vector within E4M3's 3 mantissa bits
    assert rel(bare)[0] > 0.2 and rel(bare)[5] > 0.5  # underflow and saturation without one
    assert kv_storage_bytes(CFG, "fp8_e4m3_scaled") == kv_storage_bytes(CFG, "int8")


def test_scaled_fp8_kv_cache_stores_and_copies_through_the_paged_view():
    cache = make_paged_kv_cache(CFG, 4, 16, kv_cache_dtype="fp8_e4m3_scaled")
    assert isinstance(cache, Int8PagedKVCache) and cache.kv.dtype == torch.float8_e4m3fn
    x = torch.randn(20, 2, 32, generator=GEN) * 1e-3
    slots = torch.arange(20)
    cache.k_caches[0].view(-1, 2, 32)[slots] = x
    got = cache.k_caches[0][torch.tensor([0, 1])].reshape(-1, 2, 32)[:20]
    assert ((got - x).norm() / x.norm()) < 0.05
    cache.copy_blocks([(0, 3)])
    assert torch.equal(cache.k_caches[0][torch.tensor([3])], cache.k_caches[0][torch.tensor([0])])
    assert cache.nbytes == 4 * 16 * kv_storage_bytes(CFG, "fp8_e4m3_scaled")


def test_model_decodes_through_the_scaled_fp8_cache():
    from infer_lab.cache import build_paged_batch
    from infer_lab.cache.kv_quant import attention_backend_for
    from infer_lab.cache.paged import PagedAttentionContext
    from infer_lab.model.random import random_model

    model = random_model(CFG, device="cpu", dtype=torch.float32, seed=3, std=0.08)
    prompt = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = model(torch.tensor([prompt]))[0, -1]
    cache = make_paged_kv_cache(CFG, 4, 16, kv_cache_dtype="fp8_e4m3_scaled")
    for chunk, start in ((prompt[:-5], 0), (prompt[-5:], 25)):
        batch = build_paged_batch([(chunk, start, [0, 1])], 16, 4)
        out = model(batch.input_ids, batch.positions,
                    PagedAttentionContext(cache, batch, backend=attention_backend_for(cache, None)))
    rel = ((out[-1] - ref).pow(2).mean().sqrt() / ref.std()).item()
    assert rel <= 0.1, rel


def test_fake_quant_kv_is_what_the_cache_gives_back():
    from infer_lab.cache.kv_quant import fake_quant_kv, with_kv_cache_dtype
    from infer_lab.model.random import random_model

    x = torch.randn(3, 2, 32, generator=GEN) * 1e-3
    cache = make_paged_kv_cache(CFG, 1, 16, kv_cache_dtype="fp8_e4m3_scaled")
    cache.k_caches[0].view(-1, 2, 32)[torch.arange(3)] = x
    stored = cache.k_caches[0][torch.tensor([0])].reshape(-1, 2, 32)[:3]
    assert torch.equal(fake_quant_kv(x, "fp8_e4m3_scaled"), stored)
    model = random_model(CFG, device="cpu", dtype=torch.float32, seed=3, std=0.08)
    ids = torch.randint(0, 256, (1, 20), generator=GEN)
    # a 16-bit cache of an fp32 model barely moves the logits; bare fp8 of small K/V does
    full = model(ids)
    d16 = (with_kv_cache_dtype(model, "fp16")(ids) - full).abs().max()
    d8 = (with_kv_cache_dtype(model, "fp8_e4m3")(ids) - full).abs().max()
    assert 0 < d16 < d8
    with pytest.raises(ValueError, match="fake_quant_kv"):
        with_kv_cache_dtype(model, "int4")
