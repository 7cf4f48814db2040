"""The FastAPI app: the routes of :mod:`infer_lab.serve.routes` over one :class:`AsyncEngine`,
reached by the handlers through ``app.state.server``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from infer_lab.serve.async_engine import AsyncEngine
from infer_lab.serve.errors import install_handlers
from infer_lab.serve.middleware import ApiKey, BodyLimit, CatchAll
from infer_lab.serve.routes import router
from infer_lab.serve.state import ServerState


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    server: ServerState = app.state.server
    server.engine.start()
    try:
        yield
    finally:
        server.engine.shutdown()
        server.pool.shutdown(wait=False, cancel_futures=True)


def build_app(
    engine: AsyncEngine,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 1 << 20,
    max_model_len: int | None = None,
    *,
    guard_all: bool = False,
    body_timeout: float = 30.0,
) -> FastAPI:
    """The HTTP face of an engine, started and stopped with the app. With ``api_key``, the
    ``/v1`` routes need it (and ``/metrics`` and the docs too when ``guard_all``)."""
    app = FastAPI(title="infer_lab", version="0.1.0", lifespan=_lifespan)
    context = max_model_len or engine.engine.max_model_len
    app.state.server = ServerState(engine, model_name, context)
    install_handlers(app)
    app.include_router(router)
    # added last = runs first: the key, then the body limit, then the JSON-500 net
    app.add_middleware(CatchAll)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout=body_timeout)
    if api_key is not None:
        app.add_middleware(ApiKey, api_key=api_key, guard_all=guard_all)
    return app
