"""The FastAPI app: the routes of :mod:`infer_lab.serve.routes` over one :class:`AsyncEngine`,
reached by the handlers through ``app.state.server``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from infer_lab.serve.async_engine import AsyncEngine
from infer_lab.serve.errors import install_handlers
from infer_lab.serve.limits import ServerLimits
from infer_lab.serve.middleware import ApiKey, BodyLimit, CatchAll, ConcurrencyLimit
from infer_lab.serve.routes import BODIES, router
from infer_lab.serve.state import ServerState
from infer_lab.serve.tool_formats import DEFAULT_TOOL_CALL_PARSER

DESCRIPTION = (
    "An OpenAI-compatible server (completions, chat). A field that OpenAI or vLLM define and "
    "that would change the output is honoured, or refused by name with a 400 when it is not "
    "implemented (min_p, typical_p, beam search, guided_*...); a field nobody defines is "
    "ignored, as routers and SDKs add their own. Every limit on a request is an "
    "`infer-lab serve` option, and every refusal is counted in /metrics "
    "(infer_lab:request_refused_total, by reason).")


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    server: ServerState = app.state.server
    server.engine.start()
    try:
        yield
    finally:
        server.engine.shutdown()
        server.close()


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema plus the request bodies, which the handlers parse themselves (off the
    event loop when large) and so do not declare as parameters."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    _, defs = models_json_schema([(m, "validation") for m in BODIES.values()],
                                 ref_template="#/components/schemas/{model}")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
    for path, model in BODIES.items():
        schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    app.openapi_schema = schema
    return schema


def build_app(
    engine: AsyncEngine,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 1 << 20,
    max_model_len: int | None = None,
    *,
    guard_all: bool = False,
    body_timeout: float = 30.0,
    limits: ServerLimits | None = None,
    chat_template: str | None = None,
    tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER,
) -> FastAPI:
    """The HTTP face of an engine, started and stopped with the app. With ``api_key``, the
    ``/v1`` routes need it (and ``/metrics`` and the docs too when ``guard_all``); ``limits``
    bound what one request may cost (the defaults of :class:`ServerLimits` otherwise);
    ``chat_template`` replaces the model's (a ``ValueError`` here if it does not parse);
    ``tool_call_parser`` names the format of "auto" tool calls (``hermes``, ``llama3_json``,
    ``mistral``)."""
    app = FastAPI(title="infer_lab", version="0.1.0", lifespan=_lifespan,
                  description=DESCRIPTION)
    context = max_model_len or engine.engine.max_model_len
    app.state.server = ServerState(engine, model_name, context, limits or ServerLimits(),
                                   chat_template=chat_template,
                                   tool_call_parser=tool_call_parser)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    install_handlers(app)
    app.include_router(router)
    # added last = runs first: the concurrency limit, the key, the body limit, the JSON-500 net
    app.add_middleware(CatchAll)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout=body_timeout)
    if api_key is not None:
        app.add_middleware(ApiKey, api_key=api_key, guard_all=guard_all)
    app.add_middleware(ConcurrencyLimit, holder=app.state.server)
    return app
