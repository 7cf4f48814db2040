"""Greedy outputs of the engine equal naive decode of each prompt alone, token for token.

Fifty-six prompts of varied lengths run together, under every mechanism that could corrupt a
sequence: plain continuous batching, a KV pool so small that sequences are preempted and
recomputed, a token budget so small that prompts are split into chunks, prefix caching on prompts
that share their beginnings, and the static baseline. The near-tie rule is the only allowance
(``assert_greedy_equal``: a differing token is accepted only where the top two logits were
within 1e-4). Every test ends with the pool full again.
"""

from __future__ import annotations

import pytest

import infer_lab as il
from infer_lab.model.generate import stream_naive
from tests.engine_fixtures import assert_matches_naive, assert_no_leak, tiny_model, varied_prompts

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model, tok = tiny_model(tmp_path_factory)
    prompts = varied_prompts(56)
    refs = [list(stream_naive(model, p, m, set())) for p, m in prompts]
    return model, tok, prompts, refs


def run(model, tok, prompts, **engine_kwargs):
    llm = il.LLM(model, tokenizer=tok, log_steps=True, **engine_kwargs)
    params = [il.SamplingParams(max_tokens=m, **GREEDY) for _, m in prompts]
    outs = llm.generate([p for p, _ in prompts], params, use_tqdm=False)
    assert_no_leak(llm.engine)
    return llm.engine, outs


def test_continuous_batch_equals_naive(setup):
    model, tok, prompts, refs = setup
    engine, outs = run(model, tok, prompts, max_num_seqs=64, enable_prefix_caching=False)
    assert_matches_naive(model, prompts, outs, refs)
    assert max(len(r.work) for r in engine.step_log) > 20  # really batched
    assert {o.finish_reason for o in outs} == {"length"}


def test_preemption_under_a_tiny_pool_keeps_outputs(setup):
    model, tok, prompts, refs = setup
    engine, outs = run(model, tok, prompts, num_kv_blocks=24, block_size=8,
                       enable_prefix_caching=False)
    assert engine.get_stats().num_preemptions > 0
    assert any(c.num_preemptions for o in outs for c in o.outputs)
    assert any(r.preempted for r in engine.step_log)
    assert_matches_naive(model, prompts, outs, refs)


def test_chunked_prefill_under_a_small_token_budget(setup):
    model, tok, prompts, refs = setup
    engine, outs = run(model, tok, prompts, max_num_batched_tokens=24,
                       enable_prefix_caching=False)
    assert all(r.num_tokens <= 24 for r in engine.step_log)
    mixed = [r for r in engine.step_log
             if {"prefill", "decode"} <= {kind for *_, kind in r.work}]
    assert mixed, "no step mixed a prefill chunk with decodes"
    chunked = {rid for r in engine.step_log for _, rid, n, kind in r.work if kind == "prefill"}
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i][0]))
    steps_of_longest = sum(1 for r in engine.step_log for _, rid, _, kind in r.work
                           if rid == outs[longest].request_id and kind == "prefill")
    assert chunked and steps_of_longest >= len(prompts[longest][0]) // 24
    assert_matches_naive(model, prompts, outs, refs)


def test_prefix_caching_reuses_blocks_and_keeps_outputs(setup):
    model, tok, _, _ = setup
    system = varied_prompts(1, seed=5)[0][0][:40] * 2  # 80 shared tokens
    prompts = [(system + p[:20], m) for p, m in varied_prompts(24, seed=6)]
    refs = [list(stream_naive(model, p, m, set())) for p, m in prompts]
    engine, outs = run(model, tok, prompts, block_size=8, max_num_seqs=8,
                       enable_prefix_caching=True)
    stats = engine.get_stats()
    assert stats.prefix_cache_hits >= 10 * 80  # most requests found the shared 80 tokens
    computed = sum(n for r in engine.step_log for _, _, n, kind in r.work if kind == "prefill")
    assert computed < sum(len(p) for p, _ in prompts) - 10 * 80
    assert_matches_naive(model, prompts, outs, refs)


def test_prefix_caching_with_preemption_and_chunking(setup):
    model, tok, prompts, refs = setup
    engine, outs = run(model, tok, prompts, num_kv_blocks=30, block_size=8,
                       max_num_batched_tokens=32, enable_prefix_caching=True)
    assert engine.get_stats().num_preemptions > 0
    assert_matches_naive(model, prompts, outs, refs)


def test_static_baseline_equals_naive_and_holds_its_batch(setup):
    model, tok, prompts, refs = setup
    engine, outs = run(model, tok, prompts[:20], policy="static", max_num_seqs=8)
    assert_matches_naive(model, prompts[:20], outs, refs[:20])
    kinds = {kind for r in engine.step_log for *_, kind in r.work}
    assert {"pad", "idle"} <= kinds  # padding to the longest prompt, slots held after finishing
    # a batch is formed only when the previous one is over: at most 8 distinct requests between
    # two steps with a prefill
    for r in engine.step_log:
        assert len({rid for _, rid, _, kind in r.work if kind != "idle"}) <= 8


def test_stop_token_ids_and_eos(setup):
    model, tok, prompts, refs = setup
    llm = il.LLM(model, tokenizer=tok)
    chosen = [(p, m, ref) for (p, m), ref in zip(prompts, refs) if len(ref) >= 6][:8]
    params = [il.SamplingParams(max_tokens=m, temperature=0.0, stop_token_ids=[ref[4]])
              for _, m, ref in chosen]
    outs = llm.generate([p for p, _, _ in chosen], params, use_tqdm=False)
    for out, (_, _, ref) in zip(outs, chosen):
        k = ref.index(ref[4])
        assert out.token_ids == ref[: k + 1]
        assert out.finish_reason == "stop" and out.outputs[0].stop_reason == ref[4]
    assert_no_leak(llm.engine)
