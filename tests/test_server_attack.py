"""The server under attack (issue 12): one test per defect, against a real uvicorn on loopback.

Every payload here is hostile in its own way: int64 and float edges, lone surrogates, parts of the
wrong type, chunked bodies over the limit, half-sent headers, clients that hang up, floods beyond
the queue bound. Each asserts what a client sees (status, JSON shape, headers) and that the
bystanders' outputs are complete and correct.
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import openai
import pytest
import torch

import infer_lab as il
from infer_lab.serve.server import make_app, model_id
from tests.helpers import assert_greedy_equal
from tests.live_server import metric, running, wait_for

BYSTANDERS = ["And God said,", "In the beginning", "Blessed are the", "Thou shalt",
              "And it came to pass", "The LORD is my shepherd"]


@pytest.fixture(scope="module")
def bundled():
    return il.load(device="cpu")


@pytest.fixture(scope="module")
def server():
    app = make_app(None, device="cpu", num_kv_blocks=256, max_num_seqs=16,
                   vllm_metric_names=True)
    with running(app, header_timeout=1.0) as base:
        yield base


def greedy_ok(bundled, prompt: str, text: str, n: int) -> None:
    """``text`` is the greedy continuation of ``prompt`` (naive decode; near-tie rule)."""
    model, tok = bundled
    ref = il.generate_naive(model, tok, prompt, max_tokens=n, ignore_eos=True)
    if text == ref.text:
        return
    ids = tok.encode(prompt)
    ours = tok.encode(text, add_special_tokens=False)[: len(ref.token_ids)]
    assert_greedy_equal(ours, ref.token_ids,
                        lambda p: model(torch.tensor([ids + p]), last_only=True)[0, -1])


async def stream_text(http: httpx.AsyncClient, base: str, body: dict) -> tuple[str, list[str]]:
    """The text of a streamed completion and every event line it sent."""
    events, text = [], ""
    async with http.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if line != "data: [DONE]":
                    payload = json.loads(line[6:])
                    if payload.get("choices"):
                        text += payload["choices"][0]["text"]
    return text, events


def post(base: str, path: str, body: dict | bytes, **kw) -> httpx.Response:  # noqa: ANN003
    if isinstance(body, bytes):
        return httpx.post(f"{base}{path}", content=body, timeout=60,
                          headers={"content-type": "application/json"}, **kw)
    return httpx.post(f"{base}{path}", json=body, timeout=60, **kw)


# -- 1. one request's bad values fail that request alone ---------------------------------------
HOSTILE_VALUES = [
    {"top_k": 2**63, "temperature": 1.0},
    {"top_k": 2**31, "temperature": 0.7, "seed": 1},
    {"seed": 2**64},
    {"max_tokens": 2**63},
    {"stop_token_ids": [2**63]},
    {"n": 2**62},
]


def test_hostile_values_fail_alone_and_bystanders_finish(server, bundled):
    async def scene() -> tuple[list[str], list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=120) as http:
            streams = [stream_text(http, server, {"prompt": p, "max_tokens": 24,
                                                  "temperature": 0, "ignore_eos": True})
                       for p in BYSTANDERS]
            hostile = [http.post(f"{server}/v1/completions",
                                 json={"prompt": "Amen", "max_tokens": 8, **v})
                       for v in HOSTILE_VALUES]
            got = await asyncio.gather(*streams, *hostile)
            return [t for t, _ in got[: len(streams)]], got[len(streams):]

    texts, refused = asyncio.run(scene())
    for r, values in zip(refused, HOSTILE_VALUES):
        assert r.status_code == 400, (values, r.text)
        assert r.json()["error"]["param"] in values or next(iter(values)) in r.text
    for prompt, text in zip(BYSTANDERS, texts):
        greedy_ok(bundled, prompt, text, 24)
    assert metric(server, "request_failed_total") == 0


# -- 2. a non-streaming request whose client hung up is aborted --------------------------------
def test_non_streaming_disconnect_aborts(server):
    aborted = metric(server, "request_aborted_total")
    generated = metric(server, "generation_tokens_total")
    body = {"prompt": "In the beginning", "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True}

    async def quitter() -> None:
        async with httpx.AsyncClient(timeout=0.5) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(f"{server}/v1/completions", json=body)

    async def quitters() -> None:
        await asyncio.gather(*(quitter() for _ in range(4)))

    asyncio.run(quitters())
    assert wait_for(lambda: metric(server, "request_aborted_total") >= aborted + 4, 60)
    assert wait_for(lambda: metric(server, "kv_cache_blocks_used") == 0, 60)
    assert metric(server, "generation_tokens_total") - generated < 4 * 1500 / 2


# -- 3. admission control, stalled sockets, a health that tells the truth ----------------------
def test_queue_bound_answers_429_with_retry_after(bundled):
    app = make_app(None, device="cpu", num_kv_blocks=128, max_num_seqs=2,
                   max_waiting_requests=3, max_waiting_tokens=1 << 16)
    with running(app) as base:
        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(*(
                    http.post(f"{base}/v1/completions", json={
                        "prompt": BYSTANDERS[i % 6], "max_tokens": 24, "temperature": 0,
                        "ignore_eos": True}) for i in range(24)))

        answers = asyncio.run(flood())
        statuses = [r.status_code for r in answers]
        assert set(statuses) <= {200, 429}, statuses
        assert statuses.count(429) >= 1 and statuses.count(200) >= 3  # the 3 it may queue
        for i, r in enumerate(answers):
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["type"] == "rate_limit_error"
            else:
                greedy_ok(bundled, BYSTANDERS[i % 6], r.json()["choices"][0]["text"], 24)
        assert wait_for(lambda: metric(base, "kv_cache_blocks_used") == 0)


def test_waiting_prompt_tokens_are_bounded():
    app = make_app(None, device="cpu", num_kv_blocks=128, max_num_seqs=1,
                   max_waiting_requests=100, max_waiting_tokens=300)
    with running(app) as base:
        long_prompt = " ".join(["And God said, Let there be light"] * 20)  # ~ 200 tokens

        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(*(
                    http.post(f"{base}/v1/completions", json={
                        "prompt": long_prompt, "max_tokens": 16, "ignore_eos": True})
                    for _ in range(8)))

        statuses = [r.status_code for r in asyncio.run(flood())]
        assert set(statuses) == {200, 429}, statuses


def test_half_sent_header_is_dropped(server):
    with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1]))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        s.settimeout(60)
        assert s.recv(1024) == b""  # closed by the server, not held forever
    with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1]))) as s:
        s.settimeout(60)
        assert s.recv(1024) == b""  # a socket that never sends a byte is dropped too
    assert httpx.get(f"{server}/health").status_code == 200


def test_a_body_that_trickles_in_is_dropped():
    app = make_app(None, device="cpu", num_kv_blocks=16, body_timeout=1.0)
    with running(app) as base, socket.create_connection(
            ("127.0.0.1", int(base.rsplit(":", 1)[1]))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        s.settimeout(60)
        reply = b""
        for _ in range(20):  # the server answers, then closes (bounded reads)
            part = s.recv(4096)
            if not part:
                break
            reply += part
        assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive" in reply


def test_health_reports_a_dead_engine():
    app = make_app(None, device="cpu", num_kv_blocks=32)
    with running(app) as base:
        engine = app.state.server.engine.engine

        def broken_step():  # a fault in the engine itself, not in one request
            raise RuntimeError("simulated device fault")

        engine.step = broken_step
        for _ in range(3):
            r = post(base, "/v1/completions", {"prompt": "Amen", "max_tokens": 2})
            assert r.status_code in (500, 503) and r.json()["error"]
        assert wait_for(lambda: httpx.get(f"{base}/health").status_code == 503, 60)
        assert httpx.get(f"{base}/health").json()["status"] == "dead"
        r = post(base, "/v1/completions", {"prompt": "Amen", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


# -- 4. unsupported OpenAI fields: 400 by name; neutral values keep working --------------------
@pytest.mark.parametrize(("path", "extra", "field"), [
    ("/v1/completions", {"logit_bias": {"five": 10}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"echo": True, "stream": True}, "echo"),
    ("/v1/completions", {"suffix": " and the end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    # tools work with tool_choice "auto" (issue 29), "required" or a named function (issue
    # 19); a named function that is not among the tools is refused by name
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "messages[0].content[0]"),
])
def test_unsupported_fields_are_refused_by_name(server, path, extra, field):
    body = {"prompt": "Amen"} if "chat" not in path else {
        "messages": [{"role": "user", "content": "Amen"}]}
    r = post(server, path, {**body, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in error["message"] and error["param"] == field


def test_neutral_defaults_keep_working(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    neutral = dict(presence_penalty=0, frequency_penalty=0, logit_bias={}, n=1, user="u")
    c = client.completions.create(model="tiny-kjv", prompt="Amen", max_tokens=3, echo=False,
                                  best_of=1, temperature=0, **neutral)
    assert c.choices[0].finish_reason in ("length", "stop")
    chat = client.chat.completions.create(
        model="tiny-kjv", messages=[{"role": "user", "content": "Amen"}], max_tokens=3,
        response_format={"type": "text"}, tool_choice="none", temperature=0, **neutral)
    assert chat.choices[0].message.role == "assistant"


# -- 5. every error is OpenAI JSON, about the request, and the connection stays open ------------
MALFORMED = [
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}', "text"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}]}', "Unicode"),
    ("/v1/completions", b'{"prompt": "lone \\udfff", "max_tokens": 2}', "Unicode"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud83d"]}', "Unicode"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": Infinity}', "top_p"),
    ("/v1/completions", b'{"prompt": [1, 2, -1]}', "prompt"),
    ("/v1/completions", b'{"prompt": [9223372036854775808]}', "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1e400}', "max_tokens"),
    ("/v1/completions", b'{"prompt": {"nested": [[[[]]]]}}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": {"a": 1}}]}',
     "content"),
]


@pytest.mark.parametrize(("path", "body", "fragment"), MALFORMED)
def test_malformed_requests_get_json_400_on_a_kept_connection(server, path, body, fragment):
    with httpx.Client(base_url=server, timeout=60) as http:
        r = http.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.headers["content-type"].startswith("application/json")
        error = r.json()["error"]
        assert fragment in error["message"], error
        assert not any(s in error["message"] for s in ("TextInputSequence", "long long",
                                                       "Traceback", "function-after"))
        assert r.headers.get("connection", "keep-alive") != "close"
        assert http.get("/health").status_code == 200  # same pooled connection


# -- 6. a huge prompt or a flood of stop strings is refused before it costs anything ------------
def test_prompt_too_long_in_bytes_is_refused_before_tokenizing(server):
    r = post(server, "/v1/chat/completions",
             {"messages": [{"role": "user", "content": "Amen " * 180_000}], "max_tokens": 2})
    assert r.status_code == 400 and "bytes" in r.json()["error"]["message"], r.text
    r = post(server, "/v1/completions", {"prompt": "Amen " * 180_000, "max_tokens": 2})
    assert r.status_code == 400 and "bytes" in r.json()["error"]["message"], r.text


def test_encode_batch_equals_encode(bundled):
    _, tok = bundled
    texts = ["And God said,", "", "Amen " * 1000, "héllo wörld \u2603"]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert tok.encode_batch(texts, add_special_tokens=False) == [
        tok.encode(t, add_special_tokens=False) for t in texts]


@pytest.mark.parametrize("stop", [["x"] * 100_000, ["a" * 100_000], [f"s{i}" for i in range(17)]])
def test_stop_strings_are_bounded(server, stop):
    r = post(server, "/v1/completions", {"prompt": "Amen", "max_tokens": 2, "stop": stop})
    assert r.status_code == 400 and "stop" in r.json()["error"]["message"], r.text


# -- 7. degenerate sampling values: greedy, never garbage ----------------------------------------
@pytest.mark.parametrize("values", [{"temperature": 1e-40}, {"temperature": 5e-324},
                                    {"top_p": 1e-46, "temperature": 1.0},
                                    {"top_p": 1e-7, "temperature": 0.8, "seed": 3}])
def test_degenerate_sampling_is_greedy(server, bundled, values):
    prompt = "And it came to pass"
    r = post(server, "/v1/completions",
             {"prompt": prompt, "max_tokens": 12, "ignore_eos": True, **values})
    assert r.status_code == 200, r.text
    greedy_ok(bundled, prompt, r.json()["choices"][0]["text"], 12)


# -- 8. a chunked body over the limit is 413 ------------------------------------------------------
def test_chunked_body_over_limit_is_413(server):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}'

    r = httpx.post(f"{server}/v1/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert "bytes" in r.json()["error"]["message"]


# -- 10. counters, the model's name, the API key -------------------------------------------------
def test_preemptions_and_failures_are_counted():
    app = make_app(None, device="cpu", num_kv_blocks=12, max_num_seqs=8, block_size=16)
    with running(app) as base:
        async def crowd() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(*(
                    http.post(f"{base}/v1/completions", json={
                        "prompt": p, "max_tokens": 60, "temperature": 0, "ignore_eos": True})
                    for p in BYSTANDERS))

        assert all(r.status_code == 200 for r in asyncio.run(crowd()))
        assert metric(base, "num_preemptions_total") > 0
        assert metric(base, "request_failed_total") == 0
        assert wait_for(lambda: metric(base, "kv_cache_blocks_used") == 0)


def test_router_metrics_and_prefix_cache_counters(server):
    prompt = " ".join(BYSTANDERS) * 3
    for _ in range(2):
        assert post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2}).is_success
    assert metric(server, "prefix_cache_queries_total") > 0
    assert metric(server, "prefix_cache_hits_total") > 0
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
        metric(server, name, prefix="vllm")  # exported under vLLM's names (KeyError if not)


def test_model_id_is_a_name_never_a_path(tmp_path):
    bundled_dir = il.model.loader.resolve_model_path(None)
    assert model_id(str(bundled_dir), bundled_dir, None) == bundled_dir.name
    gguf = tmp_path / "SmolLM2-135M.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    assert model_id(str(gguf), gguf, None) == "SmolLM2-135M.Q8_0"
    assert model_id("org/some-model", bundled_dir, None) == "org/some-model"
    assert model_id(str(gguf), gguf, "mine") == "mine"
    app = make_app(str(bundled_dir), device="cpu", num_kv_blocks=16)
    with running(app) as base:
        ids = [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]]
        assert ids == [bundled_dir.name] and "/" not in ids[0]


def test_api_key_scheme_realm_and_guarded_routes():
    app = make_app(None, device="cpu", api_key="s3cret", api_key_all_routes=True,
                   num_kv_blocks=16)
    with running(app) as base:
        r = httpx.get(f"{base}/metrics")
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        for path in ("/docs", "/openapi.json"):
            assert httpx.get(f"{base}{path}").status_code == 401
        assert httpx.get(f"{base}/metrics", headers={"Authorization": "bearer s3cret"}).is_success
        assert httpx.get(f"{base}/health").status_code == 200
        # the key is checked before the body is read: garbage and oversize bodies get 401
        r = httpx.post(f"{base}/v1/completions", content=b"{not json",
                       headers={"content-type": "application/json"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(f"{base}/v1/completions", content=b"x" * 3_000_000)
        assert r.status_code == 401
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "Amen", "max_tokens": 2},
                       headers={"Authorization": "BEARER s3cret"})
        assert r.status_code == 200

