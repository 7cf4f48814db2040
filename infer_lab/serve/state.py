"""What the route handlers share, kept on ``app.state.server``: the engine, the model's name and
limits, and the tokenizer work that must happen off the event loop."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request

from infer_lab.model.tokenizer import Tokenizer
from infer_lab.serve.async_engine import AsyncEngine
from infer_lab.serve.errors import APIError, unavailable

# A token never stands for more bytes of input than its own spelling has (in UTF-8) in any
# tokenizer we load; a normalizer may shrink the input a little (NFKC), hence the slack.
_NORMALIZER_SLACK = 2


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    context: int
    created: int = field(default_factory=lambda: int(time.time()))
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="tokenize"))
    max_prompt_bytes: int = 0
    max_concurrency: int | None = None  # requests in the app at once (set by make_server)

    def __post_init__(self) -> None:
        if not self.max_prompt_bytes:
            vocab = self.tokenizer.backend.get_vocab()
            longest = max((len(t.encode("utf-8", "replace")) for t in vocab), default=1)
            self.max_prompt_bytes = self.context * max(1, longest) * _NORMALIZER_SLACK

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.engine.tokenizer

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

    async def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Render the chat template and tokenize it, both off the event loop."""
        self.check_prompt_bytes(sum(len(m["content"].encode("utf-8")) for m in messages),
                                "messages")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self._chat_ids, messages)

    def _chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0]


def server_state(request: Request) -> ServerState:
    """The dependency every route uses to reach the engine."""
    return request.app.state.server
