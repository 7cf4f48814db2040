"""Errors in OpenAI's shape: every failure a client sees is JSON with a status that fits it and a
message about its request (which field, which limit), never a library's internals."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from infer_lab.serve.protocol import error_body

log = logging.getLogger("infer_lab.serve")


class APIError(Exception):
    """An error to send back in OpenAI's shape with ``status`` (and extra ``headers``)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, self.status, headers=self.headers)


def server_busy(message: str, retry_after: int = 1) -> APIError:
    """429 with ``Retry-After``: what production servers answer beyond their queue bound."""
    return APIError(429, message, "rate_limit_error", code="server_busy",
                    headers={"Retry-After": str(retry_after)})


def unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", code="unavailable",
                    headers={"Retry-After": "5"})


def validation_message(e: RequestValidationError) -> tuple[str, str | None]:
    """The first pydantic error as "field: what is wrong" (its location named the OpenAI way)."""
    errors = list(e.errors())
    # of the branches of a union pydantic tried, the one that got deepest says what is wrong
    first = max(errors, key=lambda err: len(err.get("loc", ())), default={})
    loc = [p for p in first.get("loc", ()) if p != "body"]
    # pydantic names the branch of a union it tried ("str", "list[int]", "function-after[...]"):
    # that is internals, not a field of the request
    loc = [p for p in loc if isinstance(p, int) or ("[" not in p and p not in _TYPE_NAMES)]
    where = ""
    for p in loc:
        where += f"[{p}]" if isinstance(p, int) else (f".{p}" if where else p)
    kind = first.get("type")
    if kind == "json_invalid":
        return "the request body is not valid JSON", None
    if not where and kind in ("model_attributes_type", "dict_type", "model_type"):
        return "the request body must be a JSON object", None
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return (f"{where}: {msg}" if where else msg), where or None


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "ContentPart"}


def install_handlers(app: FastAPI) -> None:
    """Map every exception a request can raise to OpenAI-shaped JSON."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_message(e)
        return JSONResponse(error_body(message, param=param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail)), e.status_code, headers=e.headers)
