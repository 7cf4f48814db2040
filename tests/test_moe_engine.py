"""Mixture-of-experts models through the engine: greedy outputs equal naive decode of each
prompt alone, token for token (near-tie rule), under continuous batching, preemption in a tiny
KV pool, chunked prefill, prefix caching, speculative decoding and structured output.

The model signature is the seam (``model(input_ids, positions, ctx)``): the sparse MLP flattens
whatever batch it is given, so nothing in the engine knows the model is sparse. The routing of a
token depends only on its own hidden state, so batching cannot change it, up to floating-point
rounding, which the near-tie rule allows for.
"""

from __future__ import annotations

import re

import pytest

import infer_lab as il
from infer_lab.engine import LLMEngine, SamplingParams
from infer_lab.engine.structured import StructuredOutputsParams
from infer_lab.model.generate import stream_naive
from tests.engine_fixtures import assert_matches_naive, assert_no_leak, varied_prompts
from tests.moe_helpers import make_moe_checkpoint

GREEDY = dict(temperature=0.0, ignore_eos=True)


def load_family(tmp_path_factory, family):
    path = tmp_path_factory.mktemp(f"engine-{family}")
    make_moe_checkpoint(path, family, max_position_embeddings=256)
    return il.load(path, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    """The family with the most moving parts: shared expert, dense and sparse layers, biases."""
    model, tok = load_family(tmp_path_factory, "qwen2_moe")
    prompts = varied_prompts(24, seed=3)
    refs = [list(stream_naive(model, p, m, set())) for p, m in prompts]
    return model, tok, prompts, refs


def run(model, tok, prompts, **engine_kwargs):
    llm = il.LLM(model, tokenizer=tok, log_steps=True, **engine_kwargs)
    params = [il.SamplingParams(max_tokens=m, **GREEDY) for _, m in prompts]
    outs = llm.generate([p for p, _ in prompts], params, use_tqdm=False)
    assert_no_leak(llm.engine)
    return llm.engine, outs


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_continuous_batch_equals_naive(tmp_path_factory, family):
    model, tok = load_family(tmp_path_factory, family)
    prompts = varied_prompts(12, seed=1)
    refs = [list(stream_naive(model, p, m, set())) for p, m in prompts]
    engine, outs = run(model, tok, prompts, max_num_seqs=16, enable_prefix_caching=False)
    assert max(len(r.work) for r in engine.step_log) > 6  # really batched
    assert_matches_naive(model, prompts, outs, refs)


def test_paged_batching_preemption_and_chunking(qwen2_moe):
    model, tok, prompts, refs = qwen2_moe
    engine, outs = run(model, tok, prompts, num_kv_blocks=20, block_size=8,
                       max_num_batched_tokens=24, enable_prefix_caching=False)
    assert engine.get_stats().num_preemptions > 0
    assert all(r.num_tokens <= 24 for r in engine.step_log)
    assert any({"prefill", "decode"} <= {kind for *_, kind in r.work} for r in engine.step_log)
    assert_matches_naive(model, prompts, outs, refs)


def test_prefix_caching_in_a_small_pool(qwen2_moe):
    model, tok, _, _ = qwen2_moe
    system = varied_prompts(1, seed=5)[0][0][:40] * 2  # 80 shared tokens
    prompts = [(system + p[:16], m) for p, m in varied_prompts(12, seed=6)]
    refs = [list(stream_naive(model, p, m, set())) for p, m in prompts]
    engine, outs = run(model, tok, prompts, block_size=8, max_num_seqs=4, num_kv_blocks=48,
                       enable_prefix_caching=True)
    assert engine.get_stats().prefix_cache_hits >= 5 * 80
    assert_matches_naive(model, prompts, outs, refs)


def test_speculative_decoding_keeps_greedy_output(qwen2_moe):
    """The model drafts for itself: every step verifies 3 guesses in one forward of 4 tokens
    per sequence, which the sparse MLP sees as one more flat batch."""
    model, tok, prompts, refs = qwen2_moe
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    engine = LLMEngine(model, tok, speculative_config=spec, num_kv_blocks=64, block_size=8)
    for i, (p, m) in enumerate(prompts[:6]):
        engine.add_request(str(i), p, SamplingParams(max_tokens=m, **GREEDY))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    outs = [done[str(i)] for i in range(6)]
    assert_matches_naive(model, prompts[:6], outs, refs[:6])
    stats = engine.get_stats()
    assert stats.spec_num_accepted_tokens > 0.9 * stats.spec_num_draft_tokens > 0


def test_structured_output_validates(qwen2_moe):
    model, tok, _, _ = qwen2_moe
    engine = LLMEngine(model, tok)
    params = {
        "re": SamplingParams(max_tokens=20, temperature=0.7, seed=1,
                             structured_outputs=StructuredOutputsParams(regex=r"\d{3}-\d{4}")),
        "ch": SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(
            choice=["yea", "nay", "selah"])),
    }
    for rid, p in params.items():
        engine.add_request(rid, "In the beginning", p)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    assert re.fullmatch(r"\d{3}-\d{4}", done["re"].text) and done["re"].finish_reason == "stop"
    assert done["ch"].text in ("yea", "nay", "selah")
