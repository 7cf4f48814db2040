"""One bad request must never hurt another: validation at the edges of what the engine can
represent, per-request failure inside a step, and stop strings that cost what they must."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import infer_lab as il
from infer_lab.engine import LLMEngine, Sampler, SamplingParams
from infer_lab.engine.sampling_params import MAX_STOP_STRING_LEN, MAX_STOP_STRINGS
from infer_lab.engine.stop import StopMatcher
from infer_lab.model.generate import stream_naive
from tests.engine_fixtures import assert_matches_naive, assert_no_leak, tiny_model, varied_prompts

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_tok(tmp_path_factory):
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def six(model_tok):
    """Six ordinary greedy requests and their naive references."""
    model, _ = model_tok
    prompts = varied_prompts(6, seed=21)
    refs = [list(stream_naive(model, p, m, set())) for p, m in prompts]
    return prompts, refs


def drain(engine: LLMEngine) -> dict[str, il.RequestOutput]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


class Exploding:
    """A detokenizer that breaks on its third token (what a tokenizer bug would look like)."""

    def __init__(self) -> None:
        self.calls = 0

    def add(self, token: int) -> str:
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("the detokenizer broke")
        return "x"

    def flush(self) -> str:
        return ""


def add_ok(engine: LLMEngine, prompts, first: int = 0) -> None:
    for i, (p, m) in enumerate(prompts, start=first):
        engine.add_request(f"ok{i}", p, il.SamplingParams(max_tokens=m, **GREEDY))


def test_hostile_requests_fail_alone_and_the_six_finish_as_if_alone(model_tok, six):
    model, tok = model_tok
    prompts, refs = six
    engine = LLMEngine(model, tok, max_num_seqs=16)
    add_ok(engine, prompts[:3])
    # values at the edges of int64/float32 that used to overflow or emit garbage: now valid
    edge = il.SamplingParams(max_tokens=20, temperature=1.0, top_k=2**63, seed=2**63 - 1,
                             ignore_eos=True)
    engine.add_request("edge", prompts[0][0], edge)
    # a request whose params were corrupted after validation: its sampling raises
    corrupt = il.SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True)
    engine.add_request("corrupt", prompts[1][0], corrupt)
    corrupt.temperature = "hot"
    # a request whose detokenizer breaks mid-stream
    engine.add_request("explode", prompts[2][0], il.SamplingParams(max_tokens=20, **GREEDY))
    engine.requests["explode"].seqs[0].detokenizer = Exploding()
    first = {o.request_id: o for o in engine.step() if o.finished}
    add_ok(engine, prompts[3:], first=3)  # three more arrive mid-stream
    done = first | drain(engine)

    assert_matches_naive(model, prompts, [done[f"ok{i}"] for i in range(6)], refs)
    assert all(done[f"ok{i}"].error is None for i in range(6))
    assert done["edge"].finish_reason == "length" and len(done["edge"].token_ids) == 20
    for rid, stage in (("corrupt", "sampling"), ("explode", "its new token")):
        out = done[rid]
        assert out.finished and out.finish_reason == "error" and stage in out.error, out.error
    assert "detokenizer broke" in done["explode"].error
    assert len(done["explode"].token_ids) <= 2  # only what was handed out before the failure
    assert engine.get_stats().num_failed_requests == 2
    assert_no_leak(engine)


def test_a_failure_in_a_static_batch_fails_that_request_alone(model_tok, six):
    model, tok = model_tok
    prompts, refs = six
    engine = LLMEngine(model, tok, policy="static", max_num_seqs=8)
    add_ok(engine, prompts)
    engine.add_request("explode", [5, 6, 7], il.SamplingParams(max_tokens=10, **GREEDY))
    engine.requests["explode"].seqs[0].detokenizer = Exploding()
    done = drain(engine)
    assert_matches_naive(model, prompts, [done[f"ok{i}"] for i in range(6)], refs)
    assert done["explode"].finish_reason == "error"
    assert_no_leak(engine)


@pytest.mark.parametrize("kw", [dict(temperature=1e-40), dict(temperature=1e-46),
                                dict(temperature=1.0, top_p=1e-46),
                                dict(temperature=1.0, top_p=1e-40),
                                dict(temperature=2.0, top_k=1, top_p=1e-30)])
def test_degenerate_sampling_values_are_greedy_not_garbage(model_tok, six, kw):
    model, tok = model_tok
    prompts, refs = six
    llm = il.LLM(model, tokenizer=tok)
    params = [il.SamplingParams(max_tokens=m, ignore_eos=True, seed=i, **kw)
              for i, (_, m) in enumerate(prompts)]
    outs = llm.generate([p for p, _ in prompts], params, use_tqdm=False)
    assert_matches_naive(model, prompts, outs, refs)


def test_sampler_never_drops_every_token():
    logits = torch.tensor([[0.0, 5.0, 1.0, -2.0]])
    for kw in (dict(top_p=1e-46), dict(top_p=1e-40), dict(top_k=2**70), dict(top_k=10**30)):
        p = SamplingParams(temperature=1.0, seed=0, **kw)
        g = torch.Generator().manual_seed(0)
        tokens = {Sampler()(logits, [p], [g])[0] for _ in range(50)}
        if "top_p" in kw:
            assert tokens == {1}
        else:
            assert tokens <= {0, 1, 2, 3} and 1 in tokens


@pytest.mark.parametrize("kw", [
    dict(seed=2**63), dict(seed=-1), dict(seed=2**80), dict(top_k=-3), dict(temperature=1e5),
    dict(temperature=float("inf")), dict(top_p=float("nan")), dict(presence_penalty=2.5),
    dict(frequency_penalty=-2.01), dict(repetition_penalty=0.0), dict(repetition_penalty=1e-40),
    dict(repetition_penalty=float("nan")), dict(logprobs=21), dict(logprobs=-1),
    dict(logprobs=True), dict(stop_token_ids=[2**64]), dict(stop_token_ids="abc"),
    dict(ignore_eos="no"), dict(stop=["x" * (MAX_STOP_STRING_LEN + 1)]), dict(stop=b"\n"),
    dict(stop_token_ids=list(range(2000))),
])
def test_values_the_engine_cannot_represent_are_refused(kw):
    with pytest.raises((ValueError, TypeError)):
        SamplingParams(**kw)


def test_a_hundred_thousand_stop_strings_are_refused_clearly():
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRINGS} stop strings"):
        SamplingParams(stop=[f"s{i}" for i in range(100_000)])
    assert len(SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)]).stop_strings) == (
        MAX_STOP_STRINGS)


def brute_force(text: str, searched: int, stops: list[str]) -> tuple[int, str] | None:
    """Every occurrence of every stop string that ends at or after ``searched``."""
    hits = [(i, s) for s in stops for i in range(len(text) - len(s) + 1)
            if text.startswith(s, i) and i + len(s) > searched]
    return min(hits) if hits else None


@settings(max_examples=200, deadline=None, database=None)
@given(stops=st.lists(st.text("abc", min_size=1, max_size=5), min_size=1, max_size=8),
       text=st.text("abcd", max_size=30), data=st.data())
def test_stop_matcher_finds_what_a_brute_force_search_finds(stops, text, data):
    searched = data.draw(st.integers(0, len(text)))
    assert StopMatcher(stops).find(text, searched) == brute_force(text, searched, stops)


def test_matching_hundreds_of_stop_strings_costs_per_new_character():
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz "
    stops = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 12))) + "#"
             for _ in range(300)]  # "#" never occurs: no stop ever matches
    text = "".join(rng.choice(letters) for _ in range(20_000))
    matcher = StopMatcher(stops)
    for end in range(3, len(text) + 1, 3):  # 3 new characters per step
        assert matcher.find(text[:end], end - 3) is None
    # A scan of the text (or of each stop string) per step would cost len(text) * 300 / 3 or
    # more; this looks at each new character once and no further (no stop ends in a letter).
    assert matcher.work == 0
    ending = [s[:-1] + "e" for s in stops]  # now every stop ends in a common letter
    matcher = StopMatcher(ending)
    for end in range(3, len(text) + 1, 3):
        hit = matcher.find(text[:end], end - 3)
        if hit is not None:
            assert brute_force(text[:end], end - 3, ending) == hit
            break
    checked = end
    assert matcher.work <= 2 * checked, (matcher.work, checked)


def test_engine_stop_strings_among_hundreds_trim_like_one(model_tok):
    model, tok = model_tok
    prompt = "The quick brown fox"
    full = il.LLM(model, tokenizer=tok).generate(
        prompt, il.SamplingParams(max_tokens=30, **GREEDY), use_tqdm=False)[0]
    stop = full.text[10:14]
    assert stop and stop not in full.text[:13]
    noise = [f"zq{i}@" for i in range(400)]
    engine = LLMEngine(model, tok)
    engine.add_request("s", prompt, il.SamplingParams(max_tokens=30, stop=noise + [stop],
                                                      **GREEDY))
    matcher = engine.requests["s"].stop_matcher
    out = drain(engine)["s"]
    assert out.text == full.text[: full.text.index(stop)] and out.outputs[0].stop_reason == stop
    assert matcher.work <= 2 * len(full.text)  # not 401 strings searched per step
    assert_no_leak(engine)
