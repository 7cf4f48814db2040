"""The rest of the sampling API (issue 29): min_p, logit_bias, stop_token_ids, min_tokens.

Each is checked against a reference written independently: transformers' ``MinPLogitsWarper``
for min-p, ``argmax(logits + bias)`` (OpenAI's definition) for the bias, and a naive greedy loop
over full forwards that masks the stop tokens itself for ``min_tokens``. A batch mixing rows with
and without each setting shows the rows without are untouched.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper

import infer_lab as il
from infer_lab.engine import LLMEngine, Sampler, SamplingParams
from infer_lab.engine.sampler import apply_penalties, sampling_probs
from tests.engine_fixtures import assert_no_leak, tiny_model, varied_prompts


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


def naive_greedy(model, prompt: list[int], steps: int, ban=lambda i: ()) -> list[int]:
    """Greedy over full forwards; ``ban(i)`` are the ids masked at output position ``i``."""
    ids = list(prompt)
    for i in range(steps):
        with torch.inference_mode():
            logits = model(torch.tensor([ids]))[0, -1].float()
        logits = logits.clone()
        for t in ban(i):
            logits[t] = float("-inf")
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


# -- min_p ----------------------------------------------------------------------------------
@pytest.mark.parametrize("min_p", [0.02, 0.1, 0.5, 1.0])
def test_min_p_matches_transformers_warper(min_p):
    torch.manual_seed(0)
    logits = torch.randn(3, 200) * 3
    temp = 0.7
    params = [SamplingParams(temperature=temp, min_p=min_p)] * 3
    ours = sampling_probs(logits, params)
    warped = MinPLogitsWarper(min_p)(None, logits / temp)
    assert torch.allclose(ours, torch.softmax(warped, -1), atol=1e-6)


def test_min_p_costs_only_its_rows():
    torch.manual_seed(1)
    logits = torch.randn(4, 100) * 2
    plain = [SamplingParams(temperature=1.0, top_k=10), SamplingParams(temperature=0.5)]
    mixed = [plain[0], SamplingParams(temperature=1.0, min_p=0.3), plain[1],
             SamplingParams(temperature=2.0, min_p=0.05)]
    probs = sampling_probs(logits, mixed)
    alone = sampling_probs(logits[[0, 2]], plain)
    assert torch.equal(probs[[0, 2]], alone)
    kept = probs[1] > 0
    p1 = torch.softmax(logits[1], -1)
    assert torch.equal(kept, p1 >= 0.3 * p1.max())


def test_min_p_samples_stay_in_the_kept_set():
    torch.manual_seed(2)
    logits = torch.randn(1, 60) * 2
    p = torch.softmax(logits[0], -1)
    allowed = set((p >= 0.2 * p.max()).nonzero().flatten().tolist())
    g = torch.Generator().manual_seed(0)
    sampler = Sampler(g)
    seen = {sampler(logits, [SamplingParams(temperature=1.0, min_p=0.2)], [None])[0]
            for _ in range(300)}
    assert seen <= allowed and len(seen) > 1


# -- logit_bias -----------------------------------------------------------------------------
def test_logit_bias_is_added_to_the_raw_logits():
    torch.manual_seed(3)
    logits = torch.randn(3, 50)
    bias = {4: 100.0, 7: -3.5, 9: 2.0}
    params = [SamplingParams(temperature=0, logit_bias=bias), SamplingParams(temperature=0),
              SamplingParams(temperature=0, logit_bias={1: -100.0})]
    out = apply_penalties(logits, params, [[]] * 3, [[]] * 3)
    ref = logits.clone()
    for t, b in bias.items():
        ref[0, t] += b
    ref[2, 1] -= 100
    assert torch.equal(out, ref)
    # +100 forces a token, -100 bans the argmax; the unbiased row is greedy as before
    tokens = Sampler()(logits, params, [None] * 3, [[]] * 3, [[]] * 3)
    banned = logits[2].clone()
    banned[1] -= 100
    assert tokens == [4, int(logits[1].argmax()), int(banned.argmax())]


def test_logit_bias_bans_the_greedy_token_in_the_engine(model_tok):
    model, tok = model_tok
    prompt = varied_prompts(1, seed=5)[0][0]
    ref = naive_greedy(model, prompt, 6)
    engine = LLMEngine(model, tok)
    ban = {ref[0]: -100.0}
    engine.add_request("b", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                   logit_bias=ban))
    engine.add_request("p", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    done = drain(engine)
    assert done["p"].token_ids == ref
    biased = naive_greedy(model, prompt, 6, ban=lambda i: (ref[0],))
    assert done["b"].token_ids == biased and ref[0] not in biased
    assert_no_leak(engine)


@pytest.mark.parametrize("bias", [{"5": 1.0}, {-1: 1.0}, {5: 101.0}, {5: float("nan")},
                                  {True: 1.0}])
def test_bad_logit_bias_is_refused(bias):
    with pytest.raises((TypeError, ValueError), match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_logit_bias_outside_the_vocabulary_is_refused_and_frees_nothing(model_tok):
    model, tok = model_tok
    engine = LLMEngine(model, tok)
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("x", [5, 6], SamplingParams(logit_bias={vocab: 1.0}))
    assert_no_leak(engine)


# -- stop_token_ids and min_tokens ----------------------------------------------------------
def test_stop_token_ids_end_the_output(model_tok):
    model, tok = model_tok
    prompt = varied_prompts(1, seed=7)[0][0]
    ref = naive_greedy(model, prompt, 8)
    engine = LLMEngine(model, tok)
    stop = ref[3]
    engine.add_request("s", prompt, SamplingParams(max_tokens=8, temperature=0,
                                                   ignore_eos=True, stop_token_ids=[stop]))
    out = drain(engine)["s"]
    first = ref.index(stop)
    assert out.token_ids == ref[: first + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert_no_leak(engine)


def test_min_tokens_holds_back_stop_tokens_like_the_naive_loop(model_tok):
    model, tok = model_tok
    prompt = varied_prompts(1, seed=7)[0][0]
    ref = naive_greedy(model, prompt, 8)
    stop = ref[1]
    engine = LLMEngine(model, tok)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[stop],
                            min_tokens=5)
    engine.add_request("m", prompt, params)
    engine.add_request("p", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                   stop_token_ids=[stop]))
    done = drain(engine)
    assert done["p"].token_ids == ref[: ref.index(stop) + 1]  # the row without: unchanged
    want = naive_greedy(model, prompt, 8, ban=lambda i: (stop,) if i < 5 else ())
    cut = next((i for i, t in enumerate(want) if t == stop), len(want) - 1)
    assert done["m"].token_ids == want[: cut + 1]
    assert len(done["m"].token_ids) >= 5
    assert_no_leak(engine)


def test_min_tokens_holds_back_stop_strings(model_tok):
    model, tok = model_tok
    prompt = varied_prompts(1, seed=9)[0][0]
    engine = LLMEngine(model, tok)
    engine.add_request("r", prompt, SamplingParams(max_tokens=10, temperature=0,
                                                   ignore_eos=True))
    full = drain(engine)["r"]
    first_token_text = tok.decode(full.token_ids[:1])
    stop = first_token_text.strip()[:1] or first_token_text[:1]
    assert stop
    engine.add_request("early", prompt, SamplingParams(max_tokens=10, temperature=0,
                                                       ignore_eos=True, stop=[stop]))
    engine.add_request("late", prompt, SamplingParams(max_tokens=10, temperature=0,
                                                      ignore_eos=True, stop=[stop],
                                                      min_tokens=10))
    done = drain(engine)
    assert len(done["early"].token_ids) == 1 and done["early"].finish_reason == "stop"
    assert done["late"].token_ids == full.token_ids  # min_tokens == max_tokens: no stop
    assert_no_leak(engine)


@pytest.mark.parametrize(("kw", "field"), [({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
                                           ({"min_tokens": -1}, "min_tokens"),
                                           ({"min_p": 1.5}, "min_p"),
                                           ({"min_p": -0.1}, "min_p")])
def test_out_of_range_values_are_refused_by_name(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)
