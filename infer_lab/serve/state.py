"""What the route handlers share, kept on ``app.state.server``: the engine, the model's name and
limits, and the work that must happen off the event loop, each in its own bounded place, so
that one kind of slow work cannot starve another: tokenizing (two threads), chat templates (two
threads, each waiting on a child process with a deadline), grammar compilation (one thread, a
bounded number waiting: 429 beyond) and building large responses (one thread)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from infer_lab.engine.structured import (
    GrammarLimitError,
    GrammarTooSlowError,
    StructuredOutputError,
    StructuredOutputsParams,
)
from infer_lab.model.tokenizer import TemplateLimitError, Tokenizer
from infer_lab.serve.async_engine import AsyncEngine
from infer_lab.serve.errors import APIError, unavailable
from infer_lab.serve.limits import ServerLimits
from infer_lab.serve.template import TemplateRenderer
from infer_lab.serve.tool_formats import DEFAULT_TOOL_CALL_PARSER, CallFormat, call_format

# A token never stands for more bytes of input than its own spelling has (in UTF-8) in any
# tokenizer we load; a normalizer may shrink the input a little (NFKC), hence the slack.
_NORMALIZER_SLACK = 2


def _pool(name: str, threads: int = 1) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix=name)


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    context: int
    limits: ServerLimits = field(default_factory=ServerLimits)
    created: int = field(default_factory=lambda: int(time.time()))
    pool: ThreadPoolExecutor = field(default_factory=lambda: _pool("tokenize", 2))
    template_pool: ThreadPoolExecutor = field(default_factory=lambda: _pool("template", 2))
    compile_pool: ThreadPoolExecutor = field(default_factory=lambda: _pool("compile"))
    respond_pool: ThreadPoolExecutor = field(default_factory=lambda: _pool("respond"))
    max_prompt_bytes: int = 0
    max_concurrency: int | None = None  # requests in the app at once (set by make_server)
    compiles: int = 0  # grammar compilations running or queued
    chat_template: str | None = None  # --chat-template: replaces the model's for every request
    tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER  # --tool-call-parser: how calls are written

    def __post_init__(self) -> None:
        if not self.max_prompt_bytes:
            vocab = self.tokenizer.backend.get_vocab()
            longest = max((len(t.encode("utf-8", "replace")) for t in vocab), default=1)
            self.max_prompt_bytes = self.context * max(1, longest) * _NORMALIZER_SLACK
        self.tool_format: CallFormat = call_format(self.tool_call_parser)
        # the format's markers that are one special token: "auto" requests keep their text
        self.tool_marker_ids = self.tool_format.special_marker_ids(self.tokenizer)
        self.engine.engine.structured.limits = self.limits.grammar_limits()
        self.renderer = TemplateRenderer(self.tokenizer, timeout=self.limits.template_timeout,
                                         max_bytes=self.max_prompt_bytes,
                                         chat_template=self.chat_template)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.engine.tokenizer

    @property
    def tokenizer_vocab(self) -> int:
        """The model's vocabulary size: token ids (prompts, logit_bias) must be below it."""
        return self.engine.engine.model.config.vocab_size

    def close(self) -> None:
        for pool in (self.pool, self.template_pool, self.compile_pool, self.respond_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        self.renderer.close()

    def refuse(self, reason: str, message: str, param: str | None = None,
               code: str | None = None) -> APIError:
        """A 400 for a request over one of the limits, counted under ``reason``."""
        if self.engine.metrics:
            self.engine.metrics.refuse(reason)
        return APIError(400, message, param=param, code=code or "limit_exceeded")

    def check_open(self) -> None:
        """503 while draining or with a dead engine: a load balancer should look elsewhere."""
        state = self.engine.state
        if state == "draining":
            raise unavailable("the server is shutting down")
        if state == "dead":
            raise unavailable(self.engine.dead or "the engine is not running")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.model_name!r}", code="model_not_found", param="model")

    def check_prompt_bytes(self, num_bytes: int, param: str) -> None:
        """Refuse, before tokenizing it, a prompt too long to fit the context in any case."""
        if num_bytes > self.max_prompt_bytes:
            raise APIError(400, f"the prompt is {num_bytes} bytes: that is more tokens than the "
                           f"model's context of {self.context} can hold", param=param)

    async def encode(self, text: str) -> list[int]:
        """Tokenize in a worker thread with ``encode_batch``, which releases the GIL."""
        self.check_prompt_bytes(len(text.encode("utf-8")), "prompt")
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(self.pool, self.tokenizer.encode_batch, [text])
        return ids[0]

    async def encode_chat(self, messages: list[dict[str, Any]],
                          tools: list[dict] | None = None) -> list[int]:
        """Render the chat template (in a child process, with a deadline, its output within
        the prompt's byte limit; ``tools`` as its variable ``tools``) and tokenize it, both
        off the event loop."""
        self.check_prompt_bytes(sum(len(m["content"].encode("utf-8")) for m in messages),
                                "messages")
        loop = asyncio.get_running_loop()
        try:
            text = await loop.run_in_executor(self.template_pool, self.renderer.render,
                                              messages, True, tools)
        except TemplateLimitError as e:
            raise self.refuse(e.reason, str(e), "messages", "chat_template_limit") from e
        except ValueError as e:  # no template, or the template refused the conversation
            raise APIError(400, str(e), param="messages") from e
        self.check_prompt_bytes(len(text.encode("utf-8")), "messages")  # the rendered prompt
        ids = await loop.run_in_executor(self.pool, self.tokenizer.encode_batch, [text], False)
        return ids[0]

    async def prepare(self, spec: StructuredOutputsParams | None, param: str) -> None:
        """Check and compile an output constraint before admission: in its own thread, at
        most ``limits.max_compiles`` at once (429 beyond), each counted as a waiting request;
        a constraint compiled and tried before costs no wait. A 400 for a bad constraint."""
        if spec is None:
            return
        structured = self.engine.engine.structured
        try:
            if structured.is_prepared(spec):
                structured.prepare(spec)  # a cache hit: cheap, on the loop
                return
            if self.compiles >= self.limits.max_compiles:
                raise self.engine.refuse("compile_busy", f"{self.compiles} grammars are being "
                                         "compiled (the limit is "
                                         f"{self.limits.max_compiles}); retry later")
            await self._compile(spec)
        except GrammarLimitError as e:
            raise self.refuse(e.reason, str(e), param, "invalid_schema") from e
        except GrammarTooSlowError as e:
            raise self.refuse("grammar_slow", str(e), param, "invalid_schema") from e
        except StructuredOutputError as e:
            raise self.refuse("grammar_invalid", str(e), param, "invalid_schema") from e

    async def _compile(self, spec: StructuredOutputsParams) -> None:
        self.compiles += 1
        self.engine.compiling += 1
        try:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self.compile_pool,
                                       self.engine.engine.structured.prepare, spec)
        finally:
            self.compiles -= 1
            self.engine.compiling -= 1


def server_state(request: Request) -> ServerState:
    """The dependency every route uses to reach the engine."""
    return request.app.state.server
