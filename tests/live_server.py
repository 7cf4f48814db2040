"""A real uvicorn server on a free loopback port, in a background thread, for the tests."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx

from infer_lab.serve.server import make_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(app, **options) -> Iterator[str]:  # noqa: ANN001, ANN003
    """Serve ``app`` until the block ends (``options`` go to ``make_server``); yields its URL."""
    port = free_port()
    server = make_server(app, "127.0.0.1", port, **options)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def serve_process(port: int, *extra: str, stdout: int = subprocess.DEVNULL) -> subprocess.Popen:
    """``infer-lab serve`` on the bundled model as a child process (signals, limits and exits
    are the real ones), returned once ``/health`` answers; fails with its stderr if it dies."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "infer_lab.cli", "serve", "--port", str(port), "--device", "cpu",
         *extra], stdout=stdout, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


def metric(base: str, name: str, prefix: str = "infer_lab", **headers: str) -> float:
    """Current value of one unlabelled-by-us Prometheus series of the server."""
    for line in httpx.get(f"{base}/metrics", headers=headers).text.splitlines():
        if line.startswith(f"{prefix}:{name}{{") or line.startswith(f"{prefix}:{name} "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_for(predicate, timeout: float = 30.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()
