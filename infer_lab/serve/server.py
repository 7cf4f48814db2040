"""Wiring: load a model, build an engine and its app, run uvicorn with bounded connections and
a graceful drain on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from infer_lab.engine import LLMEngine
from infer_lab.engine.config import EngineConfig
from infer_lab.model.loader import load, resolve_model_path
from infer_lab.serve.app import build_app
from infer_lab.serve.async_engine import AsyncEngine
from infer_lab.serve.metrics import ServerMetrics

log = logging.getLogger("infer_lab.serve")


def model_id(model: str | os.PathLike | None, path: Path, served_model_name: str | None) -> str:
    """The name clients see: ``--served-model-name``, else a hub id as given, else the
    directory's name or a ``.gguf`` file's stem. Never a full local path."""
    if served_model_name:
        return served_model_name
    if model is not None and not Path(model).exists():
        return str(model)  # a named model (hub id)
    return path.stem if path.suffix == ".gguf" else path.name


def make_app(
    model: str | os.PathLike | None = None,
    *,
    config: EngineConfig | None = None,
    served_model_name: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    api_key: str | None = None,
    api_key_all_routes: bool = False,
    max_body_bytes: int = 1 << 20,
    body_timeout: float = 30.0,
    max_waiting_requests: int = 256,
    max_waiting_tokens: int = 1 << 18,
    vllm_metric_names: bool = False,
    **engine_args: Any,
) -> FastAPI:
    """An app serving ``model`` (the bundled one by default) with one :class:`EngineConfig`
    (``config``, with ``engine_args`` replacing its fields)."""
    path = resolve_model_path(model)
    name = model_id(model, path, served_model_name)
    config = EngineConfig.from_kwargs(config, **engine_args)
    llm_model, tokenizer = load(path, device=device, dtype=dtype,
                                quantization=config.quantization)  # Chapter 8
    engine = AsyncEngine(LLMEngine(llm_model, tokenizer, config),
                         ServerMetrics(name, vllm_names=vllm_metric_names),
                         max_waiting_requests=max_waiting_requests,
                         max_waiting_tokens=max_waiting_tokens)
    return build_app(engine, name, api_key=api_key, max_body_bytes=max_body_bytes,
                     guard_all=api_key_all_routes, body_timeout=body_timeout)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for a request's head: a socket that opens, or
    sends half a header, and then stalls is closed after ``HEADER_TIMEOUT`` seconds."""

    HEADER_TIMEOUT = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.HEADER_TIMEOUT, self._head_timeout)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and self._head_timer is None:  # a new head began
            self._head_timer = self.loop.call_later(self.HEADER_TIMEOUT, self._head_timeout)
        elif self.conn.their_state is not h11.IDLE and self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._head_timer is not None:  # idle keep-alive: uvicorn's own timer covers it
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        idle = self.cycle is None or self.cycle.response_complete
        if self.conn.their_state is h11.IDLE and idle:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)


class DrainingServer(uvicorn.Server):
    """On SIGTERM or SIGINT: stop accepting, answer 503 to new requests, let the requests in
    flight finish for ``grace`` seconds, then end the rest with an error event; exit normally
    (no re-raised signal, no traceback)."""

    def __init__(self, config: uvicorn.Config, grace: float = 10.0) -> None:
        super().__init__(config)
        self.grace = grace

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if not _main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # stop accepting
        state = getattr(getattr(self.config.app, "state", None), "server", None)
        if state is not None:
            state.engine.draining = True
            if not await state.engine.wait_idle(self.grace):
                ended = state.engine.end_all("the server is shutting down")
                log.warning("grace period over: ended %d requests", ended)
                await asyncio.sleep(0.2)  # let the streams send their last events
        await super().shutdown(sockets)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *,
                grace: float = 10.0, limit_concurrency: int | None = 1024,
                timeout_keep_alive: int = 5, header_timeout: float = 10.0,
                log_level: str = "warning") -> DrainingServer:
    """A uvicorn server with bounded connections: at most ``limit_concurrency`` requests (a
    JSON 503 beyond, from :class:`ConcurrencyLimit`), idle keep-alive closed after
    ``timeout_keep_alive`` s, a stalled head after ``header_timeout`` s; SIGTERM/SIGINT drain
    for ``grace`` s. uvicorn's own limit, which counts idle keep-alive connections too and
    answers plain text, is set above ours as a backstop."""
    state = getattr(getattr(app, "state", None), "server", None)
    if state is not None:
        state.max_concurrency = limit_concurrency
    backstop = None if limit_concurrency is None else 2 * limit_concurrency + 64
    protocol = type("H11Protocol", (GuardedH11Protocol,), {"HEADER_TIMEOUT": header_timeout})
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                            limit_concurrency=backstop,
                            timeout_keep_alive=timeout_keep_alive,
                            timeout_graceful_shutdown=int(grace) + 5,
                            h11_max_incomplete_event_size=64 * 1024)
    return DrainingServer(config, grace)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, **options: Any) -> None:
    """Serve until SIGTERM or SIGINT, then drain."""
    make_server(app, host, port, **options).run()
