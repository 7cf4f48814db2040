"""Wiring: load a model, build an engine and its app, run uvicorn with bounded connections and
a graceful drain on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import h11
import torch
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from infer_lab.device import default_device
from infer_lab.engine import LLMEngine
from infer_lab.engine.config import EngineConfig
from infer_lab.model.loader import load, resolve_model_path
from infer_lab.model.tokenizer import check_chat_template
from infer_lab.serve.app import build_app
from infer_lab.serve.async_engine import AsyncEngine
from infer_lab.serve.limits import ServerLimits
from infer_lab.serve.metrics import ServerMetrics
from infer_lab.serve.protocol import error_body
from infer_lab.serve.tool_formats import DEFAULT_TOOL_CALL_PARSER, call_format

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
    limits: ServerLimits | None = None,
    chat_template: str | None = None,
    tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER,
    **engine_args: Any,
) -> FastAPI:
    """An app serving ``model`` (the bundled one by default) with one :class:`EngineConfig`
    (``config``, with ``engine_args`` replacing its fields), the request limits ``limits``
    and ``chat_template`` (a template's text) in place of the model's, checked first, as is
    ``tool_call_parser`` (the format of "auto" tool calls)."""
    if chat_template is not None:
        check_chat_template(chat_template)  # before the model loads: a startup error
    call_format(tool_call_parser)
    path = resolve_model_path(model)
    name = model_id(model, path, served_model_name)
    config = EngineConfig.from_kwargs(config, **engine_args)
    limits = limits or ServerLimits()
    engine = AsyncEngine(load_engine(path, config, device=device, dtype=dtype),
                         ServerMetrics(name, vllm_names=vllm_metric_names),
                         max_waiting_requests=max_waiting_requests,
                         max_waiting_tokens=max_waiting_tokens,
                         max_inflight_tokens=limits.max_inflight_tokens)
    return build_app(engine, name, api_key=api_key, max_body_bytes=max_body_bytes,
                     guard_all=api_key_all_routes, body_timeout=body_timeout, limits=limits,
                     chat_template=chat_template, tool_call_parser=tool_call_parser)


def load_engine(path: Path, config: EngineConfig, *, device: str | None = None,
                dtype: str | None = None) -> LLMEngine:
    """Load the model and build its engine; on a CPU, in a thread that then ends.

    torch's CPU kernels run on OpenMP, which keeps a team of worker threads for each thread that
    ever ran a parallel op. Once it manages more threads than there are cores, a waiting thread
    spins only briefly before sleeping in the kernel (libgomp's throttled spin count), so every
    op that opens a parallel region (the matmuls) pays a wake-up: loaded in the main thread and
    stepped in the engine loop's, two teams on two cores cut one stream's decode by more than
    half (``benchmarks/results/peers.json``, ``server.before_load_thread``). A thread's team
    ends with it, which leaves the engine loop's the only one."""
    def build() -> LLMEngine:
        model, tokenizer = load(path, device=device, dtype=dtype,
                                quantization=config.quantization)  # Chapter 8
        return LLMEngine(model, tokenizer, config)

    if (torch.device(device) if device is not None else default_device()).type != "cpu":
        return build()
    with ThreadPoolExecutor(1, thread_name_prefix="load") as pool:
        return pool.submit(build).result()


class StrictConnection(h11.Connection):
    """h11's side of a connection, refusing a request whose body is framed twice.

    h11 lets ``Transfer-Encoding: chunked`` win over a ``Content-Length`` in the same head and
    keeps the connection alive (RFC 7230 allowed it); a proxy in front that trusts the length
    would then forward the bytes after the last chunk as a second request of its own: request
    smuggling. RFC 9112 section 6.3 says such a message "ought to be handled as an error" and
    the connection closed; this raises h11's ``RemoteProtocolError``, which the protocol answers
    with 400 and ``Connection: close``."""

    refused: str | None = None

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name for name, _ in event.headers}  # h11 lowercases them
            if b"transfer-encoding" in names and b"content-length" in names:
                self.refused = "smuggling"
                raise h11.RemoteProtocolError(SMUGGLING, error_status_hint=400)
        return event


SMUGGLING = ("a request with both Content-Length and Transfer-Encoding is refused "
             "(RFC 9112, section 6.3)")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus three guards.

    - A deadline for a request's head: a socket that opens, or sends half a header, and then
      stalls is closed after ``HEADER_TIMEOUT`` seconds.
    - A deadline for a send: when the client stops reading, the socket's buffers fill, the
      transport pauses writing and every send waits; after ``SEND_TIMEOUT`` seconds paused the
      connection is aborted, the app sees a disconnect and the request is aborted with it.
      ``SEND_BUFFER`` bounds the socket's send buffer (what a client that does not read can
      park in the kernel; Linux grows it to 4 MB otherwise).
    - :class:`StrictConnection`'s refusal of a body framed twice (400, closed).

    ``on_refuse(reason)`` counts the last two in ``/metrics``."""

    HEADER_TIMEOUT = 10.0
    SEND_TIMEOUT = 10.0
    SEND_BUFFER = 0  # the socket's send buffer in bytes (0: the OS's, which grows to MBs)
    on_refuse: Callable[[str], None] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = StrictConnection(
            h11.SERVER, self.config.h11_max_incomplete_event_size or 16 * 1024)
        self._send_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if self.SEND_BUFFER and sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.SEND_BUFFER)
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

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None and self.SEND_TIMEOUT > 0:
            self._send_timer = self.loop.call_later(self.SEND_TIMEOUT, self._send_timeout)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_send_timer()

    def _send_timeout(self) -> None:
        self._send_timer = None
        log.warning("a client did not read for %g s: connection aborted", self.SEND_TIMEOUT)
        self._refused("send_timeout")
        self.transport.abort()  # close() would wait for the buffer to drain: it never does

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _refused(self, reason: str) -> None:
        if self.on_refuse is not None:
            self.on_refuse(reason)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a malformed request, as OpenAI-shaped JSON, then close."""
        reason = getattr(self.conn, "refused", None)
        if reason:
            self._refused(reason)
        body = json.dumps(error_body(SMUGGLING if reason else msg)).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:
            pass  # the response had begun: just close
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._cancel_send_timer()
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
    ``timeout_keep_alive`` s, a stalled head after ``header_timeout`` s, a send the client does
    not read after the app's ``send_timeout``; SIGTERM/SIGINT drain for ``grace`` s. uvicorn's
    own limit, which counts idle keep-alive connections too and answers plain text, is set
    above ours as a backstop."""
    state = getattr(getattr(app, "state", None), "server", None)
    guards: dict[str, Any] = {"HEADER_TIMEOUT": header_timeout}
    if state is not None:
        state.max_concurrency = limit_concurrency
        guards["SEND_TIMEOUT"] = state.limits.send_timeout
        guards["SEND_BUFFER"] = state.limits.send_buffer_bytes
        if state.engine.metrics is not None:
            guards["on_refuse"] = staticmethod(state.engine.metrics.refuse)
    backstop = None if limit_concurrency is None else 2 * limit_concurrency + 64
    protocol = type("H11Protocol", (GuardedH11Protocol,), guards)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                            limit_concurrency=backstop,
                            timeout_keep_alive=timeout_keep_alive,
                            timeout_graceful_shutdown=int(grace) + 5,
                            h11_max_incomplete_event_size=64 * 1024)
    return DrainingServer(config, grace)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, **options: Any) -> None:
    """Serve until SIGTERM or SIGINT, then drain."""
    make_server(app, host, port, **options).run()
