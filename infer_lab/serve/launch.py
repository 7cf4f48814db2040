"""Start ``infer-lab serve`` as a child process and wait for it: what a chapter or a benchmark
needs to talk to a real server, without a page of port-picking and polling in its reading path."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO

import httpx


def free_port() -> int:
    """A loopback port nobody is listening on (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A running ``infer-lab serve``: its process and base URL (``http://127.0.0.1:PORT``)."""

    process: subprocess.Popen
    base: str
    log: IO[str]

    def metric(self, name: str, prefix: str = "infer_lab") -> float:
        """The current value of one series of ``/metrics`` (the first, whatever its labels)."""
        for line in httpx.get(f"{self.base}/metrics", timeout=30).text.splitlines():
            if line.startswith((f"{prefix}:{name}{{", f"{prefix}:{name} ")):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (the server drains), then the exit code."""
        self.process.terminate()
        try:
            return self.process.wait(timeout=timeout)
        finally:
            self.log.close()


def launch(*args: str, timeout: float = 120.0) -> ServerProcess:
    """``infer-lab serve ARGS`` on a free loopback port, returned once ``/health`` says 200.

    Raises ``RuntimeError`` with the server's stderr if it exits or does not come up in time."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # stderr into a file, not a pipe nobody reads (a full pipe would block the server); it lives
    # as long as the process, so ServerProcess.stop closes it
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "infer_lab.cli", "serve", "--port", str(port),
                             *args], stdout=subprocess.DEVNULL, stderr=log, text=True)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read()[-2000:]
            log.close()
            raise RuntimeError(f"the server exited with {proc.returncode}: {tail}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return ServerProcess(proc, base, log)
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            log.close()
            raise RuntimeError(f"the server did not answer /health within {timeout:g} s")
        time.sleep(0.2)
