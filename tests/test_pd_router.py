"""Chapter 13's prefill/decode disaggregation, driven by the real vllm-router (0.1.17, unchanged)
in its PD mode against two ``infer-lab serve`` workers on loopback: greedy tokens equal a
colocated server's; faults cost a recompute or a clear error; every KV block comes back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from infer_lab.serve.launch import ServerProcess, free_port, launch
from tests.live_server import metric, wait_for

TOKEN = "pd-test-token"
ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
TEXT = ("In the beginning God created the heaven and the earth. And the earth was without form, "
        "and void; and darkness was upon the face of the deep. And the Spirit of God moved upon "
        "the face of the waters. And God said, Let there be light: and there was light. ")
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


def start_router(prefill: str, decode: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [ROUTER, "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
         "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    ok = wait_for(lambda: _healthy(base) or proc.poll() is not None, timeout=60)
    assert ok and proc.poll() is None, "vllm-router did not come up"
    return proc, base


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def cluster():
    """A prefill worker, a decode worker and the router in front. The prefill worker answers a
    request without ``kv_transfer_params`` as any colocated server does (its own blocks, its
    own decode): it is the reference. (Not the decode worker: its prefix cache would then hold
    its own blocks for the prompt and the transferred ones would go unused.)"""
    old = os.environ.get("INFER_LAB_KV_TOKEN")
    os.environ["INFER_LAB_KV_TOKEN"] = TOKEN
    kv_port = free_port()
    common = ("--device", "cpu", "--dtype", "fp32", "--num-kv-blocks", "64")
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(launch, *common, "--kv-role", "prefill", "--kv-transfer-port",
                            str(kv_port), "--kv-pin-timeout", "12", timeout=300),
                pool.submit(launch, *common, "--kv-role", "decode", "--kv-peers",
                            f"127.0.0.1:{kv_port}", timeout=300),
            ]
            servers: list[ServerProcess] = [f.result() for f in futures]
    finally:
        if old is None:
            os.environ.pop("INFER_LAB_KV_TOKEN")
        else:
            os.environ["INFER_LAB_KV_TOKEN"] = old
    prefill, decode = servers
    router, base = start_router(prefill.base, decode.base)
    yield {"prefill": prefill, "decode": decode, "colocated": prefill.base, "router": base,
           "kv_port": kv_port}
    router.kill()
    router.wait(timeout=30)
    for s in servers:
        if s.process.poll() is None:
            s.stop()


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=120)


def completion(base: str, prompt: str, **extra) -> dict:
    r = post(base, "/v1/completions", {"prompt": prompt, **GREEDY, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def blocks_back(*servers: ServerProcess) -> bool:
    return wait_for(lambda: all(metric(s.base, "kv_cache_blocks_used") == 0 for s in servers),
                    timeout=30)


def check_router_pd_tokens_equal_colocated(cluster) -> None:
    for i, n in enumerate((1, 3)):
        prompt = f"{i}. " + TEXT * n
        want = completion(cluster["colocated"], prompt)["choices"][0]["text"]
        hits_before = metric(cluster["decode"].base, "prefix_cache_hits_total")
        got = completion(cluster["router"], prompt)
        assert got["choices"][0]["text"] == want
        assert "kv_transfer_params" not in got  # the router answers with the decode's body
        # the decode worker received every prompt token's K/V but the last (the full blocks
        # and the partial last one) and computed only that one
        hits = metric(cluster["decode"].base, "prefix_cache_hits_total") - hits_before
        assert hits == got["usage"]["prompt_tokens"] - 1
    chat = {"messages": [{"role": "user", "content": TEXT}], **GREEDY}
    want = post(cluster["colocated"], "/v1/chat/completions", chat).json()
    got = post(cluster["router"], "/v1/chat/completions", chat).json()
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    stream = httpx.post(f"{cluster['router']}/v1/completions", timeout=120,
                        json={"prompt": TEXT, **GREEDY, "stream": True})
    text = "".join(json.loads(line[6:])["choices"][0]["text"]
                   for line in stream.text.splitlines()
                   if line.startswith("data: {") and json.loads(line[6:])["choices"])
    assert text == completion(cluster["colocated"], TEXT)["choices"][0]["text"]
    assert blocks_back(cluster["prefill"], cluster["decode"])


def prefill_params(cluster, prompt: str) -> dict:
    """Stage one by hand, as the router does it."""
    body = completion(cluster["prefill"].base, prompt, max_tokens=1, stream=False, min_tokens=1,
                      kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                          "remote_engine_id": None, "remote_block_ids": None,
                                          "remote_host": None, "remote_port": None})
    params = body["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_port"] == cluster["kv_port"]
    assert params["tp_size"] == 1
    # the blocks of every prompt token but the last, the partial last block included
    assert len(params["remote_block_ids"]) == -(-(body["usage"]["prompt_tokens"] - 1) // 16)
    return params


def check_faults_recompute_or_refuse_never_wrong_tokens(cluster) -> None:
    prompt = "Faults. " + TEXT * 2
    want = completion(cluster["colocated"], prompt)["choices"][0]["text"]
    decode = cluster["decode"].base
    params = prefill_params(cluster, prompt)
    # another request's blocks, or blocks that do not exist: the endpoint refuses, the decode
    # worker recomputes
    for bad in ({"remote_request_id": "cmpl-someone-else"}, {"remote_block_ids": [10**6]}):
        got = completion(decode, prompt, kv_transfer_params={**params, **bad})
        assert got["choices"][0]["text"] == want
    # a peer that is not on the decode worker's list: a 400, it connects nowhere
    r = post(decode, "/v1/completions", {"prompt": prompt, **GREEDY, "kv_transfer_params": {
        **params, "remote_host": "10.0.0.1"}})
    assert r.status_code == 400 and "kv-peers" in r.json()["error"]["message"]
    # malformed params: a 400 naming the field
    for bad in ("yes", {"do_remote_prefill": True, "remote_port": "x"},
                {"do_remote_prefill": True, "do_remote_decode": True},
                {**params, "remote_block_ids": ["1"]}):
        r = post(decode, "/v1/completions", {"prompt": prompt, **GREEDY,
                                             "kv_transfer_params": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    # the right params still work (the endpoint kept the blocks through the refusals)
    assert completion(decode, prompt, kv_transfer_params=params)["choices"][0]["text"] == want
    # a worker without a KV role refuses the params
    # a decode worker does not prefill for others
    r = post(decode, "/v1/completions", {"prompt": prompt, **GREEDY, "kv_transfer_params": {
        "do_remote_decode": True}})
    assert r.status_code == 400
    # pinned but never pulled: the prefill side frees the blocks after its timeout (12 s here)
    prefill_params(cluster, "Abandoned. " + TEXT)
    assert blocks_back(cluster["prefill"], cluster["decode"])


def check_a_dead_prefill_worker_costs_a_recompute(cluster) -> None:
    """Last: it kills the prefill worker."""
    prompt = "Dead. " + TEXT * 2
    want = completion(cluster["colocated"], prompt)["choices"][0]["text"]
    params = prefill_params(cluster, prompt)
    cluster["prefill"].process.kill()
    cluster["prefill"].process.wait(timeout=30)
    t0 = time.monotonic()
    got = completion(cluster["decode"].base, prompt, kv_transfer_params=params)
    assert got["choices"][0]["text"] == want
    assert time.monotonic() - t0 < 60  # no hang
    assert blocks_back(cluster["decode"])


def test_router_pd_end_to_end(cluster):
    """One test, so that parallel test workers start the cluster once: tokens through the
    router equal the colocated answer; the faults; then the prefill worker dies."""
    check_router_pd_tokens_equal_colocated(cluster)
    check_faults_recompute_or_refuse_never_wrong_tokens(cluster)
    check_a_dead_prefill_worker_costs_a_recompute(cluster)


# ---------------------------------------------------------------------- the protocol itself
def _recording_worker(name: str, log: list) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _reply(self, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._reply({"object": "list", "data": []} if "models" in self.path else {})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            log.append((name, self.path, body))
            answer = {"id": name, "object": "text_completion", "choices": [
                {"index": 0, "text": name, "finish_reason": "length"}]}
            if name == "prefill":
                answer["kv_transfer_params"] = PREFILL_ANSWER
            self._reply(answer)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


PREFILL_ANSWER = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
                  "remote_request_id": "r", "remote_block_ids": [3, 1], "remote_host": "h",
                  "remote_port": 7, "tp_size": 1}


def test_what_the_router_sends_in_pd_mode():
    """The protocol the workers implement, captured from vllm-router itself: the prefill stage
    gets max_tokens=1, stream=false and do_remote_decode; the decode stage gets the original
    request and the prefill's kv_transfer_params verbatim."""
    log: list = []
    workers = [_recording_worker(n, log) for n in ("prefill", "decode")]
    urls = [f"http://127.0.0.1:{w.server_address[1]}" for w in workers]
    router, base = start_router(*urls)
    try:
        r = post(base, "/v1/completions", {"prompt": "hi", "max_tokens": 5, "stream": True})
        assert r.status_code == 200
    finally:
        router.kill()  # (its graceful shutdown is not what this test is about)
        router.wait(timeout=30)
        for w in workers:
            w.shutdown()
    (p_name, p_path, first), (d_name, _, second) = log
    assert (p_name, d_name, p_path) == ("prefill", "decode", "/v1/completions")
    assert first["max_tokens"] == 1 and first["stream"] is False and first["min_tokens"] == 1
    assert first["kv_transfer_params"]["do_remote_decode"] is True
    assert first["kv_transfer_params"]["do_remote_prefill"] is False
    assert second["max_tokens"] == 5 and second["stream"] is True
    assert second["kv_transfer_params"] == PREFILL_ANSWER
