"""The 8-bit KV cache: int8 with a scale per token and head, and float8_e4m3fn, in the paged
cache and its attention; what it costs per token and how many more tokens fit."""

from __future__ import annotations

import pytest
import torch

from infer_lab.cache import build_paged_batch, paged_attention_ref
from infer_lab.cache.kv_quant import (
    Int8PagedKVCache,
    attention_backend_for,
    dequantize_kv_int8,
    kv_storage_bytes,
    make_paged_kv_cache,
    quantize_kv_int8,
)
from infer_lab.cache.paged import PagedAttentionContext
from infer_lab.model.random import llama_config, random_model

CFG = llama_config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def test_int8_kv_round_trip_within_half_a_step_per_vector():
    x = torch.randn(10, 2, 32) * torch.logspace(-2, 2, 10)[:, None, None]  # token outliers
    codes, scale = quantize_kv_int8(x)
    assert codes.dtype == torch.int8 and scale.shape == (10, 2) and scale.dtype == torch.float16
    err = (dequantize_kv_int8(codes, scale) - x).abs()
    # half a step of each vector's own scale, plus the fp16 rounding of that scale (2**-11)
    bound = scale.float()[..., None] * (0.5 + 127 * 2**-11) + 1e-7
    assert (err <= bound).all()


def test_bytes_per_token_and_capacity():
    # Llama-3-8B: 32 layers, 8 KV heads, head_dim 128
    cfg = llama_config(num_hidden_layers=32, num_key_value_heads=8, num_attention_heads=32,
                       hidden_size=4096)
    fp16 = kv_storage_bytes(cfg, "auto", 2)
    assert fp16 == 128 * 1024
    assert kv_storage_bytes(cfg, "fp8_e4m3") == fp16 / 2
    int8 = kv_storage_bytes(cfg, "int8")
    assert int8 == 32 * 2 * 8 * (128 + 2)
    assert fp16 / int8 >= 1.9  # the target: ~2x the tokens in the same memory
    cache = make_paged_kv_cache(CFG, 10, 16, kv_cache_dtype="int8")
    assert cache.nbytes == 10 * 16 * kv_storage_bytes(CFG, "int8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_storage_bytes(cfg, "int4")


def _fill_and_attend(cache, model_dtype=torch.float32):
    """Write K/V of two sequences through the paged store, then attend with the batched path."""
    torch.manual_seed(0)
    tables = [[0, 1, 2], [3, 4]]
    chunks = [(list(range(40)), 0, tables[0]), (list(range(20)), 0, tables[1])]
    batch = build_paged_batch(chunks, 16, cache.num_blocks)
    t = batch.num_tokens
    k = torch.randn(t, 2, 32, dtype=model_dtype)
    v = torch.randn(t, 2, 32, dtype=model_dtype)
    q = torch.randn(t, 4, 32, dtype=model_dtype)
    ctx = PagedAttentionContext(cache, batch, backend=attention_backend_for(cache, None))
    out = ctx.attend(0, q, k, v, None)
    return out, (q, k, v, batch)


@pytest.mark.parametrize("kv_dtype,tol", [("int8", 0.02), ("fp8_e4m3", 0.08)])
def test_8bit_cache_attention_close_to_16bit(kv_dtype, tol):
    full = make_paged_kv_cache(CFG, 6, 16)
    ref, (q, k, v, batch) = _fill_and_attend(full)
    cache = make_paged_kv_cache(CFG, 6, 16, kv_cache_dtype=kv_dtype)
    out, _ = _fill_and_attend(cache)
    # attention averages values: the error stays near one value's rounding (int8 ~0.4 % of the
    # vector's max; e4m3 keeps 3 mantissa bits, ~3 %)
    assert (out - ref).abs().max() <= tol * ref.abs().max(), (out - ref).abs().max()
    # and exactly what the reference attention makes of the dequantized cache
    kc = cache.k_caches[0][torch.arange(6)].to(torch.float32)
    vc = cache.v_caches[0][torch.arange(6)].to(torch.float32)
    exact = paged_attention_ref(q, kc, vc, batch.block_tables, batch.context_lens,
                                batch.cu_seqlens_q)
    torch.testing.assert_close(out, exact, atol=1e-5, rtol=1e-5)


def test_int8_cache_copy_blocks_copies_scales():
    cache = make_paged_kv_cache(CFG, 6, 16, kv_cache_dtype="int8")
    assert isinstance(cache, Int8PagedKVCache)
    _fill_and_attend(cache)
    before = cache.k_caches[1][torch.tensor([0])].clone()
    cache.copy_blocks([(0, 5)])
    torch.testing.assert_close(cache.k_caches[1][torch.tensor([5])], before, atol=0, rtol=0)
    with pytest.raises(ValueError, match="views only"):
        cache.k_caches[0].view(-1, 32)


def test_model_decodes_through_int8_cache_like_the_16bit_cache():
    model = random_model(CFG, device="cpu", dtype=torch.float32, seed=3, std=0.08)
    prompt = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = model(torch.tensor([prompt]))[0, -1]
    for kv in ("int8", "fp8_e4m3"):
        cache = make_paged_kv_cache(CFG, 4, 16, kv_cache_dtype=kv)
        batch = build_paged_batch([(prompt[:-5], 0, [0, 1])], 16, 4)
        model(batch.input_ids, batch.positions,
              PagedAttentionContext(cache, batch, backend=attention_backend_for(cache, None)))
        batch = build_paged_batch([(prompt[-5:], 25, [0, 1])], 16, 4)
        out = model(batch.input_ids, batch.positions,
                    PagedAttentionContext(cache, batch, backend=attention_backend_for(cache, None)))
        rel = ((out[-1] - ref).pow(2).mean().sqrt() / ref.std()).item()
        assert rel <= (0.02 if kv == "int8" else 0.1), (kv, rel)
