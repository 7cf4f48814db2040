"""Prompt log-probabilities in the engine (issue 29): equal to ``log_softmax`` of one naive full
forward of the prompt within 1e-4 (fp32), whatever the chunking, with prefix caching on (the
request recomputes its prompt rather than read the cache), beside requests that did not ask
(their outputs unchanged), and with every KV block back afterwards."""

from __future__ import annotations

import pytest
import torch

import infer_lab as il
from infer_lab.engine import LLMEngine, SamplingParams
from tests.engine_fixtures import assert_no_leak, tiny_model, varied_prompts

TOL = 1e-4


@pytest.fixture(scope="module")
def model_tok(tmp_path_factory):
    return tiny_model(tmp_path_factory)


def drain(engine: LLMEngine) -> dict[str, il.RequestOutput]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def reference(model, prompt: list[int]) -> torch.Tensor:
    """log-softmax of one full forward: row p is the distribution of token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt]))[0].float(), dim=-1)


def check(out: il.RequestOutput, model, prompt: list[int], k: int) -> None:
    ref = reference(model, prompt)
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    for p in range(1, len(prompt)):
        e = lps[p]
        assert e.token_id == prompt[p]
        assert abs(e.logprob - float(ref[p - 1, prompt[p]])) < TOL
        want_lp, want_ids = ref[p - 1].topk(k)
        assert len(e.top) == k
        assert [i for i, _ in e.top] == want_ids.tolist() or torch.allclose(
            torch.tensor([lp for _, lp in e.top]), want_lp, atol=TOL)  # ties may swap ids
        assert all(abs(lp - float(ref[p - 1, i])) < TOL for i, lp in e.top)


@pytest.mark.parametrize("budget", [2048, 16, 7])  # whole prompts, chunks, odd chunks
def test_prompt_logprobs_match_the_naive_forward(model_tok, budget):
    model, tok = model_tok
    engine = LLMEngine(model, tok, max_num_batched_tokens=budget, max_num_seqs=8)
    prompts = [p for p, _ in varied_prompts(6, seed=11) if len(p) > 1]
    plain = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{i}", prompt, SamplingParams(max_tokens=3, temperature=0,
                                                           ignore_eos=True,
                                                           prompt_logprobs=i % 3))
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=3, temperature=0,
                                                           ignore_eos=True))
    done = drain(engine)
    for i, prompt in enumerate(prompts):
        check(done[f"s{i}"], model, prompt, i % 3)
        plain[i] = done[f"p{i}"]
        assert plain[i].prompt_logprobs is None
        assert done[f"s{i}"].token_ids == plain[i].token_ids  # the sampled tokens: unchanged
    assert_no_leak(engine)


def test_prefix_cached_prompt_is_recomputed_not_missing(model_tok):
    model, tok = model_tok
    engine = LLMEngine(model, tok, enable_prefix_caching=True, block_size=4)
    prompt = varied_prompts(20, seed=2)[-1][0] * 2
    prompt = prompt[:60] if len(prompt) > 60 else prompt + list(range(3, 40))
    engine.add_request("warm", prompt, SamplingParams(max_tokens=1))
    drain(engine)
    hits = engine.kv.prefix_hits
    engine.add_request("again", prompt, SamplingParams(max_tokens=1))
    drain(engine)
    assert engine.kv.prefix_hits > hits  # the cache holds this prompt
    hits = engine.kv.prefix_hits
    engine.add_request("scored", prompt, SamplingParams(max_tokens=1, prompt_logprobs=2))
    out = drain(engine)["scored"]
    assert engine.kv.prefix_hits == hits  # not read: recomputed
    check(out, model, prompt, 2)
    assert_no_leak(engine)


def test_preempted_request_keeps_its_prompt_logprobs(model_tok):
    model, tok = model_tok
    engine = LLMEngine(model, tok, num_kv_blocks=12, block_size=4, max_num_seqs=4,
                       max_num_batched_tokens=16)
    prompts = [list(range(5 + i, 25 + i)) for i in range(4)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12, temperature=0,
                                                           ignore_eos=True, prompt_logprobs=1))
    done = drain(engine)
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        check(done[f"r{i}"], model, prompt, 1)
    assert_no_leak(engine)


def test_bad_prompt_logprobs_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(TypeError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=1.5)
