"""ASGI middleware that runs before any body is parsed: the API key, the body limit (declared or
chunked), a bound on how long a body may take to arrive, and a last net that turns an unexpected
exception into a JSON 500 without breaking the keep-alive connection."""

from __future__ import annotations

import asyncio
import logging
import secrets

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infer_lab.serve.protocol import error_body

log = logging.getLogger("infer_lab.serve")

DOCS_PATHS = ("/docs", "/redoc", "/openapi.json")
_TOO_LARGE = object()
DRAIN_FACTOR = 4  # a body up to 4x the limit is read (and dropped) so that its 413 arrives


async def _send_json(send: Send, body: dict, status: int,
                     headers: dict[str, str] | None = None) -> None:
    response = JSONResponse(body, status, headers=headers)
    await response({"type": "http"}, _no_body, send)


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


class ApiKey:
    """Check ``Authorization: Bearer KEY`` (scheme in any case) before the body is read.

    ``/v1/*`` is always guarded; ``/metrics`` and the docs routes too when ``guard_all``;
    ``/health`` stays open for load balancers."""

    def __init__(self, app: ASGIApp, api_key: str, guard_all: bool = False) -> None:
        self.app, self.key, self.guard_all = app, api_key.encode(), guard_all

    def _guarded(self, path: str) -> bool:
        if path.startswith("/v1/") or path == "/v1":
            return True
        return self.guard_all and (path == "/metrics" or path.startswith(DOCS_PATHS))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._guarded(scope["path"]):
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, given = header.strip().partition(b" ")
        if scheme.lower() == b"bearer" and secrets.compare_digest(given.strip(), self.key):
            return await self.app(scope, receive, send)
        await _send_json(send, error_body("invalid or missing API key", "authentication_error",
                                          code="invalid_api_key"), 401,
                         {"WWW-Authenticate": 'Bearer realm="infer_lab"'})


class BodyLimit:
    """Read the whole body (at most ``max_bytes``, within ``timeout`` seconds) before the app
    sees it: over the limit is 413 whether declared or chunked; too slow is 408."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float = 30.0) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        too_large = error_body(f"the request body is over {self.max_bytes} bytes")
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > DRAIN_FACTOR * self.max_bytes:
            return await _send_json(send, too_large, 413, {"Connection": "close"})
        try:
            body, complete = await asyncio.wait_for(self._read(receive), self.timeout)
        except asyncio.TimeoutError:
            return await _send_json(send, error_body("the request body did not arrive in "
                                                     f"{self.timeout:g} s"), 408,
                                    {"Connection": "close"})
        if body is None:  # the client went away mid-body
            return None
        if body is _TOO_LARGE:  # read to its end (if not absurd), so the client reads the 413
            return await _send_json(send, too_large, 413,
                                    None if complete else {"Connection": "close"})
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> tuple[bytes | object | None, bool]:
        """(body, whole body read); the body is ``_TOO_LARGE`` past the limit (read on, and
        dropped, up to ``DRAIN_FACTOR`` times it) and None if the client disconnected."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, True
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size > self.max_bytes:
                parts.clear()
                if not more or size > DRAIN_FACTOR * self.max_bytes:
                    return _TOO_LARGE, not more
                continue
            parts.append(chunk)
            if not more:
                return b"".join(parts), True


class ConcurrencyLimit:
    """At most ``holder.max_concurrency`` requests in the app at once; beyond it, a JSON 503
    with ``Retry-After`` (uvicorn's own limit, set above this one, answers plain text).

    ``/health`` is not counted: a load balancer must still see a busy server as alive. The limit
    is read from ``holder`` on each request so that ``make_server`` can set it after the app is
    built; None means no limit."""

    def __init__(self, app: ASGIApp, holder: object) -> None:
        self.app, self.holder, self.active = app, holder, 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = getattr(self.holder, "max_concurrency", None)
        if scope["type"] != "http" or limit is None or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        if self.active >= limit:
            return await _send_json(send, error_body(
                f"the server is at its limit of {limit} concurrent requests", "server_error",
                code="too_many_connections"), 503, {"Retry-After": "1"})
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


class CatchAll:
    """An exception no handler expected: log it here, answer a JSON 500, keep the connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            log.exception("unexpected error in %s %s", scope["method"], scope["path"])
            if not started:
                await _send_json(send, error_body("the server failed on this request",
                                                  "server_error"), 500)
