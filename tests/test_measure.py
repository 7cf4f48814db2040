"""FLOP and byte counts against what torch actually does; the named workloads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from infer_lab.cache.sizing import kv_bytes_per_token
from infer_lab.measure import long_tail_mix, nano_vllm_offline, step_bytes, step_flops
from infer_lab.measure.flops import arithmetic_intensity, attended_pairs
from infer_lab.measure.hardware import GPUS
from infer_lab.measure.workloads import arrival_times
from infer_lab.model.random import llama_config, random_model

CFG = llama_config(hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)


def counted_flops(batch: int, seq: int) -> int:
    model = random_model(CFG, "cpu")
    ids = torch.randint(0, CFG.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(ids, last_only=True)
    return counter.get_total_flops()


@pytest.mark.parametrize(("batch", "seq"), [(1, 1), (3, 1), (1, 33), (2, 64)])
def test_step_flops_match_torch_flop_counter(batch, seq):
    # torch's counter sees the projections and the LM head (exactly); on CPU it does not count
    # the fused attention kernel, so that term (causal pairs) is taken out of ours to compare.
    attn_per_pair = 4 * CFG.num_hidden_layers * CFG.num_attention_heads * CFG.head_dim * batch
    causal = attn_per_pair * attended_pairs(seq, 0)
    assert counted_flops(batch, seq) == step_flops(CFG, batch, seq, 0) - causal


def test_attended_pairs_is_a_causal_count():
    for new, ctx in [(1, 0), (1, 100), (7, 0), (7, 5)]:
        mask = torch.ones(new, ctx + new).tril(ctx)
        assert attended_pairs(new, ctx) == int(mask.sum())


def test_step_bytes_count_every_weight_once():
    model = random_model(CFG, "cpu")
    table = CFG.vocab_size * CFG.hidden_size * 4  # untied: the embedding table is not read whole
    weights = sum(p.numel() for p in model.parameters()) * 4 - table
    assert step_bytes(CFG, 1, 1, 0, dtype_bytes=4) == (
        weights + CFG.hidden_size * 4 + kv_bytes_per_token(CFG, 4)
    )
    # a decode step over a long context reads the whole cache
    extra = step_bytes(CFG, 8, 1, 1000, 4) - step_bytes(CFG, 8, 1, 0, 4)
    assert extra == 8 * 1000 * kv_bytes_per_token(CFG, 4)


def test_intensity_separates_decode_from_prefill():
    decode = arithmetic_intensity(CFG, 1, 1, 0, dtype_bytes=2)
    prefill = arithmetic_intensity(CFG, 1, 512, 0, dtype_bytes=2)
    assert 0.5 < decode < 2 < 100 < prefill
    for gpu in GPUS.values():  # decode at batch 1 is memory-bound on every GPU
        assert decode < gpu.ridge_point


def test_long_tail_mix_is_fixed_and_in_range():
    a, b = long_tail_mix(), long_tail_mix()
    assert a == b and len(a) == 128
    prompts = np.array([r.prompt_len for r in a])
    outputs = np.array([r.output_len for r in a])
    assert prompts.min() >= 8 and prompts.max() <= 512
    assert outputs.min() >= 12 and outputs.max() <= 256
    assert np.median(outputs) < outputs.mean()  # a long tail: the mean sits above the median
    assert all(r.arrival == 0 for r in a)
    assert long_tail_mix(seed=1) != a


def test_arrivals_have_the_stated_rate():
    t = arrival_times(20000, rate=4.0, rng=np.random.default_rng(0))
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    assert abs(len(t) / t[-1] - 4.0) < 0.1
    bursty = arrival_times(20000, rate=4.0, burstiness=0.25, rng=np.random.default_rng(0))
    assert np.diff(bursty).std() > 1.5 * np.diff(t).std()
    with pytest.raises(ValueError):
        arrival_times(10, rate=0)


def test_nano_vllm_offline_lengths():
    reqs = nano_vllm_offline(n=256)
    assert len(reqs) == 256
    assert all(100 <= r.prompt_len <= 1024 and 100 <= r.output_len <= 1024 for r in reqs)
