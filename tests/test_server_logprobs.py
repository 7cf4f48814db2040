"""Log-probabilities, penalties and per-request engine failures over HTTP (issue 12, 1 and 4).

The log-probabilities the server sends are checked against an independent full forward of the
model over prompt + output (``model(input_ids)``, log-softmax of the raw logits), through the
official ``openai`` client, streaming and not, for both routes.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch

import infer_lab as il
from infer_lab.serve.server import make_app
from tests.live_server import metric, running, wait_for

TOL = 1e-3  # fp32 batched decode vs one full forward


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


def reference(bundled, prompt_ids: list[int], out_ids: list[int]) -> torch.Tensor:
    """log-softmax of the raw logits that predicted each output token: [len(out), vocab]."""
    model, _ = bundled
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + out_ids]))[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)


def ids_of(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens)
    return [int(t.split(":", 1)[1]) for t in tokens]


def check(ref: torch.Tensor, out_ids: list[int], chosen: list[float],
          tops: list[dict[int, float]], k: int) -> None:
    assert len(chosen) == len(out_ids) == len(tops) == ref.shape[0]
    for i, (token, lp, top) in enumerate(zip(out_ids, chosen, tops)):
        assert abs(lp - ref[i, token].item()) < TOL
        want = ref[i].topk(k).values.tolist()
        got = sorted((v for t, v in top.items()), reverse=True)[:k]
        assert len(got) == k and all(abs(a - b) < TOL for a, b in zip(got, want))
        for t, v in top.items():
            assert abs(v - ref[i, t].item()) < TOL


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_completion_logprobs_match_a_full_forward(client, bundled, temperature):
    _, tok = bundled
    prompt = "And the LORD said unto Moses,"
    kwargs = dict(model="tiny-kjv", prompt=prompt, max_tokens=10, temperature=temperature,
                  seed=7, logprobs=3, extra_body={"ignore_eos": True,
                                                  "return_tokens_as_token_ids": True})
    whole = client.completions.create(**kwargs).choices[0]
    out_ids = ids_of(whole.logprobs.tokens)
    ref = reference(bundled, tok.encode(prompt), out_ids)
    tops = [{int(t.split(":")[1]): v for t, v in d.items()} for d in whole.logprobs.top_logprobs]
    check(ref, out_ids, whole.logprobs.token_logprobs, tops, 3)
    assert whole.logprobs.text_offset == sorted(whole.logprobs.text_offset)
    # streamed: the same numbers, piece by piece
    pieces = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kwargs)
              if c.choices and c.choices[0].logprobs is not None]
    assert sum((p.tokens for p in pieces), []) == whole.logprobs.tokens
    assert sum((p.token_logprobs for p in pieces), []) == whole.logprobs.token_logprobs


def test_completion_token_strings_are_the_tokenizers(client, bundled):
    _, tok = bundled
    r = client.completions.create(model="tiny-kjv", prompt="In the beginning", max_tokens=6,
                                  temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text or len(lp.tokens) == 6
    assert all(len(d) >= 1 for d in lp.top_logprobs)


def test_chat_logprobs_match_a_full_forward(client, bundled):
    _, tok = bundled
    messages = [{"role": "user", "content": "Let there be light"}]
    kwargs = dict(model="tiny-kjv", messages=messages, max_tokens=8, temperature=0.7, seed=1,
                  logprobs=True, top_logprobs=5,
                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    r = client.chat.completions.create(**kwargs)
    content = r.choices[0].logprobs.content
    out_ids = ids_of([c.token for c in content])
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref = reference(bundled, prompt_ids, out_ids)
    tops = [{int(t.token.split(":")[1]): t.logprob for t in c.top_logprobs} for c in content]
    check(ref, out_ids, [c.logprob for c in content], tops, 5)
    assert all(c.bytes == list(c.token.encode()) for c in content)
    streamed = [c.choices[0].logprobs for c in client.chat.completions.create(stream=True,
                                                                             **kwargs)
                if c.choices and c.choices[0].logprobs is not None]
    assert [e.token for p in streamed for e in p.content] == [c.token for c in content]


def test_logprobs_off_means_null(client):
    r = client.completions.create(model="tiny-kjv", prompt="Amen", max_tokens=2)
    assert r.choices[0].logprobs is None
    r = client.chat.completions.create(model="tiny-kjv", max_tokens=2,
                                       messages=[{"role": "user", "content": "Amen"}])
    assert r.choices[0].logprobs is None


def test_penalties_reach_the_engine(client):
    prompt = "And God said, Let there be light: and there was light."
    llm = il.LLM(device="cpu")
    for penalty in ({"presence_penalty": 1.5}, {"frequency_penalty": 2.0},
                    {"repetition_penalty": 1.8}):
        offline = llm.generate([prompt], il.SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True, **penalty), use_tqdm=False)[0].text
        r = client.completions.create(model="tiny-kjv", prompt=prompt, max_tokens=24,
                                      temperature=0, extra_body={"ignore_eos": True, **penalty})
        assert r.choices[0].text == offline


def test_a_request_the_engine_fails_fails_alone(app, server):
    """A fault inside the engine for one request (here its detokenizer raises) ends that
    request with an error (500 JSON, or an error event and [DONE]); the others finish."""
    engine = app.state.server.engine.engine
    poison = "Selah selah selah"
    poison_ids = engine.tokenizer.encode(poison)
    make = engine.tokenizer.detokenizer

    def detokenizer(prompt_ids=None, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        d = make(prompt_ids, *args, **kwargs)
        if prompt_ids is not None and list(prompt_ids) == poison_ids:
            def add(token_id: int) -> str:
                raise OverflowError("Overflow when unpacking long long")
            d.add = add
        return d

    engine.tokenizer.detokenizer = detokenizer
    failed = metric(server, "request_failed_total")
    try:
        async def scene():
            async with httpx.AsyncClient(timeout=120) as http:
                async def stream(prompt: str) -> list[str]:
                    body = {"prompt": prompt, "max_tokens": 20, "temperature": 0,
                            "ignore_eos": True, "stream": True}
                    async with http.stream("POST", f"{server}/v1/completions", json=body) as r:
                        return [line[6:] async for line in r.aiter_lines()
                                if line.startswith("data: ")]
                plain = http.post(f"{server}/v1/completions",
                                  json={"prompt": poison, "max_tokens": 20})
                return await asyncio.gather(stream(poison), plain,
                                            *(stream(p) for p in ("Thou shalt", "Amen", "And")))

        poisoned, plain, *others = asyncio.run(scene())
    finally:
        engine.tokenizer.detokenizer = make
    assert poisoned[-1] == "[DONE]"
    error = json.loads(poisoned[-2])["error"]
    assert error["type"] == "server_error" and "long long" not in error["message"]
    assert plain.status_code == 500 and plain.json()["error"]["code"] == "engine_error"
    assert "long long" not in plain.text
    for events in others:
        assert events[-1] == "[DONE]"
        assert sum(bool(json.loads(e)["choices"]) for e in events[:-1]) == 20
    assert wait_for(lambda: metric(server, "request_failed_total") >= failed + 2)
    assert wait_for(lambda: metric(server, "kv_cache_blocks_used") == 0)
