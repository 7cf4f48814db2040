"""OpenAI's response shapes, built from the engine's :class:`RequestOutput`: whole responses,
server-sent-event chunks, usage, and log-probabilities in both routes' formats."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from infer_lab.engine import CompletionOutput, RequestOutput
from infer_lab.model.tokenizer import Tokenizer
from infer_lab.serve.tools import ToolStream


@dataclass(frozen=True)
class Echo:
    """What a completion returns of its prompt: its text and tokens before each choice
    (``echo``; ``score_only``: ``max_tokens`` 0, the one token the engine sampled is dropped),
    and vLLM's ``prompt_logprobs`` (None: not asked)."""

    echo: bool
    score_only: bool
    prompt_logprobs: int | None


@dataclass
class Shape:
    """What one response looks like: the route, the model name, and what logprobs it wants
    (``None``: none; else the number of alternatives per token)."""

    request_id: str
    chat: bool
    model_name: str
    tokenizer: Tokenizer
    top_logprobs: int | None = None
    usage: bool = False
    token_ids: bool = False  # render tokens as "token_id:N" (vLLM's return_tokens_as_token_ids)
    created: int = field(default_factory=lambda: int(time.time()))
    offsets: dict[int, int] = field(default_factory=dict)  # completions' text_offset, per choice
    tools: Any = None  # a ToolPlan: the output is a tool call
    tool_streams: dict[int, Any] = field(default_factory=dict)  # a ToolStream a choice
    echo: Echo | None = None  # completions: the prompt's text and log-probabilities

    def tool_message(self, c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """A chat message (and finish reason) for ``c`` as a tool call. A forced call (a named
        function or "required") is one only if the grammar terminated: ``stop`` with no stop
        string or stop token behind it (those can fire in the middle of the JSON) and a JSON
        that parses. Otherwise (cut off by ``length``, a stop string, a stop token) the call
        is dropped, as "auto"'s cut calls are: no ``tool_calls``, no content (the JSON is not
        text), and the finish reason says why."""
        if self.tools.auto:
            return self._auto_message(c)
        call = None
        if c.finish_reason == "stop" and c.stop_reason is None:
            call = self.tools.call(c.text, f"{self.call_id(c.index)}_0")
        if call is None:
            return {"role": "assistant", "content": ""}, c.finish_reason
        return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"

    def call_id(self, index: int) -> str:
        return f"call_{self.request_id[-24:]}_{index}"

    def _auto_message(self, c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """``tool_choice: "auto"``: the text outside calls as content, the calls as
        ``tool_calls`` (finish reason ``tool_calls`` if there is any)."""
        content, calls, _ = self.tools.split(c.text, True)
        if not calls:
            return {"role": "assistant", "content": content}, c.finish_reason
        base = self.call_id(c.index)
        tool_calls = [{"id": f"{base}_{k}", "type": "function", "function": call}
                      for k, call in enumerate(calls)]
        reason = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
        return ({"role": "assistant", "content": content.strip() or None,
                 "tool_calls": tool_calls}, reason)

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def token(self, token_id: int) -> str:
        if self.token_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def body(self, obj: str, choices: list[dict], usage: dict | None = None) -> dict[str, Any]:
        out = {"id": self.request_id, "object": obj, "created": self.created,
               "model": self.model_name, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out


def _lp(value: float) -> float:
    return value if math.isfinite(value) else -9999.0  # JSON has no -inf; OpenAI's floor


def logprobs_of(shape: Shape, index: int, entries: list | None,
                first: int | None = None) -> dict[str, Any] | None:
    """``entries`` (TokenLogprobs) in the route's format; None when logprobs were not asked.
    ``first`` (completions' echo): a token before them that nothing predicts (its
    log-probability and alternatives are null, as OpenAI and vLLM send the prompt's first)."""
    if shape.top_logprobs is None or entries is None:
        return None
    k = shape.top_logprobs
    if shape.chat:
        content = []
        for e in entries:
            text = shape.token(e.token_id)
            top = [{"token": (t := shape.token(i)), "logprob": _lp(lp),
                    "bytes": list(t.encode("utf-8"))} for i, lp in e.top[:k]]
            content.append({"token": text, "logprob": _lp(e.logprob),
                            "bytes": list(text.encode("utf-8")), "top_logprobs": top})
        return {"content": content, "refusal": None}
    tokens, offsets, tops = [], [], []
    chosen: list[float | None] = []
    if first is not None:
        tokens.append(shape.token(first))
        offsets.append(0)
        shape.offsets[index] = len(tokens[0])
        tops.append(None)
        chosen.append(None)
    for e in entries:
        text = shape.token(e.token_id)
        offsets.append(shape.offsets.get(index, 0))
        shape.offsets[index] = offsets[-1] + len(text)
        tokens.append(text)
        top = {shape.token(i): _lp(lp) for i, lp in e.top[:k]}
        top.setdefault(text, _lp(e.logprob))
        tops.append(top)
        chosen.append(_lp(e.logprob))
    return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops,
            "text_offset": offsets}


def usage_of(out: RequestOutput) -> dict[str, int]:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def completion_choice(shape: Shape, out: RequestOutput, c: CompletionOutput,
                      index: int) -> dict[str, Any]:
    """A completion's choice with its prompt echoed (OpenAI: the prompt's tokens first, the
    first one's log-probability null) and vLLM's ``prompt_logprobs``."""
    echo = shape.echo
    text, entries, reason = c.text, c.logprobs, c.finish_reason
    if echo.score_only:  # max_tokens 0: the prompt alone
        text, entries, reason = "", [] if entries is not None else None, "length"
    prompt_ids, prompt_lps = out.prompt_token_ids, out.prompt_logprobs
    if echo.echo:
        text = shape.tokenizer.decode(prompt_ids, skip_special_tokens=False) + text
    lp = None
    if shape.top_logprobs is not None:
        head = None
        if echo.echo:  # first: its text offsets start at 0 and the completion's follow
            head = logprobs_of(shape, index, (prompt_lps or [None])[1:], prompt_ids[0])
        lp = logprobs_of(shape, index, entries or [])
        if head is not None:
            lp = {key: head[key] + lp[key] for key in lp}
    choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
    if echo.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(shape, prompt_lps,
                                                         echo.prompt_logprobs)
    return choice


def vllm_prompt_logprobs(shape: Shape, entries: list | None, k: int) -> list | None:
    """vLLM's shape: per prompt token, ``{token_id: {logprob, rank, decoded_token}}`` for the
    token itself and the ``k`` most likely (the first entry None)."""
    out: list[dict[str, Any] | None] = [None]
    if entries is None:  # a one-token prompt: nothing to score
        return out
    for e in entries[1:]:
        one = {str(i): {"logprob": _lp(lp), "rank": r + 1, "decoded_token": shape.token(i)}
               for r, (i, lp) in enumerate(e.top[:k])}
        one.setdefault(str(e.token_id), {"logprob": _lp(e.logprob), "rank": e.rank,
                                         "decoded_token": shape.token(e.token_id)})
        out.append(one)
    return out


def batch_response(shape: Shape, outs: list[RequestOutput]) -> dict[str, Any]:
    """One completion for a batch of prompts: prompt ``i``'s choices are ``i * n ...``."""
    choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for i, out in enumerate(outs):
        n = len(out.outputs)
        body = full_response(shape, out, base=i * n)
        choices += body["choices"]
        for key, value in body["usage"].items():
            usage[key] += value
    return shape.body(shape.object, choices, usage)


def full_response(shape: Shape, out: RequestOutput, base: int = 0) -> dict[str, Any]:
    """The whole answer; ``base``: the index of this request's first choice (a batch)."""
    choices = []
    for c in out.outputs:
        if shape.echo is not None:
            choices.append(completion_choice(shape, out, c, base + c.index))
            continue
        lp = logprobs_of(shape, c.index, getattr(c, "logprobs", None))
        if shape.chat and shape.tools is not None:
            message, reason = shape.tool_message(c)
            choice = {"index": c.index, "message": message, "logprobs": lp,
                      "finish_reason": reason}
        elif shape.chat:
            choice = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                      "logprobs": lp, "finish_reason": c.finish_reason}
        else:
            choice = {"index": base + c.index, "text": c.text, "logprobs": lp,
                      "finish_reason": c.finish_reason}
        choices.append(choice)
    usage = usage_of(out)
    if shape.echo is not None and shape.echo.score_only:
        usage["total_tokens"] -= usage["completion_tokens"]
        usage["completion_tokens"] = 0
    return shape.body(shape.object, choices, usage)


def chunk_choice(shape: Shape, c: CompletionOutput, first: bool,
                 base: int = 0) -> dict[str, Any]:
    """One choice of a streamed chunk: this step's text (and role, in a chat's first chunk);
    ``base``: the index of the request's first choice (a batch of prompts)."""
    lp = logprobs_of(shape, base + c.index, getattr(c, "delta_logprobs", None))
    if shape.chat and shape.tools is not None:
        return _tool_chunk(shape, c, first, lp)
    if shape.chat:
        delta: dict[str, Any] = {"content": c.delta_text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": c.index, "delta": delta}
    else:
        choice = {"index": base + c.index, "text": c.delta_text}
    choice["logprobs"] = lp
    choice["finish_reason"] = c.finish_reason
    return choice


def _tool_chunk(shape: Shape, c: CompletionOutput, first: bool,
                lp: dict[str, Any] | None) -> dict[str, Any]:
    """A streamed chunk of a request with tools: the text that cannot be part of a call, and
    each call as it is written (a first delta with its ``index``, ``id``, ``type`` and name,
    then its arguments piece by piece); the markup and JSON of a call never reach
    ``content``. A named function's call starts in the first chunk (its name is known before
    any token), "required"'s once the name in its JSON is complete. A call cut off (by
    ``max_tokens``, or a forced one by a stop string or token) has sent the part written
    before the last chunk and ends with that finish reason, as the whole answer has no call."""
    state = shape.tool_streams.setdefault(c.index, ToolStream())
    content, calls = state.delta(shape.tools, c.delta_text, c.finish_reason is not None,
                                 shape.call_id(c.index))
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if content or not calls:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    reason = c.finish_reason
    if reason == "stop" and state.calls and (shape.tools.auto or c.stop_reason is None):
        reason = "tool_calls"  # the whole answer's rule (Shape.tool_message)
    return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": reason}


def response_size(shape: Shape, out: RequestOutput) -> int:
    """Tokens times the log-probabilities each carries: what building the answer costs."""
    tokens = sum(len(c.token_ids) for c in out.outputs)
    if shape.echo is not None:
        tokens += len(out.prompt_token_ids) * len(out.outputs)
    return tokens * (1 + (shape.top_logprobs or 0))


def encode_json(obj: Any) -> bytes:
    """``obj`` as compact JSON (what ``JSONResponse`` sends), encoded in small pieces: one
    ``json.dumps`` of an 18 MB answer holds the GIL, and so the event loop, for its whole
    length; between small calls the event loop runs."""
    return "".join(_json_pieces(obj)).encode("utf-8")


def _json_pieces(obj: Any) -> Iterator[str]:
    if isinstance(obj, dict):
        yield "{"
        for i, (key, value) in enumerate(obj.items()):
            yield ("," if i else "") + _dumps(str(key)) + ":"
            yield from _json_pieces(value)
        yield "}"
    elif isinstance(obj, list) and len(obj) > 16:
        yield "["
        for i, value in enumerate(obj):
            if i:
                yield ","
            yield from _json_pieces(value)
        yield "]"
    else:
        yield _dumps(obj)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def chunk_object(shape: Shape) -> str:
    return "chat.completion.chunk" if shape.chat else "text_completion"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
