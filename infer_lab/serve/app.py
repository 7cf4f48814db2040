"""The FastAPI app: OpenAI's completions and chat endpoints over :class:`AsyncEngine`."""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infer_lab.engine import RequestOutput, SamplingParams
from infer_lab.serve.async_engine import AsyncEngine, EngineDeadError
from infer_lab.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body


class APIError(Exception):
    """An error to send back in OpenAI's shape with ``status``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``max_bytes`` with 413, before parsing."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(send)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise APIError(413, f"request body over {self.max_bytes} bytes")
            return message

        try:
            await self.app(scope, counted, send)
        except APIError:
            await self._too_large(send)

    async def _too_large(self, send: Send) -> None:
        response = JSONResponse(error_body(f"request body over {self.max_bytes} bytes"), 413)
        await response({"type": "http"}, _no_body, send)


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


def build_app(
    engine: AsyncEngine,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 1 << 20,
    max_model_len: int | None = None,
) -> FastAPI:
    """The HTTP face of an engine. ``engine`` is started and stopped with the app."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="infer_lab", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    context = max_model_len or engine.engine.max_model_len
    tokenizer = engine.engine.tokenizer
    created = int(time.time())

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        given = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
        if not secrets.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key", "authentication_error",
                           code="invalid_api_key")

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body, e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON ({first.get('msg', '')})"
        elif not where and first.get("type") in ("model_attributes_type", "dict_type"):
            message = "the request body must be a JSON object"
        else:
            msg = first.get("msg", "invalid request")
            message = f"{where}: {msg}" if where else str(msg)
        return JSONResponse(error_body(message, param=where or None), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail)), e.status_code)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        if engine.metrics is None:
            raise APIError(404, "metrics are off")
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "infer_lab",
            "max_model_len": context,
        }]}

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{model_name!r}", code="model_not_found", param="model")

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "batched prompts are not supported: send one request per "
                               "prompt", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, list) and not prompt or prompt == "":
            raise APIError(400, "the prompt is empty", param="prompt")
        params = sampling_params(body, body.max_tokens or 16)
        return await serve(request, "text_completion", prompt, params, body.stream,
                           include_usage(body))

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True)
        except ValueError as e:  # no template, or the template refused the conversation
            raise APIError(400, str(e), param="messages") from e
        wanted = body.max_completion_tokens or body.max_tokens
        params = sampling_params(body, wanted or max(1, context - len(ids)))
        return await serve(request, "chat.completion", ids, params, body.stream,
                           include_usage(body))

    async def serve(request: Request, kind: str, prompt: str | list[int],
                    params: SamplingParams, stream: bool, usage: bool) -> Any:
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            outputs = await engine.add_request(request_id, prompt, params)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param="prompt") from e
        except EngineDeadError as e:
            raise APIError(503, str(e), "server_error") from e
        if stream:
            return StreamingResponse(
                stream_chunks(request_id, kind, outputs, params.n, usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        final = None
        try:
            final = await last_output(outputs)
        finally:
            if final is None:  # cancelled or failed before the end: free the blocks
                engine.abort(request_id)
        return full_response(request_id, kind, final)

    async def next_output(outputs) -> RequestOutput:  # noqa: ANN001
        item = await outputs.get()
        if isinstance(item, Exception):
            raise APIError(500, f"the engine failed: {item}", "server_error")
        return item

    async def last_output(outputs) -> RequestOutput:  # noqa: ANN001
        while True:
            out = await next_output(outputs)
            if out.finished:
                return out

    async def stream_chunks(request_id: str, kind: str, outputs, n: int,  # noqa: ANN001
                            usage: bool) -> AsyncIterator[str]:
        chat_kind = kind == "chat.completion"
        obj = "chat.completion.chunk" if chat_kind else "text_completion"
        sent_role = [False] * n
        finished = False
        try:
            while not finished:
                try:
                    out = await next_output(outputs)
                except APIError as e:
                    yield sse(e.body)
                    return
                finished = out.finished
                for c in out.outputs:
                    if not c.delta_token_ids and not c.delta_text and not c.finish_reason:
                        continue
                    if chat_kind:
                        delta: dict[str, Any] = {"content": c.delta_text}
                        if not sent_role[c.index]:
                            delta["role"], sent_role[c.index] = "assistant", True
                        choice = {"index": c.index, "delta": delta}
                    else:
                        choice = {"index": c.index, "text": c.delta_text}
                    choice["logprobs"] = None
                    choice["finish_reason"] = c.finish_reason
                    yield sse(chunk(request_id, obj, [choice]))
            if usage:
                yield sse(chunk(request_id, obj, [], usage_of(out)))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (or the stream broke): free its blocks now
                engine.abort(request_id)

    def chunk(request_id: str, obj: str, choices: list, usage: dict | None = None) -> dict:
        body = {"id": request_id, "object": obj, "created": int(time.time()),
                "model": model_name, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def full_response(request_id: str, kind: str, out: RequestOutput) -> dict[str, Any]:
        if kind == "chat.completion":
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": None, "finish_reason": c.finish_reason}
                       for c in out.outputs]
        else:
            choices = [{"index": c.index, "text": c.text, "logprobs": None,
                        "finish_reason": c.finish_reason} for c in out.outputs]
        return {"id": request_id, "object": kind, "created": int(time.time()),
                "model": model_name, "choices": choices, "usage": usage_of(out)}

    return app


def sampling_params(body: Any, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(
            n=body.n, max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
            top_k=body.top_k, seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
        )
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e)) from e


def include_usage(body: Any) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def usage_of(out: RequestOutput) -> dict[str, int]:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
