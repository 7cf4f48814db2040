"""Capture what vllm-router's PD mode really sends, request by request (Chapter 13).

Starts a prefill worker and a decode worker (``infer-lab serve --kv-role ...``, the bundled
model), puts a recording proxy in front of each, runs ``vllm-router --vllm-pd-disaggregation``
(0.1.17, unchanged) against the proxies, sends one greedy completion, and writes every request
the router made and every answer it got to ``benchmarks/results/pd_protocol.json``.

    python -m benchmarks.pd_protocol
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from benchmarks._common import provenance, write_results
from infer_lab.serve.launch import free_port, launch

ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")


def recording_proxy(name: str, target: str, log: list[dict[str, Any]]) -> ThreadingHTTPServer:
    """Forwards to ``target`` and logs each POST and its answer (GETs are health checks)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _forward(self, method: str) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            r = httpx.request(method, target + self.path, content=body or None, timeout=300,
                              headers={"content-type": "application/json"})
            if method == "POST":
                log.append({"to": name, "path": self.path, "request": json.loads(body),
                            "status": r.status_code, "response": r.json(),
                            "x-request-id": self.headers.get("x-request-id")})
            self.send_response(r.status_code)
            self.send_header("content-type", r.headers.get("content-type", "text/plain"))
            self.send_header("content-length", str(len(r.content)))
            self.end_headers()
            self.wfile.write(r.content)

        def do_GET(self) -> None:
            self._forward("GET")

        def do_POST(self) -> None:
            self._forward("POST")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main() -> None:
    os.environ.setdefault("INFER_LAB_KV_TOKEN", "capture")
    kv_port = free_port()
    common = ("--device", "cpu", "--dtype", "fp32", "--num-kv-blocks", "64")
    prefill = launch(*common, "--kv-role", "prefill", "--kv-transfer-port", str(kv_port),
                     timeout=300)
    decode = launch(*common, "--kv-role", "decode", "--kv-peers", f"127.0.0.1:{kv_port}",
                    timeout=300)
    log: list[dict[str, Any]] = []
    proxies = [recording_proxy("prefill", prefill.base, log),
               recording_proxy("decode", decode.base, log)]
    port = free_port()
    router = subprocess.Popen(
        [ROUTER, "--vllm-pd-disaggregation",
         "--prefill", f"http://127.0.0.1:{proxies[0].server_address[1]}",
         "--decode", f"http://127.0.0.1:{proxies[1].server_address[1]}",
         "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = {"prompt": "In the beginning God created the heaven and "
                  "the earth. And the earth was without form, and void;", "max_tokens": 8,
                  "temperature": 0}
        answer = httpx.post(f"{base}/v1/completions", json=client, timeout=300).json()
    finally:
        router.kill()
        router.wait()
        for p in proxies:
            p.shutdown()
        prefill.stop()
        decode.stop()
    version = subprocess.run([sys.executable, "-m", "pip", "show", "vllm-router"],
                             capture_output=True, text=True).stdout
    payload = {"provenance": provenance("cpu"),
               "router": next((line.split(": ")[1] for line in version.splitlines()
                               if line.startswith("Version")), "unknown"),
               "client_request": client, "exchanges": log, "client_answer": answer}
    for i, x in enumerate(log):
        print(f"{i + 1}. router -> {x['to']} {x['path']}: kv_transfer_params="
              f"{x['request'].get('kv_transfer_params')}")
    print("wrote", write_results("pd_protocol", payload))


if __name__ == "__main__":
    main()
