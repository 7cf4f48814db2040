"""The OpenAI-compatible server, over real HTTP, with the official ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import httpx
import openai
import pytest
import torch

import infer_lab as il
from infer_lab.engine.config import EngineConfig
from infer_lab.serve.server import make_app
from tests.helpers import assert_greedy_equal
from tests.live_server import metric, running, wait_for

PROMPTS = [
    "And God said,", "In the beginning", "Blessed are the", "And the LORD spake unto Moses",
    "Thou shalt", "And it came to pass", "The LORD is my shepherd", "For God so loved",
]


@pytest.fixture(scope="module")
def server():
    app = make_app(None, device="cpu", num_kv_blocks=256, max_num_seqs=64)
    with running(app) as base:
        yield base


def test_a_cpu_model_loads_in_a_thread_that_ends(monkeypatch):
    """On a CPU the model loads in a thread gone by the time the app exists: OpenMP keeps a
    worker team for each thread that ran a parallel op, and a team left in the caller beside the
    engine loop's makes libgomp sleep its workers between ops (``server.load_engine``)."""
    from infer_lab.serve import server as server_module

    loaders: list[threading.Thread] = []
    real_load = server_module.load

    def load(*args, **kwargs):
        loaders.append(threading.current_thread())
        return real_load(*args, **kwargs)

    monkeypatch.setattr(server_module, "load", load)
    app = make_app(None, device="cpu", num_kv_blocks=16)
    assert app is not None and len(loaders) == 1
    assert loaders[0] is not threading.current_thread() and not loaders[0].is_alive()
    with pytest.raises(FileNotFoundError):  # a load's error still reaches the caller
        server_module.load_engine(Path("/nonexistent/model"), EngineConfig(), device="cpu")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def bundled():
    return il.load(device="cpu")


def greedy_reference(bundled, prompt_ids: list[int], tokens: list[int]) -> None:
    """Our output equals naive greedy decoding of the same prompt (near-tie rule)."""
    model, _ = bundled
    ref = il.generate_naive(model, bundled[1], prompt_ids, max_tokens=len(tokens),
                            ignore_eos=True)
    assert_greedy_equal(
        tokens, ref.token_ids,
        lambda prefix: model(torch.tensor([prompt_ids + prefix]), last_only=True)[0, -1],
    )


def test_completions_equal_offline_generate(client, bundled):
    _, tok = bundled
    prompt = "And the LORD said unto Moses,"
    resp = client.completions.create(model="tiny-kjv", prompt=prompt, max_tokens=20,
                                     temperature=0, extra_body={"ignore_eos": True})
    offline = il.LLM(device="cpu").generate(
        [prompt], il.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        use_tqdm=False)[0]
    assert resp.choices[0].text == offline.text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(tok.encode(prompt))
    assert resp.usage.completion_tokens == 20
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 20


def test_streaming_completion_matches_non_streaming(client):
    kwargs = dict(model="tiny-kjv", prompt="Blessed are the", max_tokens=16, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) == 16  # one token per chunk
    assert "".join(texts) == whole
    assert chunks[-1].usage.completion_tokens == 16 and not chunks[-1].choices


def test_chat_streaming_and_not(client, bundled):
    _, tok = bundled
    messages = [{"role": "system", "content": "Speak as the scripture speaks."},
                {"role": "user", "content": "Let there be light"}]
    resp = client.chat.completions.create(model="tiny-kjv", messages=messages, max_tokens=12,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert resp.choices[0].message.role == "assistant"
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert resp.usage.prompt_tokens == len(prompt_ids)
    stream = client.chat.completions.create(
        model="tiny-kjv", messages=messages, max_completion_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == resp.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny-kjv"]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_64_concurrent_streams_are_complete_and_correct(server, bundled):
    _, tok = bundled
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(64)]
    lengths = [8 + i % 17 for i in range(64)]
    aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)

    async def one(prompt: str, n: int) -> list[str]:
        stream = await aclient.completions.create(
            model="tiny-kjv", prompt=prompt, max_tokens=n, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        return [c.choices[0].text async for c in stream if c.choices]

    async def all_of_them() -> list[list[str]]:
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))

    results = asyncio.run(all_of_them())
    for prompt, n, pieces in zip(prompts, lengths, results):
        assert len(pieces) == n
        ids = tok.encode("".join(pieces))
        # compare as tokens with the naive reference (re-encoding text is lossless here)
        ref = il.generate_naive(bundled[0], tok, prompt, max_tokens=n, ignore_eos=True)
        if "".join(pieces) != ref.text:
            greedy_reference(bundled, tok.encode(prompt), ids[: len(ref.token_ids)])
    assert wait_for(lambda: metric(server, "kv_cache_blocks_used") == 0)
    assert metric(server, "num_requests_running") == 0


