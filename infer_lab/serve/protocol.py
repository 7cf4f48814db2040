"""The OpenAI request bodies the server accepts, as pydantic models.

Validation happens here, before a request reaches the engine: a wrong type or an out-of-range
value is a 400 with OpenAI's error shape, never a failure inside a batch that other requests share.
Every number is bounded by what the engine can represent (``top_k`` below 2**31, not 2**63), and
a field OpenAI or vLLM define that this server does not implement is refused by name when its
value would change the output (``REFUSED_FIELDS``: ``typical_p``, beam search, the
``guided_*`` fields...); its neutral value (``typical_p: 1``, ``suffix: ""``...) is
accepted. A field nobody defines is ignored, as OpenAI's and vLLM's servers do: routers and SDKs
add their own (``metadata``, ``store``, ``service_tier``, ``user``...), and none of those
changes what the model writes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from infer_lab.engine.structured import StructuredOutputsParams

MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions
MAX_CHAT_TOP_LOGPROBS = 20  # and for /v1/chat/completions
MAX_LOGIT_BIAS = 1024  # entries (SamplingParams' bound)
_INT32 = 2**31 - 1


class UnsupportedField(ValueError):
    """A field whose value would change the output in a way this server does not implement."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field


def check_text(value: str, where: str) -> str:
    """Refuse text that is not valid Unicode (a lone surrogate cannot be tokenized)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where} is not valid Unicode text (a lone surrogate at "
                         f"character {e.start})") from None
    return value


class StreamOptions(BaseModel):
    include_usage: bool = False


def _finite(default: float, lo: float, hi: float, *, gt: bool = False) -> Any:
    bound = {"gt": lo} if gt else {"ge": lo}
    return Field(default=default, le=hi, allow_inf_nan=False, **bound)


_GUIDED = "use response_format or structured_outputs (vLLM's guided_* fields are gone)"
# Fields OpenAI or vLLM define that would change the output and that this server does not
# implement: (values that change nothing, why). None is always accepted. Checked: every
# sampling, decoding and prompt field of OpenAI's completions and chat APIs and of vLLM's
# extra parameters (0.11); those not here are honoured, or change nothing the model writes.
REFUSED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "typical_p": ((1,), "is not supported (only 1)"),
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1,), "is not supported (it is for beam search)"),
    "early_stopping": ((False,), "is not supported (it is for beam search)"),
    "include_stop_str_in_output": ((False,), "is not supported (only false)"),
    "skip_special_tokens": ((True,), "is not supported (only true)"),
    "spaces_between_special_tokens": ((True,), "is not supported (only true)"),
    "truncate_prompt_tokens": ((), "is not supported: a prompt too long is refused"),
    "allowed_token_ids": ((), "is not supported"),
    "bad_words": (([],), "is not supported"),
    "logits_processors": ((), "is not supported"),
    "vllm_xargs": (({},), "is not supported"),
    "guided_json": ((), _GUIDED), "guided_regex": ((), _GUIDED),
    "guided_choice": ((), _GUIDED), "guided_grammar": ((), _GUIDED),
    "guided_decoding_backend": ((), _GUIDED), "guided_whitespace_pattern": ((), _GUIDED),
    "reasoning_effort": ((), "is not supported (this is not a reasoning model)"),
    "verbosity": ((), "is not supported"),
    "web_search_options": ((), "is not supported"),
}
CHAT_REFUSED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "add_generation_prompt": ((True,), "is not supported (only true)"),
    "continue_final_message": ((False,), "is not supported (only false)"),
    "add_special_tokens": ((False,), "is not supported (the chat template writes them)"),
    "chat_template": ((), "is not supported: the model's own template is used"),
    "chat_template_kwargs": (({},), "is not supported"),
    "documents": (([],), "is not supported"),
    "echo": ((False,), "is not supported (only false)"),
    "prompt_logprobs": ((), "is not supported on chat (use /v1/completions)"),
}
COMPLETION_REFUSED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "add_special_tokens": ((True,), "is not supported (only true)"),
}


def refuse_fields(extra: dict[str, Any] | None, table: dict[str, tuple[tuple[Any, ...], str]],
                  ) -> None:
    """Raise :class:`UnsupportedField` for the first field of ``table`` in ``extra`` whose value
    is neither None nor one of its neutral values."""
    for name, value in (extra or {}).items():
        if name in table and value is not None and not _neutral(value, table[name][0]):
            raise UnsupportedField(name, table[name][1])


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # a bool equals 0 or 1 in Python: match bools by identity, the rest by value
    return any(value is n if isinstance(n, bool) or isinstance(value, bool) else value == n
               for n in neutral)


class SamplingFields(BaseModel):
    """Fields shared by completions and chat (OpenAI's names; vLLM's extras top_k, ignore_eos,
    repetition_penalty). Other fields are kept in ``model_extra``: the refused ones are checked
    by name, the rest ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=_INT32)
    temperature: float = _finite(1.0, 0.0, 100.0)
    top_p: float = _finite(1.0, 0.0, 1.0, gt=True)
    top_k: int = Field(default=0, ge=-1, le=_INT32)
    min_p: float = _finite(0.0, 0.0, 1.0)  # vLLM's extra
    min_tokens: int = Field(default=0, ge=0, le=_INT32)  # vLLM's extra
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=1024)
    n: int = Field(default=1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    presence_penalty: float = _finite(0.0, -2.0, 2.0)
    frequency_penalty: float = _finite(0.0, -2.0, 2.0)
    repetition_penalty: float = _finite(1.0, 0.0, 2.0, gt=True)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    best_of: int | None = Field(default=None, ge=1, le=64)
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs' tokens as "token_id:N"
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar

    def constraint(self) -> StructuredOutputsParams | None:
        """The output constraint ``response_format`` (OpenAI) or ``structured_outputs``
        (vLLM) asks for; ``UnsupportedField`` for a shape we do not know."""
        if self.structured_outputs is not None:
            if self.response_format and self.response_format.get("type") != "text":
                raise UnsupportedField("structured_outputs", "give it or response_format, "
                                       "not both")
            try:
                return StructuredOutputsParams(**self.structured_outputs)
            except TypeError:
                raise UnsupportedField("structured_outputs", "its keys are json, json_object, "
                                       "regex, choice, grammar, structural_tag, "
                                       "whitespace") from None
            except ValueError as e:
                raise UnsupportedField("structured_outputs", str(e)) from None
        return response_format_constraint(self.response_format)

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        for s in stops:
            check_text(s, "a stop string")
            if len(s) > MAX_STOP_LEN:
                raise ValueError(f"a stop string is at most {MAX_STOP_LEN} characters, "
                                 f"got {len(s)}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, v: list[int] | None) -> list[int] | None:
        if v and not all(0 <= t <= _INT32 for t in v):
            raise ValueError("stop_token_ids must be token ids (0 <= id < 2**31)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        """OpenAI's: keys are token ids (as JSON strings), values in [-100, 100]."""
        for key, value in (v or {}).items():
            if not (key.isascii() and key.isdigit() and int(key) <= _INT32):
                raise ValueError(f"keys must be token ids (integers in [0, 2**31)), got {key!r}")
            if not -100 <= value <= 100:  # NaN fails this too
                raise ValueError(f"values must be in [-100, 100], got {value} for token {key}")
        return v

    def token_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with integer keys (None when empty)."""
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    def unsupported(self) -> None:
        """Raise :class:`UnsupportedField` for the first field whose value we cannot honour."""
        refuse_fields(self.model_extra, REFUSED_FIELDS)
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedField("best_of", "is not supported (only best_of == n)")


class CompletionRequest(SamplingFields):
    """OpenAI's completion: ``prompt`` is text, token ids, or a batch of either (each prompt's
    ``n`` choices, in order); ``echo`` puts the prompt before each choice's text (and its tokens'
    log-probabilities before the completion's, the first null, with ``logprobs``);
    ``max_tokens: 0`` with ``echo`` scores the prompt without generating. ``prompt_logprobs``
    (vLLM's extra) returns the prompt's log-probabilities in vLLM's per-choice shape."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0, le=_INT32)
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, v: Any) -> Any:
        if isinstance(v, str):
            check_text(v, "prompt")
        elif v and isinstance(v[0], str):
            for item in v:
                check_text(item, "prompt")
        elif v:  # token ids: min and max run in C, a per-id Python loop would hold the loop
            lists = v if isinstance(v[0], list) else [v]
            if any(ids and (min(ids) < 0 or max(ids) > _INT32) for ids in lists):
                raise ValueError("prompt token ids must be in [0, 2**31)")
        return v

    def unsupported(self) -> None:
        super().unsupported()
        refuse_fields(self.model_extra, COMPLETION_REFUSED_FIELDS)
        if self.echo and self.stream:
            raise UnsupportedField("echo", "cannot be combined with stream (the prompt's "
                                   "log-probabilities come whole, with the answer)")
        if self.prompt_logprobs is not None and self.stream:
            raise UnsupportedField("prompt_logprobs", "cannot be combined with stream")
        if self.max_tokens == 0 and not self.echo:
            raise UnsupportedField("max_tokens", "0 only with echo (to score the prompt)")
        if self.suffix:
            raise UnsupportedField("suffix", "is not supported")


class ContentPart(BaseModel):
    """One part of a message's content. Text parts must carry a string; other types (image_url,
    input_audio, file) parse, and are then refused by name as unsupported."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: Any = None

    @model_validator(mode="after")
    def _text_is_str(self) -> ContentPart:
        if self.type == "text":
            if not isinstance(self.text, str):
                raise ValueError("a text part needs 'text' as a string")
            check_text(self.text, "text")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    @field_validator("content")
    @classmethod
    def _valid(cls, v: Any) -> Any:
        if isinstance(v, str):
            check_text(v, "content")
        return v

    def text(self) -> str:
        """Plain text of the message (its text parts joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content if p.type == "text")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # "auto": more than one call per answer
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    prediction: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None

    def unsupported(self) -> None:
        super().unsupported()
        refuse_fields(self.model_extra, CHAT_REFUSED_FIELDS)
        if self.functions or self.function_call not in (None, "none"):
            raise UnsupportedField("functions", "the legacy functions API is not supported: "
                                   "use tools")
        if self.prediction:
            raise UnsupportedField("prediction", "predicted outputs are not supported")
        if self.audio or (self.modalities and self.modalities != ["text"]):
            raise UnsupportedField("modalities", "only text output is supported")
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedField("top_logprobs", "needs logprobs: true")
        for i, m in enumerate(self.messages):
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                if part.type != "text":
                    raise UnsupportedField(f"messages[{i}].content[{j}]",
                                           f"content parts of type {part.type!r} are not "
                                           "supported (text only)")


def response_format_constraint(fmt: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format``: text (no constraint), ``json_object`` or ``json_schema``
    (``{"json_schema": {"name": ..., "schema": {...}, "strict": ...}}``)."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise UnsupportedField("response_format", f"type {kind!r} is not supported (text, "
                               "json_object, json_schema)")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
        raise UnsupportedField("response_format", "json_schema needs an object with a "
                               "'schema' object")
    try:  # strict or not, the output follows the schema: constrained decoding is strict
        return StructuredOutputsParams(json=spec.get("schema", {}))
    except ValueError as e:
        raise UnsupportedField("response_format", str(e)) from None


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error JSON: what its clients parse into an exception with this message."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
