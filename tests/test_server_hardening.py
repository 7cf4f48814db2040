"""The server under attack, round 3 (issue 24): one test per defect and its variants, against a
real uvicorn on loopback with the limits set low (every deadline sub-second).

Memory: a reader that stops reading holds one merged output, and a send it leaves waiting ends
its request; chat templates render under a deadline and an output cap. Stalls: ``n`` is capped,
admission counts the tokens a request may occupy, large answers are built off the event loop,
grammars compile in their own bounded thread. HTTP: a body framed twice is refused and the
connection closed; a stop string inside a tool call's JSON is not a tool call; a stream that
fails ends with an error event and ``[DONE]``; fields that would change the output and are not
implemented are refused by name. Every refusal is counted in ``/metrics`` by reason.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import socket
import threading

import httpx
import pytest

import infer_lab as il
from infer_lab.engine import LLMEngine, SamplingParams
from infer_lab.engine.structured import StructuredOutputs
from infer_lab.serve import responses, routes
from infer_lab.serve.async_engine import AsyncEngine, RequestOutputCollector
from infer_lab.serve.limits import ServerLimits
from infer_lab.serve.metrics import REFUSAL_REASONS
from infer_lab.serve.protocol import CHAT_REFUSED_FIELDS, REFUSED_FIELDS
from infer_lab.serve.server import make_app
from tests.live_server import metric, running, wait_for

LIMITS = ServerLimits(max_n=4, max_logprobs_per_request=5000, send_timeout=0.5,
                      send_buffer_bytes=16384, max_schema_bytes=8192, max_schema_depth=16,
                      max_enum_values=50, max_compiles=1, template_timeout=1.0)
CHAT = "/v1/chat/completions"
ASK = [{"role": "user", "content": "Amen"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def bundled():
    return il.load(device="cpu")


@pytest.fixture(scope="module")
def app():
    return make_app(None, device="cpu", num_kv_blocks=256, max_num_seqs=16, limits=LIMITS)


@pytest.fixture(scope="module")
def server(app):
    with running(app, header_timeout=2.0) as base:
        yield base


def post(base: str, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=timeout)


def refused(base: str, reason: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("infer_lab:request_refused_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(reason)


def assert_400(r: httpx.Response, param: str | None = None, fragment: str = "") -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fragment in error["message"], error
    if param is not None:
        assert error["param"] == param, error


# -- every limit is an option of infer-lab serve, every refusal a counter ----------------------
def test_every_limit_is_a_serve_option_with_the_same_default():
    from infer_lab.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve"])
    assert ServerLimits.from_namespace(args) == ServerLimits()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = subparsers.choices["serve"].format_help()
    for f in dataclasses.fields(ServerLimits):
        assert f"--{f.name.replace('_', '-')}" in text and "(default:" in text


def test_every_refusal_reason_is_exported_from_the_start(server):
    for reason in REFUSAL_REASONS:
        assert refused(server, reason) >= 0


# -- 2a. a reader that stops reading holds one merged output ------------------------------------
def _step(step: int, finished: bool = False):  # noqa: ANN202
    from infer_lab.engine import CompletionOutput, RequestOutput
    from infer_lab.engine.outputs import RequestMetrics

    ids = list(range(step + 1))
    comps = [CompletionOutput(i, "x" * (step + 1), ids, "length" if finished else None,
                              delta_text="x", delta_token_ids=[step],
                              token_times=[0.0] * (step + 1)) for i in range(2)]
    return RequestOutput("r", None, [1], comps, finished, RequestMetrics(0.0))


@pytest.mark.parametrize("most", [64, 4, 2])
def test_the_collector_keeps_deltas_and_one_cumulative_copy(most):
    """50 steps nobody reads: at most ``most`` outputs wait, only the newest with the
    cumulative fields; read back, the deltas are every token once, in order."""
    async def scene() -> None:
        c = RequestOutputCollector()
        c.MAX_PENDING = most
        for step in range(50):
            c.put(_step(step, step == 49))
            assert len(c.pending) <= most
            assert all(not o.token_ids for p in list(c.pending)[:-1] for o in p.outputs)
        read = [await c.get() for _ in range(len(c.pending))]
        assert c.output is None and read[-1].finished
        for i in range(2):
            assert sum((r.outputs[i].delta_token_ids for r in read), []) == list(range(50))
            assert "".join(r.outputs[i].delta_text for r in read) == "x" * 50
            assert read[-1].outputs[i].token_ids == list(range(50))
        assert len(read) == min(50, most)

    asyncio.run(scene())


def test_the_collector_keeps_an_error():
    async def scene() -> None:
        c = RequestOutputCollector()
        c.put(_step(0))
        c.put(RuntimeError("failed"))
        c.put(_step(1))  # after an error nothing replaces it
        assert isinstance(await c.get(), RuntimeError) and c.output is None

    asyncio.run(scene())


def test_a_stalled_consumer_costs_one_cumulative_copy(bundled, monkeypatch):
    """The engine runs a whole request whose consumer reads nothing: what waits is one output
    with the cumulative fields and a bounded number of delta records (before: one queued
    output per step, each with a copy of everything so far)."""
    model, tok = bundled
    engine = AsyncEngine(LLMEngine(model, tok, il.EngineConfig(num_kv_blocks=64)))
    monkeypatch.setattr(RequestOutputCollector, "MAX_PENDING", 4)

    async def scene() -> None:
        engine.start()
        try:
            params = SamplingParams(n=2, max_tokens=40, temperature=0, ignore_eos=True)
            outputs = await engine.add_request("r", tok.encode("And God said,"), params)
            assert await asyncio.to_thread(wait_for, lambda: engine.num_in_flight == 0, 60)
            await asyncio.sleep(0.05)
            assert isinstance(outputs, RequestOutputCollector) and len(outputs.pending) <= 4
            read = [await outputs.get() for _ in range(len(outputs.pending))]
            assert read[-1].finished
            for c in read[-1].outputs:
                deltas = sum((r.outputs[c.index].delta_token_ids for r in read), [])
                assert deltas == c.token_ids and len(c.token_ids) == 40
        finally:
            engine.shutdown()

    asyncio.run(scene())


# -- 2b. a send the client leaves waiting ends its request ---------------------------------------
def stalled_request(base: str, body: dict, path: str = CHAT) -> socket.socket:
    """Send ``body`` on a socket with a small receive buffer, and never read."""
    data = json.dumps(body).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", int(base.rsplit(":", 1)[1])))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def closed_by_server(s: socket.socket) -> bool:
    s.settimeout(60)
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


# 4 x 300 x (1 + 3) log-probabilities: within LIMITS; ~300 KB of answer, far more than the
# 16 KB send buffer, the 4 KB receive buffer and the transport's 64 KB hold
FAT = {"messages": ASK, "max_tokens": 300, "n": 4, "logprobs": True, "top_logprobs": 3,
       "ignore_eos": True}


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_stops_reading_is_cut_off_and_its_request_aborted(server, stream):
    timeouts, aborted = refused(server, "send_timeout"), metric(server, "request_aborted_total")
    # streamed: ~1 KB per step; whole: 4 x 100 entries of 8 alternatives, ~230 KB at once
    body = {**FAT, "stream": True} if stream else {**FAT, "max_tokens": 100, "top_logprobs": 8}
    s = stalled_request(server, body)
    try:
        assert wait_for(lambda: refused(server, "send_timeout") > timeouts, 60)
        assert closed_by_server(s)
    finally:
        s.close()
    if stream:  # the request was still running: aborted, its blocks back
        assert wait_for(lambda: metric(server, "request_aborted_total") > aborted, 10)
    assert wait_for(lambda: metric(server, "kv_cache_blocks_used") == 0, 30)
    assert post(server, "/v1/completions", {"prompt": "Amen", "max_tokens": 2}).status_code == 200


def test_stalled_readers_do_not_keep_the_concurrency_slots(bundled):
    app = make_app(None, device="cpu", num_kv_blocks=256, max_num_seqs=16, limits=LIMITS)
    with running(app, limit_concurrency=2) as base:
        held = [stalled_request(base, {**FAT, "stream": True}) for _ in range(2)]
        try:
            ok = wait_for(lambda: post(base, "/v1/completions", {"prompt": "Amen",
                                                                  "max_tokens": 2}).status_code
                          == 200, 60)
            # one freed slot lets the request in; the other stalled reader is aborted too,
            # maybe a moment later (a loaded machine): wait for both, do not race the second
            assert ok and wait_for(lambda: refused(base, "send_timeout") >= 2, 30)
        finally:
            for s in held:
                s.close()


# -- 2c, 3c, 3d. constraints: bounded, compiled in their own thread, refused when hostile ------
DEEP = '{"type":"object","properties":{"a":' * 5000 + '{"type":"string"}' + "}}" * 5000


def raw_post(base: str, path: str, text: str) -> httpx.Response:
    return httpx.post(f"{base}{path}", content=text.encode(), timeout=60,
                      headers={"content-type": "application/json"})


@pytest.mark.parametrize(("path", "text"), [
    ("/v1/completions", '{"prompt": "Amen", "response_format": {"type": "json_schema", '
     '"json_schema": {"name": "x", "schema": SCHEMA}}}'.replace("SCHEMA", DEEP)),
    ("/v1/completions", '{"prompt": "Amen", "structured_outputs": {"json": SCHEMA}}'.replace(
        "SCHEMA", json.dumps(DEEP))),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required", '
     '"tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]}'.replace(
         "SCHEMA", DEEP)),
    ("/v1/completions", '{"prompt": "Amen", "structured_outputs": {"json": SCHEMA}}'.replace(
        "SCHEMA", '{"a":' * 400 + "1" + "}" * 400)),
])
def test_a_schema_nested_thousands_deep_is_a_400(server, path, text):
    r = raw_post(server, path, text)
    assert_400(r, fragment="nest")


@pytest.mark.parametrize(("constraint", "reason", "fragment"), [
    ({"grammar": "root ::= root"}, "grammar_invalid", "accepts no output"),
    ({"grammar": "root ::= a\na ::= a"}, "grammar_invalid", "accepts no output"),
    ({"grammar": 'root ::= s\ns ::= s s | "a"'}, "grammar_slow", "slows down"),
    ({"regex": "(a*)*b"}, "grammar_slow", "slows down"),
    ({"json": {"enum": list(range(51))}}, "enum_values", "enum"),
    ({"choice": [str(i) for i in range(51)]}, "enum_values", "choice"),
    ({"json": {"type": "object", "properties": {f"p{i}": {"type": "string"}
                                                for i in range(400)}}}, "grammar_size", "bytes"),
    ({"json": {"a": [[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]}}, "schema_depth", "nests"),
    ({"grammar": "root ::= undefined_rule"}, "grammar_invalid", "cannot be compiled"),
])
def test_hostile_constraints_are_400_and_counted(server, constraint, reason, fragment):
    before = refused(server, reason)
    r = post(server, "/v1/completions", {"prompt": "Amen", "max_tokens": 4,
                                         "structured_outputs": constraint})
    assert_400(r, "structured_outputs", fragment)
    assert refused(server, reason) == before + 1


def test_an_ordinary_grammar_still_works(server):
    yes_no = {"grammar": 'root ::= "yes" | "no"'}
    r = post(server, "/v1/completions", {"prompt": "Amen", "max_tokens": 8,
                                         "structured_outputs": yes_no})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no")


def test_compilation_has_its_own_bounded_thread(app, server, monkeypatch):
    """A compile in progress does not hold up tokenizing, a second one beyond the bound is a
    429 with Retry-After, and the first finishes once its compile does."""
    release, entered, threads = threading.Event(), threading.Event(), []
    original = StructuredOutputs._compile

    def slow_compile(self, spec):  # noqa: ANN001, ANN202
        threads.append(threading.current_thread().name)
        entered.set()
        release.wait(30)
        return original(self, spec)

    monkeypatch.setattr(StructuredOutputs, "_compile", slow_compile)

    async def scene() -> tuple[httpx.Response, ...]:
        async with httpx.AsyncClient(base_url=server, timeout=60) as http:
            first = asyncio.ensure_future(http.post("/v1/completions", json={
                "prompt": "Amen", "max_tokens": 4, "structured_outputs": {"regex": "[0-9]{3}"}}))
            await asyncio.to_thread(entered.wait, 30)
            plain = await http.post("/v1/completions", json={"prompt": "Amen", "max_tokens": 2})
            second = await http.post("/v1/completions", json={
                "prompt": "Amen", "max_tokens": 4, "structured_outputs": {"regex": "[a-z]{3}"}})
            release.set()
            return await first, plain, second

    first, plain, second = asyncio.run(scene())
    assert plain.status_code == 200
    assert second.status_code == 429 and int(second.headers["retry-after"]) >= 1
    assert second.json()["error"]["type"] == "rate_limit_error"
    assert first.status_code == 200 and len(first.json()["choices"][0]["text"]) == 3
    assert threads and all(name.startswith("compile") for name in threads)
    assert refused(server, "compile_busy") >= 1


# -- 2d. chat templates: a deadline and an output cap ---------------------------------------------
HOSTILE_TEMPLATES = [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
     "template_timeout"),
    ("{{ messages[0]['content'] * 100000000 }}", None),
    ("{% for i in range(100000) %}{{ messages[0]['content'] * 1000 }}{% endfor %}",
     "template_output"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "template_output"),
    ("{{ 'ab'|center(2000000000) }}", None),
]


def test_hostile_chat_templates_are_bounded_and_bystanders_served(bundled):
    app = make_app(None, device="cpu", num_kv_blocks=128, limits=LIMITS)
    tok = app.state.server.tokenizer
    normal = tok.chat_template
    with running(app) as base:
        for template, reason in HOSTILE_TEMPLATES:
            tok.chat_template = template

            async def scene() -> tuple[httpx.Response, httpx.Response]:
                async with httpx.AsyncClient(base_url=base, timeout=30) as http:
                    return await asyncio.gather(
                        http.post(CHAT, json={"messages": ASK, "max_tokens": 4}),
                        http.post("/v1/completions", json={"prompt": "Amen", "max_tokens": 8}))

            chat, plain = asyncio.run(scene())
            assert_400(chat, "messages")
            assert chat.json()["error"]["code"] == "chat_template_limit", (template, chat.text)
            if reason is not None:
                assert refused(base, reason) >= 1
            assert plain.status_code == 200
        tok.chat_template = normal
        assert post(base, CHAT, {"messages": ASK, "max_tokens": 4}).status_code == 200
        tok.chat_template = "{% for m in messages %}{{ m['content'] * 400 }}{% endfor %}"
        long = post(base, CHAT, {"messages": [{"role": "user", "content": "a" * 5000}]})
        assert_400(long, "messages", "bytes")  # the rendered text counts against the limit
    assert app.state.server.renderer._workers[0].proc is None  # stopped with the app


# -- 3a. n is capped; admission counts the tokens a request can occupy ---------------------------
@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/completions", {"n": 5}, "n"),
    ("/v1/completions", {"n": 4, "best_of": 5}, "best_of"),
    (CHAT, {"n": 5}, "n"),
    (CHAT, {"n": 64}, "n"),
])
def test_n_is_capped(server, path, extra, param):
    before = refused(server, "n")
    body = {"messages": ASK} if path == CHAT else {"prompt": "Amen"}
    assert_400(post(server, path, {**body, "max_tokens": 2, **extra}), param, "--max-n")
    assert refused(server, "n") == before + 1


def test_n_at_the_cap_works(server):
    r = post(server, "/v1/completions", {"prompt": "Amen", "max_tokens": 2, "n": 4})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


def test_admission_budgets_the_tokens_requests_can_occupy():
    """KV of 16 blocks (256 tokens): a budget of 512 tokens in flight, each request counted
    as n x (prompt + max_tokens). With 2 x 128 in flight, 2 x 130 more would pass the budget:
    429; a small request still fits; once the big one ends, the second is admitted."""
    app = make_app(None, device="cpu", num_kv_blocks=16, limits=LIMITS)
    p = len(app.state.server.tokenizer.encode("Amen"))
    assert app.state.server.engine.max_inflight_tokens == 512
    big = {"prompt": "Amen", "n": 2, "max_tokens": 128 - p, "ignore_eos": True, "stream": True}
    second = {"prompt": "Amen", "n": 2, "max_tokens": 130 - p, "stream": True}
    with running(app) as base:
        async def first_event(http: httpx.AsyncClient, body: dict) -> int:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code == 200:
                    await anext(r.aiter_lines())  # then hang up: the request is aborted
                return r.status_code

        async def scene() -> tuple[int, int, int]:
            async with httpx.AsyncClient(base_url=base, timeout=120) as http:
                async with http.stream("POST", "/v1/completions", json=big) as r:
                    assert r.status_code == 200
                    lines = r.aiter_lines()
                    await anext(lines)
                    refused_now = await first_event(http, second)
                    small = await http.post("/v1/completions", json={
                        "prompt": "Amen", "max_tokens": 8})
                    async for _ in lines:
                        pass
                return refused_now, small.status_code, await first_event(http, second)

        assert asyncio.run(scene()) == (429, 200, 200)
        assert refused(base, "inflight_tokens") == 1


# -- 3b. large answers: bounded, and built off the event loop ------------------------------------
@pytest.mark.parametrize(("path", "body"), [
    (CHAT, {"messages": ASK, "n": 3, "max_tokens": 100, "logprobs": True, "top_logprobs": 20}),
    (CHAT, {"messages": ASK, "max_tokens": 300, "logprobs": True, "top_logprobs": 20}),
    ("/v1/completions", {"prompt": "Amen", "n": 4, "max_tokens": 300, "logprobs": 5}),
    # each prompt of the batch is within the limit (1500), the four together are not
    ("/v1/completions", {"prompt": ["Amen"] * 4, "max_tokens": 300, "logprobs": 4}),
])
def test_logprobs_volume_is_capped(server, path, body):
    before = refused(server, "logprobs")
    assert_400(post(server, path, body), "logprobs", "limit is 5000")
    assert refused(server, "logprobs") == before + 1


def test_a_large_answer_is_built_off_the_event_loop(server, monkeypatch):
    threads = []
    original = routes.encode_json

    def spy(obj):  # noqa: ANN001, ANN202
        threads.append(threading.current_thread().name)
        return original(obj)

    monkeypatch.setattr(routes, "encode_json", spy)
    small = post(server, CHAT, {"messages": ASK, "max_tokens": 4})
    big = post(server, CHAT, {"messages": ASK, "n": 2, "max_tokens": 100, "logprobs": True,
                              "top_logprobs": 20, "ignore_eos": True})
    assert small.status_code == big.status_code == 200
    assert len(threads) == 1 and threads[0].startswith("respond")
    choices = big.json()["choices"]
    assert [len(c["logprobs"]["content"]) for c in choices] == [100, 100]
    assert all(len(e["top_logprobs"]) == 20 for c in choices for e in c["logprobs"]["content"])


@pytest.mark.parametrize("obj", [
    {"a": [1, 2.5, None, True, "é\u2603"], "b": {"c": list(range(40))}},
    [{"x": [[i, {"y": "z" * i}] for i in range(30)]}],
    {"deep": [[[[list(range(20))]]]], "empty": [], "e": {}},
])
def test_encode_json_is_the_compact_json_of_the_object(obj):
    assert responses.encode_json(obj) == json.dumps(
        obj, ensure_ascii=False, separators=(",", ":")).encode()


# -- 4a. a body framed twice is refused, the connection closed --------------------------------
SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


def chunked_with_length(te: bytes, cl: bytes, first: bool) -> bytes:
    body = b'{"prompt": "Amen", "max_tokens": 2}'
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    headers = [te, cl] if first else [cl, te]
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + chunked + SMUGGLED)


@pytest.mark.parametrize("request_bytes", [
    chunked_with_length(b"Transfer-Encoding: chunked", b"Content-Length: 6", True),
    chunked_with_length(b"Transfer-Encoding: chunked", b"Content-Length: 6", False),
    chunked_with_length(b"transfer-encoding: CHUNKED", b"content-length: 0", True),
    chunked_with_length(b"TRANSFER-ENCODING: chunked", b"CONTENT-LENGTH: 100", False),
])
def test_content_length_with_transfer_encoding_is_400_and_closed(server, request_bytes):
    before = refused(server, "smuggling")
    with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1]))) as s:
        s.sendall(request_bytes)
        s.settimeout(10)
        reply = b""
        while part := s.recv(65536):
            reply += part
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"connection: close" in head.lower()
    assert b"RFC 9112" in body and reply.count(b"HTTP/1.1") == 1  # the smuggled GET: no answer
    assert refused(server, "smuggling") == before + 1


def test_chunked_alone_and_length_alone_still_work_on_one_connection(server):
    body = b'{"prompt": "Amen", "max_tokens": 2}'
    requests = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
                + b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1]))) as s:
        s.sendall(requests)
        s.settimeout(30)
        reply = b""
        while reply.count(b"HTTP/1.1 200") < 2:
            part = s.recv(65536)
            assert part, reply
            reply += part


# -- 4b. tool calls only when the grammar terminated; failing streams end properly -------------
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("stop", [{"stop": ['"']}, {"stop": ["{"]}, {"stop": [":"]}])
def test_a_stop_string_inside_the_json_is_not_a_tool_call(server, choice, stop):
    """The call is cut where the stop string fires, so it is dropped as a cut call is: the
    whole answer has no ``tool_calls`` and no JSON as content; a stream, which sends a call as it
    is written, has sent at most the part written before its last chunk, never a whole call:
    no chunk says ``tool_calls``, the last one sends no call, and the arguments sent do not
    parse."""
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": choice, "max_tokens": 40,
            **stop}
    r = post(server, CHAT, body)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop" and not c["message"].get("tool_calls")
    assert c["message"]["content"] == ""
    events = stream_events(server, {**body, "stream": True})
    assert events[-1] == "[DONE]"
    choices = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert choices[-1]["finish_reason"] == "stop" and "tool_calls" not in choices[-1]["delta"]
    assert all(ch["finish_reason"] in (None, "stop") for ch in choices)
    assert not any("{" in (ch["delta"].get("content") or "") for ch in choices)
    deltas = [d["function"] for ch in choices for d in ch["delta"].get("tool_calls", [])]
    assert {d["name"] for d in deltas if "name" in d} <= {"get_weather"}
    with pytest.raises(ValueError):
        json.loads("".join(d.get("arguments", "") for d in deltas))
    assert wait_for(lambda: metric(server, "kv_cache_blocks_used") == 0, 30)


def test_a_complete_tool_call_is_still_one(server):
    r = post(server, CHAT, {"messages": ASK, "tools": [WEATHER], "tool_choice": "required",
                            "max_tokens": 60})
    c = r.json()["choices"][0]
    if c["finish_reason"] == "tool_calls":
        call = c["message"]["tool_calls"][0]["function"]
        assert call["name"] == "get_weather" and "city" in json.loads(call["arguments"])
    else:  # the small model ran out of tokens inside the JSON: plain text
        assert c["finish_reason"] == "length"


def stream_events(base: str, body: dict, path: str = CHAT) -> list[str]:
    with httpx.stream("POST", f"{base}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("when", ["first", "last"])
def test_a_stream_that_fails_ends_with_an_error_event_and_done(server, monkeypatch, when):
    original = routes.chunk_choice

    def broken(shape, c, first):  # noqa: ANN001, ANN202
        if first if when == "first" else c.finish_reason is not None:
            raise KeyError("a bug building an event")
        return original(shape, c, first)

    monkeypatch.setattr(routes, "chunk_choice", broken)
    events = stream_events(server, {"prompt": "Amen", "max_tokens": 30, "stream": True,
                                    "ignore_eos": True}, "/v1/completions")
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
    assert all("choices" in json.loads(e) for e in events[:-2])
    assert len(events) == 2 if when == "first" else len(events) >= 2
    assert wait_for(lambda: metric(server, "kv_cache_blocks_used") == 0, 30)


# -- 4d. fields that would change the output: refused by name; unknown fields ignored ----------
NOT_NEUTRAL = {"typical_p": 0.9, "use_beam_search": True,
               "length_penalty": 0.5, "early_stopping": True, "include_stop_str_in_output": True,
               "skip_special_tokens": False, "spaces_between_special_tokens": False,
               "truncate_prompt_tokens": 10, "allowed_token_ids": [1, 2],
               "bad_words": ["LORD"], "logits_processors": ["x"], "vllm_xargs": {"a": 1},
               "guided_json": {"type": "object"}, "guided_regex": "a+",
               "guided_choice": ["a"], "guided_grammar": "root ::= \"a\"",
               "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ",
               "reasoning_effort": "high", "verbosity": "low", "web_search_options": {}}
CHAT_NOT_NEUTRAL = {"add_generation_prompt": False, "continue_final_message": True,
                    "add_special_tokens": True, "chat_template": "{{ 'x' }}",
                    "chat_template_kwargs": {"a": 1}, "documents": [{"text": "x"}],
                    "echo": True, "prompt_logprobs": 1}


def test_the_refused_tables_are_what_the_tests_cover():
    assert set(NOT_NEUTRAL) == set(REFUSED_FIELDS)
    assert set(CHAT_NOT_NEUTRAL) == set(CHAT_REFUSED_FIELDS)


@pytest.mark.parametrize("field", sorted(NOT_NEUTRAL))
def test_output_changing_fields_are_refused_by_name(server, field):
    before = refused(server, "unsupported_field")
    r = post(server, "/v1/completions", {"prompt": "Amen", "max_tokens": 2,
                                         field: NOT_NEUTRAL[field]})
    assert_400(r, field, field)
    assert refused(server, "unsupported_field") == before + 1


@pytest.mark.parametrize("field", sorted(CHAT_NOT_NEUTRAL))
def test_chat_fields_that_change_the_prompt_are_refused_by_name(server, field):
    r = post(server, CHAT, {"messages": ASK, "max_tokens": 2, field: CHAT_NOT_NEUTRAL[field]})
    assert_400(r, field, field)


def test_neutral_values_and_unknown_fields_are_accepted(server, bundled):
    neutral = {"min_p": 0, "typical_p": 1.0, "min_tokens": 0, "use_beam_search": False,
               "length_penalty": 1, "skip_special_tokens": True, "bad_words": [],
               "include_stop_str_in_output": False, "truncate_prompt_tokens": None,
               "guided_json": None, "metadata": {"tenant": "a"}, "store": False,
               "service_tier": "auto", "x_router_hint": {"pool": 2}, "parallel_tool_calls": True}
    r = post(server, "/v1/completions", {"prompt": "In the beginning", "max_tokens": 8,
                                         "temperature": 0, "ignore_eos": True, **neutral})
    assert r.status_code == 200, r.text
    model, tok = bundled
    ref = il.generate_naive(model, tok, "In the beginning", max_tokens=8, ignore_eos=True)
    assert r.json()["choices"][0]["text"] == ref.text
    chat = post(server, CHAT, {"messages": ASK, "max_tokens": 2, "add_generation_prompt": True,
                               "continue_final_message": False, "echo": False})
    assert chat.status_code == 200, chat.text
