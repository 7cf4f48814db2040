"""What real clients send (issue 29), over HTTP through the official ``openai`` client: the rest
of the sampling API (min_p, logit_bias, stop_token_ids, min_tokens).

Every answer is checked against an independent reference (a naive greedy loop over full
forwards of the bundled model), every bad value is a 400 naming its field, and after each bad
request every KV block is back in the pool.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

import infer_lab as il
from infer_lab.serve.server import make_app
from tests.live_server import metric, running, wait_for

PROMPT = "In the beginning God created"
MODEL = "tiny-kjv"


@pytest.fixture(scope="module")
def bundled():
    return il.load(device="cpu")


@pytest.fixture(scope="module")
def server():
    app = make_app(None, device="cpu", num_kv_blocks=256, max_num_seqs=16)
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
