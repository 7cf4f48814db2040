"""``infer-lab serve --limit-concurrency N``: the (N+1)-th request in progress gets OpenAI-shaped
JSON 503 with ``Retry-After`` (not uvicorn's plain text), ``/health`` still answers, and the
slots come back when the requests holding them end."""

from __future__ import annotations

import socket
import subprocess
import threading

import httpx

from infer_lab.serve import routes
from infer_lab.serve.server import make_app
from tests.live_server import free_port, running, serve_process, wait_for


def start_server(port: int, *extra: str) -> subprocess.Popen:
    return serve_process(port, "--num-kv-blocks", "32", *extra)


def hold_a_slot(port: int) -> socket.socket:
    """A request whose body has not finished arriving: it is in the app, holding a slot."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    return s


def test_limit_concurrency_answers_json_503_beyond_it():
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(port, "--limit-concurrency", "2")
    body = {"prompt": "In the beginning", "max_tokens": 4, "temperature": 0}
    held: list[socket.socket] = []
    try:
        held = [hold_a_slot(port), hold_a_slot(port)]
        assert wait_for(lambda: httpx.post(f"{base}/v1/completions", json=body,
                                           timeout=30).status_code == 503, timeout=60)
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.headers["content-type"] == "application/json"
        assert int(r.headers["retry-after"]) >= 1
        error = r.json()["error"]
        assert error["type"] == "server_error" and "limit of 2 concurrent" in error["message"]
        assert httpx.get(f"{base}/health", timeout=30).status_code == 200
        for s in held:
            s.close()
        assert wait_for(lambda: httpx.post(f"{base}/v1/completions", json=body,
                                           timeout=30).status_code == 200, timeout=60)
    finally:
        for s in held:
            s.close()
        proc.terminate()
        proc.wait(timeout=30)


def test_large_bodies_are_validated_off_the_event_loop(monkeypatch):
    """A body over 64 KB is parsed in a worker thread (a stream in flight sees no gap for it);
    its errors keep their shape: a 400 naming the field."""
    seen: list[tuple[int, str]] = []
    original = routes.validate_body

    def spy(model, raw: bytes):  # noqa: ANN001, ANN202
        seen.append((len(raw), threading.current_thread().name))
        return original(model, raw)

    monkeypatch.setattr(routes, "validate_body", spy)
    app = make_app(None, device="cpu", num_kv_blocks=64, max_model_len=2048)
    with running(app) as base:
        small = httpx.post(f"{base}/v1/completions", timeout=60,
                           json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert small.status_code == 200, small.text
        ids = [7] * 50_000  # ~100 KB of JSON: too long for the context, refused after parsing
        big = httpx.post(f"{base}/v1/completions", timeout=60,
                         json={"prompt": ids, "max_tokens": 2})
        bad = httpx.post(f"{base}/v1/completions", timeout=60,
                         json={"prompt": ids[:-1] + [-1], "max_tokens": 2})
    assert big.status_code == 400 and "context" in big.json()["error"]["message"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    assert "token ids" in bad.json()["error"]["message"]
    (small_size, small_thread), *large = seen
    assert small_size < 100 and not small_thread.startswith("tokenize")
    assert len(large) == 2 and all(size > 64 * 1024 and thread.startswith("tokenize")
                                   for size, thread in large)
