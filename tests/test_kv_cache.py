"""The KV cache of Chapter 2: its size formula, the contiguous cache, memory planning."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import infer_lab as il
from infer_lab.cache import (
    PUBLISHED,
    ContiguousAttentionContext,
    ContiguousKVCache,
    kv_bytes_per_token,
    kv_cache_bytes,
    plan_memory,
)
from infer_lab.cache.published import FALCON_7B, LLAMA_3_8B, LLAMA_3_70B, attention_kind
from infer_lab.model.baselines import generate_cached
from tests.helpers import assert_greedy_equal, make_checkpoint

# ---------------------------------------------------------------------------------------- sizing


def test_kv_cache_bytes_is_the_product_formula():
    assert kv_cache_bytes(3, 5, 7, 11, 13, 4) == 2 * 3 * 5 * 7 * 11 * 13 * 4
    assert kv_cache_bytes(1, 1, 1, 1, 1) == 4  # a key and a value, 2 bytes each by default


def test_llama3_8b_example_is_32_gib():
    assert kv_cache_bytes(32, 8, 128, 8192, 32) / 2**30 == 32.0
    assert kv_bytes_per_token(LLAMA_3_8B) == 131072  # 128 KiB per token in fp16


@pytest.mark.parametrize("arg", range(6))
@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_kv_cache_bytes_rejects_non_positive_or_fractional(arg, bad):
    args = [32, 8, 128, 8192, 32, 2]
    args[arg] = bad
    with pytest.raises(ValueError):
        kv_cache_bytes(*args)


# ------------------------------------------------------------------------------ published models

PUBLISHED_PARAMS = {
    "Llama-2-7B": (6.74e9, "MHA"),
    "Llama-3-8B": (8.03e9, "GQA"),
    "Mistral-7B-v0.1": (7.24e9, "GQA"),
    "Qwen2.5-7B": (7.62e9, "GQA"),
    "Falcon-7B": (6.92e9, "MQA"),  # the name says 7B; its weights count 6.92 B
    "Llama-3-70B": (70.6e9, "GQA"),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_published_parameter_counts_and_attention_kinds(name):
    params, kind = PUBLISHED_PARAMS[name]
    cfg, attention = PUBLISHED[name]
    assert abs(cfg.num_parameters() / params - 1) < 0.02
    assert attention == kind == attention_kind(cfg)


def test_attention_kind_sets_the_cache_size():
    # Same layers and head_dim: MHA keeps 4x the cache of 8-KV-head GQA, MQA 1/8 of it per head dim.
    assert kv_bytes_per_token(PUBLISHED["Llama-2-7B"].config) == 4 * 131072
    assert kv_bytes_per_token(PUBLISHED["Mistral-7B-v0.1"].config) == 131072
    assert kv_bytes_per_token(FALCON_7B) == 2 * 32 * 1 * 64 * 2
    assert kv_bytes_per_token(LLAMA_3_70B) == 2 * 80 * 8 * 128 * 2
    assert PUBLISHED["Mistral-7B-v0.1"].config.window(0) == 4096


# ---------------------------------------------------------------------------------------- planner


def test_plan_llama3_8b_fp16_on_80_gib():
    plan = plan_memory(80 * 2**30, LLAMA_3_8B, 2, 2, reserve_fraction=0.1)
    assert plan.weight_bytes == 16_060_522_496  # 8_030_261_248 parameters x 2 bytes
    assert plan.reserve_bytes == 8_589_934_592  # 8 GiB
    assert plan.kv_budget_bytes == 85_899_345_920 - 8_589_934_592 - 16_060_522_496
    assert plan.max_tokens == 467_291  # 61_248_888_832 // 131_072
    assert plan.max_batch(8192) == 57
    assert plan.max_context(32) == 14_602
    assert plan.num_blocks(16) == 29_205


def test_plan_with_reserve_bytes_and_fp8_cache():
    plan = plan_memory(80 * 10**9, LLAMA_3_8B, 2, 1, reserve_bytes=8 * 2**30)
    assert plan.kv_bytes_per_token == 65536
    assert plan.max_tokens == (80 * 10**9 - 8 * 2**30 - 16_060_522_496) // 65536


def test_plan_raises_when_weights_do_not_fit():
    with pytest.raises(ValueError, match="do not fit"):
        plan_memory(80 * 2**30, LLAMA_3_70B, 2, 2)  # 141 GB of fp16 weights
    four_bit = plan_memory(80 * 2**30, LLAMA_3_70B, 0.5, 2)  # 35 GB of 4-bit weights fit
    assert four_bit.max_tokens > 0
    for bad in (dict(reserve_fraction=1.0), dict(reserve_fraction=-0.1), dict(reserve_bytes=-1)):
        with pytest.raises(ValueError):
            plan_memory(80 * 2**30, LLAMA_3_8B, **bad)
    with pytest.raises(ValueError):
        plan_memory(80 * 2**30, LLAMA_3_8B).max_batch(0)


# ------------------------------------------------------------------------------ contiguous cache

PROMPTS = [
    "In the beginning was the word",
    "Prefill",
    [5, 17, 200, 31, 9, 44, 120, 3, 88, 61, 250, 12, 77],  # token ids, the longest prompt
    "The quick brown fox",
]



def logits_after(model, prompt_ids):
    """``logits_at`` for :func:`assert_greedy_equal`: the plain no-cache forward."""
    return lambda prefix: model(torch.tensor([prompt_ids + prefix]), last_only=True)[0, -1]


@pytest.fixture(scope="module", params=["llama3", "mistral_window", "qwen3"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(path, request.param)
    return il.load(path)


def test_cache_reserves_the_formula(model):
    m, _ = model
    cfg = m.config
    cache = ContiguousKVCache(cfg, batch=3, max_len=40)
    assert cache.k[0].shape == (3, 40, cfg.num_key_value_heads, cfg.head_dim)
    assert cache.nbytes == kv_cache_bytes(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 40, 3, dtype_bytes=4
    )


def test_generate_cached_equals_naive(model):
    m, tok = model
    # 20 new tokens after prompts of 2-13 tokens: every sequence goes past mistral's window of 8.
    outs = generate_cached(m, tok, PROMPTS, max_tokens=20, ignore_eos=True)
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = il.generate_naive(m, tok, prompt, max_tokens=20, ignore_eos=True)
        assert out.prompt_token_ids == ref.prompt_token_ids
        assert len(out.token_ids) == 20 and out.finish_reason == "length"
        assert_greedy_equal(out.token_ids, ref.token_ids, logits_after(m, ref.prompt_token_ids))
        assert out.text == tok.decode(out.token_ids)


def test_generate_cached_stops_each_sequence_like_naive(model):
    # Sequences finish at different steps; each must stop where naive stops. To make a stop
    # certain with random weights, one token that prompt 0 produces is declared an EOS token.
    m, tok = model
    eos = il.generate_naive(m, tok, PROMPTS[0], max_tokens=6, ignore_eos=True).token_ids[-1]
    saved = m.config
    m.config = dataclasses.replace(saved, eos_token_id=[2, eos])
    try:
        outs = generate_cached(m, tok, PROMPTS, max_tokens=12)
        refs = [il.generate_naive(m, tok, p, max_tokens=12) for p in PROMPTS]
    finally:
        m.config = saved
    for out, ref in zip(outs, refs, strict=True):
        assert_greedy_equal(out.token_ids, ref.token_ids, logits_after(m, ref.prompt_token_ids))
        if out.token_ids == ref.token_ids:
            assert out.finish_reason == ref.finish_reason
    assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) <= 6
    assert "length" in {o.finish_reason for o in outs}


def test_contiguous_context_rejects_steps_past_the_cache(model):
    m, _ = model
    cache = ContiguousKVCache(m.config, batch=2, max_len=8)
    with pytest.raises(ValueError, match="past the cache"):
        ContiguousAttentionContext(cache, torch.tensor([3, 6]), q_len=3)


def test_generate_cached_bad_arguments(model):
    m, tok = model
    with pytest.raises(ValueError):
        generate_cached(m, tok, [], max_tokens=4)
    with pytest.raises(ValueError):
        generate_cached(m, tok, ["hi"], max_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        generate_cached(m, tok, ["hi", []], max_tokens=4)