def test_client_disconnect_frees_blocks_and_others_finish(server):
    aborted_before = metric(server, "request_aborted_total")
    body = {"model": "tiny-kjv", "prompt": "In the beginning", "max_tokens": 1500,
            "temperature": 0, "stream": True, "ignore_eos": True}

    async def quitter() -> None:
        async with httpx.AsyncClient(timeout=60) as http, http.stream(
            "POST", f"{server}/v1/completions", json=body) as resp:
            seen = 0
            async for line in resp.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break  # hang up mid-stream

    async def stayer() -> str:
        async with httpx.AsyncClient(timeout=120) as http:
            r = await http.post(f"{server}/v1/completions", json={
                "model": "tiny-kjv", "prompt": "Thou shalt", "max_tokens": 30,
                "temperature": 0, "ignore_eos": True})
            return r.json()["choices"][0]["text"]

    async def both():
        return await asyncio.gather(*(quitter() for _ in range(4)), stayer())

    *_, text = asyncio.run(both())
    assert text
    assert wait_for(lambda: metric(server, "request_aborted_total") >= aborted_before + 4)
    assert wait_for(lambda: metric(server, "kv_cache_blocks_used") == 0)
    # and the server still serves
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "Amen", "max_tokens": 2})
    assert r.status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (b"{not json", 400, "JSON"),
        (b"[1, 2, 3]", 400, "object"),
        (json.dumps({"prompt": 5}).encode(), 400, "prompt"),
        (json.dumps({"prompt": "hi", "max_tokens": "many"}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "hi", "temperature": -1}).encode(), 400, "temperature"),
        (json.dumps({"prompt": "hi", "top_p": 0}).encode(), 400, "top_p"),
        (json.dumps({"prompt": "hi", "n": 0}).encode(), 400, "n"),
        (json.dumps({"prompt": "hi", "model": "gpt-9"}).encode(), 404, "gpt-9"),
        (json.dumps({"prompt": "hi", "max_tokens": 5000}).encode(), 400, "context"),
        (json.dumps({"prompt": [1, 2, 999999], "max_tokens": 2}).encode(), 400, "vocabulary"),
        (json.dumps({"prompt": ""}).encode(), 400, "empty"),
        (json.dumps({"prompt": "x" * 2_000_000}).encode(), 413, "bytes"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, fragment):
    r = httpx.post(f"{server}/v1/completions", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["type"]


def test_bad_chat_requests(server):
    url = f"{server}/v1/chat/completions"
    assert httpx.post(url, json={"messages": []}).status_code == 400
    r = httpx.post(url, json={"messages": [{"role": "wizard", "content": "hi"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 4000})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]


def test_openai_client_raises_on_errors(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny-kjv", prompt="hi", temperature=-0.5)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")


def test_metrics_are_prometheus_text(server):
    httpx.post(f"{server}/v1/completions", json={"prompt": "Amen", "max_tokens": 3})
    text = httpx.get(f"{server}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "prompt_tokens_total", "generation_tokens_total"):
        assert f"infer_lab:{name}" in text
    assert metric(server, "generation_tokens_total") >= 3


def test_api_key():
    app = make_app(None, device="cpu", api_key="s3cret", num_kv_blocks=32)
    with running(app) as base:
        url = f"{base}/v1/completions"
        body = {"prompt": "Amen", "max_tokens": 2}
        assert httpx.post(url, json=body).status_code == 401
        r = httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer s3cret"}).is_success
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
        assert httpx.get(f"{base}/health").status_code == 200  # health stays open
