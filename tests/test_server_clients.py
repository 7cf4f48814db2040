"""What real clients send (issue 29), over HTTP through the official ``openai`` client: the rest
of the sampling API (min_p, logit_bias, stop_token_ids, min_tokens).

Every answer is checked against an independent reference (a naive greedy loop over full
forwards of the bundled model), every bad value is a 400 naming its field, and after each bad
request every KV block is back in the pool.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

import infer_lab as il
from infer_lab.serve.server import make_app
from tests.live_server import metric, running, wait_for

PROMPT = "In the beginning God created"
MODEL = "tiny-kjv"
TOL = 1e-4  # prompt log-probabilities vs one full fp32 forward


@pytest.fixture(scope="module")
def bundled():
    return il.load(device="cpu")


@pytest.fixture(scope="module")
def app():
    return make_app(None, device="cpu", num_kv_blocks=256, max_num_seqs=16)


@pytest.fixture(scope="module")
def server(app):
    with running(app) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=120)


def no_blocks_held(server: str) -> bool:
    return wait_for(lambda: metric(server, "kv_cache_blocks_used") == 0, 30)


def naive(bundled, prompt_ids: list[int], steps: int, ban=lambda i: ()) -> list[int]:
    """Greedy over full forwards; ``ban(i)``: token ids masked at output position ``i``."""
    model, _ = bundled
    ids = list(prompt_ids)
    for i in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0, -1].float().clone()
        for t in ban(i):
            logits[t] = float("-inf")
        ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]


def prompt_ids(bundled, text: str = PROMPT) -> list[int]:
    return bundled[1].encode(text)


# -- (a) the sampling API ---------------------------------------------------------------------
def test_logit_bias_bans_and_forces_tokens(client, bundled):
    ids = prompt_ids(bundled)
    ref = naive(bundled, ids, 6)
    banned = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        logit_bias={str(ref[0]): -100})
    got = [int(t.split(":")[1]) for t in banned.choices[0].logprobs.tokens]
    assert got == naive(bundled, ids, 6, ban=lambda i: (ref[0],))
    forced = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.8, seed=1, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        logit_bias={"42": 100})
    assert forced.choices[0].logprobs.tokens == ["token_id:42"] * 4


def test_min_p_one_is_greedy(client, bundled):
    ref = bundled[1].decode(naive(bundled, prompt_ids(bundled), 8))
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.5,
                                    seed=3, extra_body={"min_p": 1.0, "ignore_eos": True})
    assert out.choices[0].text == ref  # only the most likely token survives min_p = 1


def test_stop_token_ids_and_min_tokens(client, bundled):
    ids = prompt_ids(bundled)
    ref = naive(bundled, ids, 10)
    stop = ref[1]
    extra = {"ignore_eos": True, "stop_token_ids": [stop], "return_tokens_as_token_ids": True}
    early = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                      logprobs=0, extra_body=extra)
    assert early.choices[0].finish_reason == "stop"
    assert [int(t.split(":")[1]) for t in early.choices[0].logprobs.tokens] == ref[
        : ref.index(stop) + 1]
    late = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                     logprobs=0, extra_body={**extra, "min_tokens": 6})
    want = naive(bundled, ids, 10, ban=lambda i: (stop,) if i < 6 else ())
    cut = want.index(stop) + 1 if stop in want else len(want)
    got = [int(t.split(":")[1]) for t in late.choices[0].logprobs.tokens]
    assert got == want[:cut] and len(got) >= 6


@pytest.mark.parametrize(("extra", "field"), [
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": {"3072": 1}}, "logit_bias"),  # the bundled vocabulary is 3072
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 2}, "min_p"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_bad_sampling_values_are_400_naming_the_field(server, extra, field):
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in error["message"], error
    assert error["param"] == field, error
    assert no_blocks_held(server)
    ok = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200


# -- (b) prompts as token ids, and batches ----------------------------------------------------
def test_token_id_prompts_and_batches(client, bundled):
    ids = prompt_ids(bundled)
    other = prompt_ids(bundled, "And the earth was")
    ref = [bundled[1].decode(naive(bundled, p, 5)) for p in (ids, other)]
    one = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert one.choices[0].text == ref[0]
    batch = client.completions.create(model=MODEL, prompt=[ids, other], max_tokens=5,
                                      temperature=0, n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [ref[0], ref[0], ref[1], ref[1]]
    assert batch.usage.prompt_tokens == len(ids) + len(other)
    assert batch.usage.completion_tokens == 4 * 5
    texts = client.completions.create(model=MODEL, prompt=[PROMPT, "And the earth was"],
                                      max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in texts.choices] == ref


def test_a_batch_of_prompts_streams(client, server, bundled):
    """As OpenAI and vLLM stream a batch: each chunk's choice carries its index (prompt i's
    are i * n ...), the usage of all prompts comes in a last chunk, one [DONE] ends it."""
    prompts = [prompt_ids(bundled), prompt_ids(bundled, "And the earth was")]
    ref = [bundled[1].decode(naive(bundled, p, 5)) for p in prompts]
    texts, reasons, offsets = {}, {}, {}
    usage = []
    for chunk in client.completions.create(
            model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2, stream=True,
            logprobs=1, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}):
        assert not usage, "the usage chunk is the last"
        if chunk.usage is not None:
            assert not chunk.choices
            usage.append(chunk.usage)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
            offsets.setdefault(c.index, []).extend(c.logprobs.text_offset)
    assert texts == {0: ref[0], 1: ref[0], 2: ref[1], 3: ref[1]}
    assert reasons == dict.fromkeys(range(4), "length")
    for i, starts in offsets.items():  # each choice's own text offsets, from 0
        assert starts[0] == 0 and starts == sorted(starts) and len(starts) == 5, (i, starts)
    [u] = usage
    assert u.prompt_tokens == sum(map(len, prompts)) and u.completion_tokens == 4 * 5
    with httpx.stream("POST", f"{server}/v1/completions", timeout=120, json={
            "prompt": [PROMPT, "And the earth was"], "max_tokens": 3, "stream": True,
            "temperature": 0, "ignore_eos": True}) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines.count("[DONE]") == 1 and lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert sorted(c["choices"][0]["index"] for c in chunks) == [0, 0, 0, 1, 1, 1]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert no_blocks_held(server)


def test_a_failed_prompt_ends_a_streamed_batch_and_frees_every_block(app, server, bundled):
    """One prompt the engine fails (its detokenizer raises): the stream ends with an error
    event and [DONE], the other prompt is aborted, every KV block is back: as the batch that is
    not streamed answers 500 and aborts the rest. A client that hangs up frees them too."""
    engine = app.state.server.engine.engine
    poison = prompt_ids(bundled, "Selah selah selah")
    make = engine.tokenizer.detokenizer

    def detokenizer(prompt_ids=None, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        d = make(prompt_ids, *args, **kwargs)
        if prompt_ids is not None and list(prompt_ids) == poison:
            def add(token_id: int) -> str:
                raise OverflowError("Overflow when unpacking long long")
            d.add = add
        return d

    body = {"prompt": [prompt_ids(bundled), poison], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}
    engine.tokenizer.detokenizer = detokenizer
    aborted = metric(server, "request_aborted_total")
    try:
        with httpx.stream("POST", f"{server}/v1/completions", timeout=120,
                          json={**body, "stream": True}) as r:
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        plain = post(server, "/v1/completions", body)
    finally:
        engine.tokenizer.detokenizer = make
    assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1
    error = json.loads(lines[-2])["error"]
    assert error["type"] == "server_error" and "long long" not in error["message"]
    texts = [json.loads(line)["choices"][0] for line in lines[:-2]]
    assert all(c["index"] == 0 and c["finish_reason"] is None for c in texts)  # cut, not done
    assert plain.status_code == 500 and plain.json()["error"]["code"] == "engine_error"
    # the healthy prompt of each was aborted (it had hundreds of tokens to go), not finished
    assert wait_for(lambda: metric(server, "request_aborted_total") >= aborted + 2)
    assert no_blocks_held(server)
    aborted = metric(server, "request_aborted_total")
    with httpx.stream("POST", f"{server}/v1/completions", timeout=120,
                      json={**body, "prompt": [PROMPT, "And"], "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # hang up after the first chunk
    assert wait_for(lambda: metric(server, "request_aborted_total") >= aborted + 2)
    assert no_blocks_held(server)
    ok = post(server, "/v1/completions", {"prompt": [PROMPT, "And"], "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


@pytest.mark.parametrize(("prompt", "extra"), [
    ([5, 3072], {}), ([[5, 6], [7, 99999]], {}), ([[5, 6], []], {}),
    ([[5, 6], [7, 99999]], {"stream": True}), ([[5]] * 9, {}), ([[5]] * 9, {"stream": True}),
])
def test_bad_token_id_prompts_are_400_and_free_everything(server, prompt, extra):
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 3, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt"
    assert no_blocks_held(server)


# -- (c) prompt log-probabilities ---------------------------------------------------------------
def full_logprobs(bundled, ids: list[int]) -> torch.Tensor:
    model, _ = bundled
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)


def test_echo_with_logprobs_scores_the_prompt(client, bundled):
    ids = prompt_ids(bundled)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0,
                                    logprobs=2, echo=True,
                                    extra_body={"ignore_eos": True,
                                                "return_tokens_as_token_ids": True})
    choice = out.choices[0]
    choice_lp = choice.logprobs
    got = [int(t.split(":")[1]) for t in choice_lp.tokens]
    assert got[: len(ids)] == ids and len(got) == len(ids) + 3
    ref = full_logprobs(bundled, got)
    assert choice_lp.token_logprobs[0] is None and choice_lp.top_logprobs[0] is None
    for p in range(1, len(got)):
        assert abs(choice_lp.token_logprobs[p] - float(ref[p - 1, got[p]])) < TOL
        top = {int(k.split(":")[1]): v for k, v in choice_lp.top_logprobs[p].items()}
        want = ref[p - 1].topk(2)
        for i, lp in zip(want.indices.tolist(), want.values.tolist()):
            assert abs(top[i] - lp) < TOL
    assert choice.text.startswith(bundled[1].decode(ids, skip_special_tokens=False))
    assert choice_lp.text_offset[0] == 0 and choice_lp.text_offset == sorted(
        choice_lp.text_offset)


def test_max_tokens_zero_with_echo_scores_without_generating(client, bundled):
    ids = prompt_ids(bundled)
    out = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=0,
                                    logprobs=1, echo=True, temperature=0)
    ref = full_logprobs(bundled, ids)
    for choice, n in zip(out.choices, (len(ids), 3)):
        lps = choice.logprobs.token_logprobs
        assert len(lps) == n and lps[0] is None
        assert all(abs(lps[p] - float(ref[p - 1, ids[p]])) < TOL for p in range(1, n))
        assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0


def test_vllm_prompt_logprobs_extra(server, bundled):
    ids = prompt_ids(bundled)
    r = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    ref = full_logprobs(bundled, ids)
    assert plp[0] is None and len(plp) == len(ids)
    for p in range(1, len(ids)):
        entry = plp[p]
        assert str(ids[p]) in entry
        mine = entry[str(ids[p])]
        assert abs(mine["logprob"] - float(ref[p - 1, ids[p]])) < TOL
        assert mine["rank"] == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
        assert len(entry) >= 3


@pytest.mark.parametrize(("extra", "field"), [
    ({"echo": True, "stream": True}, "echo"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"echo": True, "logprobs": 6}, "logprobs"),
])
def test_bad_echo_requests_are_400_naming_the_field(server, extra, field):
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text
    assert no_blocks_held(server)


def test_chat_refuses_prompt_logprobs_by_name(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 2, "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
