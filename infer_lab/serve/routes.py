"""The routes: OpenAI's completions and chat endpoints, models, health and metrics.

Each handler validates (pydantic, then the fields we refuse by name and the limits of
:class:`~infer_lab.serve.limits.ServerLimits`), tokenizes and compiles its constraint off the
event loop, asks the engine for admission, and then either streams server-sent events or waits
for the end while watching for the client to hang up; a request that fails, fails alone. A
stream that fails ends with an error event and ``[DONE]``; a large answer is built and encoded
off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from infer_lab.engine import RequestOutput, SamplingParams
from infer_lab.engine.structured import StructuredOutputError, StructuredOutputsParams
from infer_lab.serve.async_engine import RequestFailed, RequestOutputCollector
from infer_lab.serve.disagg import KVParams, kv_after, kv_before, kv_params
from infer_lab.serve.errors import APIError, unavailable
from infer_lab.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    UnsupportedField,
)
from infer_lab.serve.responses import (
    DONE,
    Echo,
    Shape,
    batch_response,
    chunk_choice,
    chunk_object,
    encode_json,
    full_response,
    response_size,
    sse,
    usage_of,
)
from infer_lab.serve.state import ServerState, server_state
from infer_lab.serve.tools import conversation, tool_plan, tool_prompt

log = logging.getLogger("infer_lab.serve")
router = APIRouter()
SAMPLING_EPS = 1e-5  # below this, temperature or top_p means greedy
Server = Annotated[ServerState, Depends(server_state)]
OFF_LOOP_BYTES = 64 * 1024  # bodies above this are parsed and validated in a worker thread
OFF_LOOP_ENTRIES = 4096  # answers with more tokens (x logprobs) are built in a worker thread
Body = TypeVar("Body", bound=BaseModel)
BODIES: dict[str, type[BaseModel]] = {"/v1/completions": CompletionRequest,
                                      "/v1/chat/completions": ChatCompletionRequest}


@router.get("/health")
async def health(server: Server) -> JSONResponse:
    """200 while serving; 503 while draining or if the engine thread has died."""
    state = server.engine.state
    body: dict[str, Any] = {"status": state}
    if server.engine.dead:
        body["detail"] = server.engine.dead
    return JSONResponse(body, 200 if state == "ok" else 503)


@router.get("/metrics")
async def metrics(server: Server) -> Response:
    if server.engine.metrics is None:
        raise APIError(404, "metrics are off")
    return Response(generate_latest(server.engine.metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(server: Server) -> dict[str, Any]:
    return {"object": "list", "data": [{
        "id": server.model_name, "object": "model", "created": server.created,
        "owned_by": "infer_lab", "max_model_len": server.context,
    }]}


async def parse_body(request: Request, server: ServerState, model: type[Body]) -> Body:
    """Parse and validate the JSON body, off the event loop when it is large: a 1 MB list of
    token ids or thousands of message parts take tens to hundreds of milliseconds, which every
    stream in flight would otherwise see as a gap. (The app's OpenAPI schema still describes
    these bodies: see ``infer_lab.serve.app``.)"""
    raw = await request.body()
    if len(raw) <= OFF_LOOP_BYTES:
        return validate_body(model, raw)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(server.pool, validate_body, model, raw)


def validate_body(model: type[Body], raw: bytes) -> Body:
    """``json.loads`` then pydantic, as FastAPI does it: pydantic's own JSON parser would refuse
    a lone surrogate (``"\\ud800"``) as invalid JSON, where the request deserves to be told
    which field is not valid Unicode."""
    try:
        data = json.loads(raw)
    except ValueError:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",),
                                       "msg": "invalid JSON"}]) from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None


@router.post("/v1/completions")
async def completions(request: Request, server: Server) -> Any:
    body = await parse_body(request, server, CompletionRequest)
    kv = kv_params(request, body)  # Chapter 13: prefill/decode disaggregation
    check_request(server, body)
    prompts = prompt_list(server, body)
    constraint = refuse_unsupported(server, body.constraint)
    server.engine.check_admission()  # cheap: refuse before tokenizing when already full
    batch = [await server.encode(p) if isinstance(p, str) else p for p in prompts]
    vocab = server.tokenizer_vocab
    for ids in batch:
        check_prompt_ids(ids, vocab)
    await server.prepare(constraint, constraint_param(body))
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    echo_top = body.logprobs if body.echo else None  # the prompt's, in OpenAI's shape
    wanted = [k for k in (echo_top, body.prompt_logprobs) if k is not None]
    params = sampling_params(server, body, max(1, max_tokens), body.logprobs, constraint,
                             prompt_logprobs=max(wanted) if wanted else None,
                             prompt_len=max(len(ids) for ids in batch), num_prompts=len(batch))
    shape = Shape(new_id("cmpl"), False, server.model_name, server.tokenizer, body.logprobs,
                  include_usage(body), body.return_tokens_as_token_ids,
                  echo=Echo(body.echo, max_tokens == 0, body.prompt_logprobs) if (
                      body.echo or body.prompt_logprobs is not None) else None)
    if len(batch) == 1:
        return await run(request, server, shape, batch[0], params, body.stream, kv)
    if kv is not None:
        raise APIError(400, "kv_transfer_params: one prompt per request, not a batch",
                       param="kv_transfer_params")
    return await run_batch(request, server, shape, batch, params, body.stream)


@router.post("/v1/chat/completions")
async def chat(request: Request, server: Server) -> Any:
    body = await parse_body(request, server, ChatCompletionRequest)
    kv = kv_params(request, body)
    check_request(server, body)
    plan = refuse_unsupported(server, lambda: tool_plan(body, server.tool_format))
    constraint = plan.constraint if plan else refuse_unsupported(server, body.constraint)
    in_template = server.renderer.reads_tools  # the template has a tools section
    messages = refuse_unsupported(
        server, lambda: conversation(body.messages, in_template, server.tool_format))
    messages, tools = tool_prompt(plan, messages, body.tools, in_template)
    server.engine.check_admission()
    ids = await server.encode_chat(messages, tools)
    await server.prepare(constraint, "tools" if plan else constraint_param(body))
    wanted = body.max_completion_tokens or body.max_tokens
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(server, body, wanted or max(1, server.context - len(ids)), top,
                             constraint, keep=server.tool_marker_ids if plan and plan.auto
                             else frozenset())
    shape = Shape(new_id("chatcmpl"), True, server.model_name, server.tokenizer, top,
                  include_usage(body), body.return_tokens_as_token_ids, tools=plan)
    return await run(request, server, shape, ids, params, body.stream, kv)


def constraint_param(body: SamplingFields) -> str:
    return "response_format" if body.structured_outputs is None else "structured_outputs"


def refuse_unsupported(server: ServerState, make: Callable[[], Any]) -> Any:
    """``make()``, with an ``UnsupportedField`` it raises as a 400 naming the field."""
    try:
        return make()
    except UnsupportedField as e:
        raise server.refuse("unsupported_field", str(e), e.field, "unsupported_field") from e
    except StructuredOutputError as e:  # a schema too deep to even read
        raise server.refuse("schema_depth", str(e), "response_format", "invalid_schema") from e


def check_request(server: ServerState, body: SamplingFields) -> None:
    server.check_open()
    server.check_model(body.model)
    most = server.limits.max_n
    for name in ("n", "best_of"):
        if (getattr(body, name) or 0) > most:
            raise server.refuse("n", f"{name}: at most {most} samples per request (this "
                                "server's --max-n)", name)
    refuse_unsupported(server, body.unsupported)


def prompt_list(server: ServerState, body: CompletionRequest) -> list[str | list[int]]:
    """The prompts of ``body``: one (text or token ids) or a batch (a list of either). A batch
    holds ``n`` batch slots per prompt, so ``n x prompts`` is bounded by ``--max-n``."""
    prompt = body.prompt
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(
        prompt[0], (str, list)) else [prompt]
    if any(not p for p in batch):
        raise APIError(400, "the prompt is empty", param="prompt")
    if len(batch) > 1:
        most = server.limits.max_n
        if body.n * len(batch) > most:
            raise server.refuse("n", f"prompt: n x prompts is {body.n * len(batch)}; at most "
                                f"{most} samples per request (this server's --max-n)", "prompt")
    return batch


def check_prompt_ids(ids: list[int], vocab: int) -> None:
    """A 400 naming ``prompt`` for token ids outside the vocabulary (before any is queued)."""
    if ids and max(ids) >= vocab:
        bad = [t for t in ids if t >= vocab][:5]
        raise APIError(400, f"prompt: token ids {bad} are outside the vocabulary of {vocab}",
                       param="prompt")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sampling_params(server: ServerState, body: SamplingFields, max_tokens: int,
                    logprobs: int | None,
                    constraint: StructuredOutputsParams | None = None,
                    prompt_logprobs: int | None = None, prompt_len: int = 0,
                    num_prompts: int = 1, keep: frozenset[int] = frozenset()) -> SamplingParams:
    """The engine's parameters; only non-neutral extras are passed (an engine without penalties
    or logprobs then refuses exactly the requests that need them). The log-probability volume
    is bounded per HTTP request: n samples of each of ``num_prompts`` prompts. ``keep``: the
    special tokens whose text the output keeps (tool-call markers)."""
    extra: dict[str, Any] = {}
    if keep:
        extra["keep_special_token_ids"] = keep
    if constraint is not None:
        extra["structured_outputs"] = constraint
    if logprobs is not None:
        extra["logprobs"] = logprobs
        check_logprobs_volume(server, body.n * num_prompts, max_tokens, logprobs)
    if prompt_logprobs is not None:
        extra["prompt_logprobs"] = prompt_logprobs
        check_logprobs_volume(server, body.n * num_prompts, prompt_len + max_tokens,
                              prompt_logprobs)
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0), ("min_p", 0.0), ("min_tokens", 0)):
        if getattr(body, name) != neutral:
            extra[name] = getattr(body, name)
    if body.logit_bias:
        extra["logit_bias"] = check_logit_bias(server, body.token_bias())
    temperature, top_p = body.temperature, body.top_p
    if temperature < SAMPLING_EPS or top_p < SAMPLING_EPS:
        # logits / 1e-40 overflow and a top_p that is 0 in float32 keeps nothing: both mean
        # "the most likely token", which is greedy decoding (vLLM draws the same line)
        temperature, top_p = 0.0, 1.0
    try:
        return SamplingParams(
            n=body.n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            top_k=body.top_k, seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos, **extra,
        )
    except TypeError as e:
        if extra and "unexpected keyword" in str(e):
            field = next(iter(extra))
            raise APIError(400, f"{field}: not supported by this engine", param=field,
                           code="unsupported_field") from e
        raise APIError(400, str(e)) from e
    except ValueError as e:
        field = str(e).split(" ", 1)[0]  # SamplingParams' messages start with the field
        raise APIError(400, str(e), param=field if field in type(body).model_fields
                       else None) from e


def check_logit_bias(server: ServerState, bias: dict[int, float]) -> dict[int, float]:
    """The bias, if every token id is in the vocabulary (else a 400 naming ``logit_bias``)."""
    vocab = server.tokenizer_vocab
    bad = [t for t in bias if t >= vocab]
    if bad:
        raise APIError(400, f"logit_bias: token ids {bad[:5]} are outside the vocabulary of "
                       f"{vocab}", param="logit_bias")
    return bias


def check_logprobs_volume(server: ServerState, n: int, max_tokens: int, top: int) -> None:
    """Refuse a request whose answer could hold more log-probabilities than the limit: its
    body grows as n x max_tokens x (1 + top_logprobs) (18 MB at 40 x 300 x 21), n counting
    every sample of every prompt of a batch."""
    entries, most = n * max_tokens * (1 + top), server.limits.max_logprobs_per_request
    if entries > most:
        raise server.refuse("logprobs", f"logprobs: samples x max_tokens x (1 + top_logprobs) is "
                            f"{entries}; the limit is {most}", "logprobs")


def include_usage(body: SamplingFields) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


async def run(request: Request, server: ServerState, shape: Shape, ids: list[int],
              params: SamplingParams, stream: bool, kv: KVParams | None = None) -> Any:
    await kv_before(request, kv, shape.request_id, ids)
    try:
        outputs = await server.engine.add_request(shape.request_id, ids, params)
    except RequestFailed as e:
        raise unavailable(str(e)) from e
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param="prompt") from e
    if stream:
        return StreamingResponse(
            stream_events(server, shape, outputs, params.n), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    final = await wait_final(request, server, shape.request_id, outputs)
    if final is None:  # the client hung up; nobody reads this
        return Response(status_code=499)
    return await respond(server, shape, final,
                         await kv_after(request, kv, shape.request_id, ids, final))


async def run_batch(request: Request, server: ServerState, shape: Shape,
                    batch: list[list[int]], params: SamplingParams, stream: bool = False) -> Any:
    """A batch of prompts: one engine request each, all admitted before any answer; the
    choices of prompt ``i`` are ``i * n ...``. If one fails, the others are aborted (streamed:
    after an error event, then ``[DONE]``)."""
    ids = [f"{shape.request_id}-{i}" for i in range(len(batch))]
    added: list[str] = []
    try:
        collectors = []
        for request_id, prompt in zip(ids, batch):
            try:
                collectors.append(await server.engine.add_request(request_id, prompt, params))
            except RequestFailed as e:
                raise unavailable(str(e)) from e
            except (ValueError, TypeError) as e:
                raise APIError(400, str(e), param="prompt") from e
            added.append(request_id)
        if stream:
            return StreamingResponse(
                batch_events(server, shape, ids, collectors, params.n),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        finals = await asyncio.gather(*(wait_final(request, server, i, c)
                                        for i, c in zip(ids, collectors)))
    except BaseException:
        for request_id in added:
            server.engine.abort(request_id)
        raise
    if any(f is None for f in finals):  # the client hung up
        return Response(status_code=499)
    loop = asyncio.get_running_loop()
    content = await loop.run_in_executor(
        server.respond_pool, lambda: encode_json(batch_response(shape, finals)))
    return Response(content, media_type="application/json")


async def respond(server: ServerState, shape: Shape, final: RequestOutput,
                  extra: dict[str, Any] | None = None) -> Response:
    """The whole answer as JSON. A large one (many samples, tokens and log-probabilities) is
    built and encoded in a worker thread, in small pieces, so that the event loop (every
    stream, ``/health``) keeps running meanwhile."""
    def body() -> dict[str, Any]:
        return {**full_response(shape, final), **(extra or {})}  # extra: kv_transfer_params

    if response_size(shape, final) <= OFF_LOOP_ENTRIES:
        return JSONResponse(body())
    loop = asyncio.get_running_loop()
    content = await loop.run_in_executor(server.respond_pool, lambda: encode_json(body()))
    return Response(content, media_type="application/json")


def failure(server: ServerState, item: RequestOutput | Exception) -> APIError | None:
    """The error this output carries, if the engine (or the server) failed this request."""
    if isinstance(item, RequestFailed):
        return APIError(503, str(item), "server_error", code="unavailable")
    if isinstance(item, Exception):
        return APIError(500, "the engine failed on this request", "server_error")
    error = item.error
    if error is not None or any(c.finish_reason == "error" for c in item.outputs):
        # the client gets the stage (a RequestFailure's field), the log keeps the detail; a
        # grammar over its CPU budget is the request's own doing, and the client is told which
        # limit it passed
        log.warning("request %s failed in the engine: %s", item.request_id, error)
        if error is not None and error.error_type == "GrammarTooSlowError":
            return server.refuse("grammar_slow", error.detail, "response_format",
                                 "grammar_too_slow")
        where = ("the engine failed this request" if error is None
                 else f"the engine failed this request ({error.stage})")
        return APIError(500, where, "server_error", code="engine_error")
    return None


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def wait_final(request: Request, server: ServerState, request_id: str,
                     outputs: RequestOutputCollector) -> RequestOutput | None:
    """The last output, or None if the client hung up first (then the request is aborted)."""
    gone = asyncio.ensure_future(_disconnected(request))
    final = None
    try:
        while final is None:
            get = asyncio.ensure_future(outputs.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                return None
            item = get.result()
            if (error := failure(server, item)) is not None:
                raise error
            final = item if item.finished else None
        return final
    finally:
        gone.cancel()
        if final is None:  # hung up, failed or cancelled: free the blocks now
            server.engine.abort(request_id)


async def stream_events(server: ServerState, shape: Shape, outputs: RequestOutputCollector,
                        n: int) -> AsyncIterator[str]:
    """Server-sent events until the request ends; whatever fails ends the stream with an error
    event and ``[DONE]``, never a cut connection."""
    sent_role = [False] * n
    out, finished = None, False
    try:
        while not finished:
            item = await outputs.get()
            if (error := failure(server, item)) is not None:
                yield sse(error.body)
                break
            out, finished = item, item.finished
            for event in _events(shape, out, sent_role):
                yield event
        if finished and shape.usage:
            yield sse(shape.body(chunk_object(shape), [], usage_of(out)))
    except Exception:  # a bug in building an event: this stream's alone
        log.exception("request %s: building its stream failed", shape.request_id)
        finished = False
        yield sse(APIError(500, "the server failed on this request", "server_error").body)
    finally:
        if not finished:  # the client went away, or the request failed: free its blocks now
            server.engine.abort(shape.request_id)
    yield DONE


async def batch_events(server: ServerState, shape: Shape, ids: list[str],
                       collectors: list[RequestOutputCollector], n: int) -> AsyncIterator[str]:
    """A streamed batch of prompts, as OpenAI and vLLM send it: each prompt's chunks as they
    come, their choices numbered ``i * n ...`` for prompt ``i``, the usage of all of them in a
    last chunk if asked, one ``[DONE]``. A prompt that fails ends the stream with an error
    event (the others are aborted), as a failure ends the batch that is not streamed."""
    finals: dict[int, RequestOutput] = {}
    waiting = {asyncio.ensure_future(c.get()): i for i, c in enumerate(collectors)}
    sent_role = [False] * (n * len(ids))
    failed = False
    try:
        while waiting and not failed:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for got in sorted(done, key=waiting.get):  # one step's chunks in prompt order
                i = waiting.pop(got)
                item = got.result()
                if (error := failure(server, item)) is not None:
                    yield sse(error.body)
                    failed = True
                    break
                for event in _events(shape, item, sent_role, base=i * n):
                    yield event
                if item.finished:
                    finals[i] = item
                else:
                    waiting[asyncio.ensure_future(collectors[i].get())] = i
        if not failed and shape.usage:
            total = [usage_of(finals[i]) for i in range(len(ids))]
            yield sse(shape.body(chunk_object(shape), [], {
                key: sum(u[key] for u in total) for key in total[0]}))
    except Exception:  # a bug in building an event: this stream's alone
        log.exception("request %s: building its stream failed", shape.request_id)
        yield sse(APIError(500, "the server failed on this request", "server_error").body)
    finally:
        for got in waiting:
            got.cancel()
        for i, request_id in enumerate(ids):  # failed, hung up or cancelled: free the blocks
            if i not in finals:
                server.engine.abort(request_id)
    yield DONE


def _events(shape: Shape, out: RequestOutput, sent_role: list[bool],
            base: int = 0) -> list[str]:
    """The chunks of one output; ``base``: the index of its first choice (a batch)."""
    events = []
    for c in out.outputs:
        if not c.delta_token_ids and not c.delta_text and not c.finish_reason:
            continue
        choice = chunk_choice(shape, c, not sent_role[base + c.index], base)
        sent_role[base + c.index] = True
        events.append(sse(shape.body(chunk_object(shape), [choice])))
    return events
