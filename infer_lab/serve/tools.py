"""Tool calls by constrained decoding.

- ``tool_choice`` "required" or a named function (a *forced* call): the output must be a JSON
  call (a JSON Schema the grammar enforces) and becomes OpenAI's ``tool_calls``: for a named
  function the output is the arguments, for "required" ``{"name": ..., "arguments": {...}}``
  naming one of the functions. A stream sends the call as "auto"'s below, as it is written: a
  named function's name in the first chunk (it is known before any token), "required"'s as
  soon as the name in the JSON is complete, then the arguments' text piece by piece
  (:meth:`ToolPlan.opened` finds it in the growing JSON: :func:`json_members`). The call is
  one only if the grammar ended the output; one cut off (``max_tokens``, or a stop string or
  stop token firing inside the JSON) is dropped from the whole answer (no ``tool_calls``, empty
  ``content``, the finish reason says why) and a stream has sent the part written, as for "auto".
- ``tool_choice`` "auto" (the default with tools): the model writes free text and decides for
  itself whether to call. A call is written in the format of ``--tool-call-parser`` (vLLM's
  flag and names: ``hermes``, the default, ``llama3_json`` or ``mistral``; see
  :mod:`infer_lab.serve.tool_formats`), e.g. Hermes / Qwen's::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  The constraint is an XGrammar *structural tag* with the format's marker as its trigger: text
  is free until the model writes the trigger; from there the grammar allows only the begin
  string of an offered function, then JSON valid for that function's parameters, then the end.
  So a started call is always a valid call of an offered tool (an unknown tool cannot be
  written), and ``parallel_tool_calls: false`` allows one call only. The server splits
  the output into the text outside calls (``content``) and the calls (``tool_calls``,
  ``finish_reason: "tool_calls"``); a stream holds back any text that may be the start of a
  call, so the markup never reaches the client, and sends each call as it is written: its
  name, then its arguments piece by piece (:class:`ToolStream`). A call cut off by
  ``max_tokens`` is dropped from the whole answer, with ``finish_reason: "length"`` (a stream
  has sent the part written).
- ``tool_choice`` "none": the tools are not offered; the model answers in text.

How the model is told about the tools (:func:`tool_prompt`): when the chat template has a tools
section (it reads the variable ``tools``; the model's template, or ``--chat-template``'s), the
request's ``tools`` are passed to it, as ``transformers`` does, and the model sees them in the
format it was trained on. Otherwise the server's default tool prompt
(:meth:`ToolPlan.with_system`, this module) lists them in the system message and, for "auto",
spells out the call format above. An assistant's earlier ``tool_calls`` reach the first kind
of template as a field and the second as text in that format (:func:`conversation`). Either way
the calls are constrained and parsed in the one format ``--tool-call-parser`` names: pick the
one the model's template teaches (as with vLLM, the server does not guess it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from infer_lab.engine.structured import StructuredOutputsParams
from infer_lab.serve.protocol import ChatCompletionRequest, ChatMessage, UnsupportedField
from infer_lab.serve.tool_formats import FORMATS, Call, CallFormat, json_written

_TOOL_SHAPE = "a tool is {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
HERMES = FORMATS["hermes"]


@dataclass
class ToolPlan:
    """How a request's tools are answered: the function called (None: the output names it),
    the constraint that makes the output a valid call, and the functions offered."""

    name: str | None
    constraint: StructuredOutputsParams
    functions: dict[str, dict[str, Any]]
    auto: bool = False  # the model chooses between text and calls (tool_choice "auto")
    format: CallFormat = HERMES  # how "auto" calls are written (--tool-call-parser)

    def with_system(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation with the functions described in its system message (the server's
        default tool prompt)."""
        offered = json.dumps([{"name": n, "parameters": p} for n, p in self.functions.items()])
        if self.auto:
            what = self.format.teach()
        elif self.name:
            what = f"Call the function {self.name} by replying with its arguments as JSON."
        else:
            what = 'Call one of them by replying with JSON: {"name": ..., "arguments": {...}}.'
        note = f"You can call these functions: {offered}\n{what}"
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": messages[0]["content"] + "\n\n" + note},
                    *messages[1:]]
        return [{"role": "system", "content": note}, *messages]

    def call(self, text: str, call_id: str) -> dict[str, Any] | None:
        """OpenAI's tool call from a complete (grammar-valid) forced output (a named function
        or "required"); None if ``text`` is not one (it does not parse, or lacks the name or
        the arguments). The arguments are their JSON's text as the model wrote it, which the
        pieces of a stream add up to."""
        found = self._forced(text)
        if found is None:
            return None
        return {"id": call_id, "type": "function", "function": found}

    def scan(self, text: str, finished: bool) -> tuple[str, list[Call], int | None]:
        """The text outside calls, the complete calls, and where the calls not yet complete
        begin (None: there are none, or the output is ``finished`` and they never will be).
        "auto": the format's :meth:`CallFormat.scan`; a forced call is the whole output, so
        there is no text and the call is complete once its JSON is."""
        if self.auto:
            return self.format.scan(text, finished)
        found = self._forced(text)
        if found is not None:
            return "", [found], None
        return "", [], None if finished else 0

    def opened(self, text: str, at: int) -> list[Call]:
        """The calls begun at ``at`` as far as they are written (:meth:`CallFormat.opened`):
        a named function's from the start, with no arguments yet; "required"'s once the name
        in its JSON is complete."""
        if self.auto:
            return self.format.opened(text, at)
        if self.name is not None:
            return [{"name": self.name, "arguments": _so_far(text, _skip(text, 0))}]
        name, start = None, None
        for key, value_at in json_members(text):
            if key == "name":
                name = _string(text, value_at)
            elif key == "arguments":
                start = value_at
        if name is None:
            return []
        return [{"name": name, "arguments": "" if start is None else _so_far(text, start)}]

    def _forced(self, text: str) -> Call | None:
        """A forced output's call once its JSON is complete: the name, and the arguments' JSON
        as written (a named function's: the whole output, less whitespace around it)."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):  # not (yet) complete; nested past Python's limit
            return None
        if self.name is not None:
            start = _skip(text, 0)
            return {"name": self.name, "arguments": text[start:_value_end(text, start)]}
        starts = dict(json_members(text))
        if not (isinstance(data, dict) and isinstance(data.get("name"), str)
                and "arguments" in starts):
            return None
        start = starts["arguments"]
        return {"name": data["name"], "arguments": text[start:_value_end(text, start)]}

    def split(self, text: str, finished: bool) -> tuple[str, list[dict[str, str]], int]:
        """An "auto" output as (the text outside calls, the complete calls as
        ``{"name", "arguments"}``, where the text shown so far must stop). Text from a call
        not yet complete, or (``finished`` False) from a trailing prefix of a marker, is
        held back; a finished output's unfinished call is dropped."""
        content, calls = self.format.split(text, finished)
        return content, calls, len(text)


@dataclass
class ToolStream:
    """One streamed choice of a request with tools ("auto" or forced): its text so far, how
    much of its content was sent, and each call's arguments sent so far."""

    text: str = ""
    sent_content: int = 0
    sent: list[str] = field(default_factory=list)  # per call begun: its arguments sent
    calls: list[dict[str, str]] = field(default_factory=list)  # the complete calls

    def delta(self, plan: ToolPlan, new_text: str, finished: bool,
              call_id: str) -> tuple[str, list[dict[str, Any]]]:
        """This chunk's content and its call deltas (OpenAI's shape, as vLLM streams them): a
        call's first delta carries its ``index``, ``id``, ``type``, name and the arguments
        written so far; the next ones (``index`` and ``function.arguments`` only) the text its
        arguments grew by, so that they add up to the whole answer's arguments. A call the
        output leaves unfinished (``max_tokens``; for a forced call also a stop string or stop
        token) has sent only a part of its arguments, and nothing more in the last chunk."""
        self.text += new_text
        content, calls, open_at = plan.scan(self.text, finished)
        out_text = content[self.sent_content:]
        self.sent_content = len(content)
        self.calls = calls
        begun = calls + (plan.opened(self.text, open_at) if open_at is not None else [])
        deltas: list[dict[str, Any]] = []
        for k, call in enumerate(begun):
            arguments = call["arguments"]
            if k == len(self.sent):
                deltas.append({"index": k, "id": f"{call_id}_{k}", "type": "function",
                               "function": {"name": call["name"], "arguments": arguments}})
                self.sent.append(arguments)
            elif arguments != self.sent[k] and arguments.startswith(self.sent[k]):
                deltas.append({"index": k, "function": {
                    "arguments": arguments[len(self.sent[k]):]}})
                self.sent[k] = arguments
        return out_text, deltas


_SCALAR = re.compile(r"-?[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")


def json_members(text: str) -> Iterator[tuple[str, int]]:
    """The members of the JSON object ``text`` begins with, as far as they are written: each
    key once complete, with where its value begins (after whitespace; it may not be written
    yet). Stops after the first member whose value is not complete. Strings are read with
    their escapes and objects with their nesting (:func:`json_written`), so a quote, brace or
    comma inside a value is never taken for the object's own; the grammar keeps the JSON
    valid, so this only has to find where things end."""
    at = _skip(text, 0)
    if not text.startswith("{", at):
        return
    at += 1
    while True:
        at = _skip(text, at)
        key = _string(text, at)
        if key is None:
            return
        colon = _skip(text, json_written(text, at)[0])
        if not text.startswith(":", colon):
            return
        start = _skip(text, colon + 1)
        yield key, start
        end = _complete_end(text, start)
        follows = _skip(text, end) if end is not None else len(text)
        if not text.startswith(",", follows):
            return
        at = follows + 1


def _skip(text: str, at: int) -> int:
    """``at`` moved past JSON's whitespace."""
    while at < len(text) and text[at] in " \t\n\r":
        at += 1
    return at


def _string(text: str, at: int) -> str | None:
    """The JSON string at ``at`` once it is complete, else None."""
    end, done = json_written(text, at)
    if not (done and text.startswith('"', at)):
        return None
    try:
        value = json.loads(text[at:end])
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _complete_end(text: str, at: int) -> int | None:
    """Where the JSON value at ``at`` ends, if something follows it (a number is complete only
    then); None while it is still being written."""
    end, done = json_written(text, at)
    if done:
        return end
    m = _SCALAR.match(text, at)
    return m.end() if m and m.end() < len(text) else None


def _so_far(text: str, at: int) -> str:
    """The text of the JSON value at ``at`` that is surely part of it (a prefix of its text
    once complete)."""
    return text[at:json_written(text, at)[0]]


def _value_end(text: str, at: int) -> int:
    """Where the (complete) JSON value at ``at`` ends."""
    return json.JSONDecoder().raw_decode(text, at)[1]


_PAST_CALL = "a tool call is {'type': 'function', 'function': {'name': ..., 'arguments': ...}}"


def conversation(messages: list[ChatMessage], template_reads_tools: bool,
                 fmt: CallFormat = HERMES) -> list[dict[str, Any]]:
    """The messages for the chat template. An assistant's earlier ``tool_calls`` reach a
    template with a tools section as a field, the arguments parsed into objects (what
    ``transformers``' templates expect; vLLM does the same), and a tool result keeps its
    ``tool_call_id``; any other template sees the calls written into the assistant's text in
    the default format, the one the default tool prompt teaches."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        extra = m.model_extra or {}
        if m.role == "assistant" and extra.get("tool_calls"):
            calls = _past_calls(extra["tool_calls"], f"messages[{i}].tool_calls")
            if template_reads_tools:
                message["tool_calls"] = calls
            else:
                message["content"] += fmt.write(
                    [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
        if m.role == "tool" and isinstance(extra.get("tool_call_id"), str):
            message["tool_call_id"] = _plain(extra["tool_call_id"], f"messages[{i}].tool_call_id")
        out.append(message)
    return out


def _past_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise UnsupportedField(where, "must be a list; " + _PAST_CALL)
    calls = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise UnsupportedField(f"{where}[{j}]", _PAST_CALL)
        arguments = fn.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise UnsupportedField(f"{where}[{j}].function.arguments",
                                       "must be JSON") from None
        past = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            past["id"] = call["id"]
        calls.append(_plain(past, f"{where}[{j}]"))
    return calls


def _plain(value: Any, where: str) -> Any:
    """``value``, if it can be written as UTF-8 JSON (no lone surrogates from a ``\\ud800``)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, ValueError, RecursionError):
        raise UnsupportedField(where, "is not valid Unicode JSON") from None
    return value


def tool_prompt(plan: ToolPlan | None, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None, template_reads_tools: bool,
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation and the ``tools`` variable the chat template gets: with a plan, the
    request's ``tools`` when the template has a tools section, else none and the server's
    default tool prompt in the system message; without one, the conversation alone."""
    if plan is None:
        return messages, None
    if template_reads_tools:
        return messages, tools
    return plan.with_system(messages), None


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not (
                isinstance(fn.get("name"), str) and fn["name"]):
            raise UnsupportedField(f"tools[{i}]", _TOOL_SHAPE)
        if not _NAME.match(fn["name"]):
            raise UnsupportedField(f"tools[{i}].function.name", "must be 1-64 letters, digits, "
                                   "underscores or dashes")
        if fn["name"] in functions:
            raise UnsupportedField(f"tools[{i}].function.name", f"{fn['name']!r} is given twice")
        parameters = fn.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise UnsupportedField(f"tools[{i}].function.parameters", "must be a JSON Schema "
                                   "object")
        functions[fn["name"]] = parameters
    return functions


def tool_plan(body: ChatCompletionRequest, fmt: CallFormat = HERMES) -> ToolPlan | None:
    """The plan for ``body``'s tools, None if it has none (or ``tool_choice: "none"``);
    "auto" calls are written in ``fmt``."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise UnsupportedField("tool_choice", "needs tools")
        return None
    if choice == "none":
        return None
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise UnsupportedField("response_format", "cannot be combined with tools")
    functions = _functions(body.tools)
    if choice in (None, "auto"):
        return auto_plan(functions, body.parallel_tool_calls is not False, fmt)
    if choice == "required":
        schema = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": n}, "arguments": p}, "required": ["name", "arguments"],
            "additionalProperties": False} for n, p in functions.items()]}
        return ToolPlan(None, StructuredOutputsParams(json=schema), functions)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or choice.get("type") != "function":
        raise UnsupportedField("tool_choice", "must be 'none', 'required' or "
                               "{'type': 'function', 'function': {'name': ...}}")
    if fn.get("name") not in functions:
        raise UnsupportedField("tool_choice", f"names {fn.get('name')!r}, which is not "
                               "among the tools")
    return ToolPlan(fn["name"], StructuredOutputsParams(json=functions[fn["name"]]), functions)


def auto_plan(functions: dict[str, dict[str, Any]], parallel: bool,
              fmt: CallFormat = HERMES) -> ToolPlan:
    """``tool_choice: "auto"``: free text, and calls in ``fmt`` whose begin string names an
    offered function and whose arguments follow its schema (a structural tag)."""
    tag = {"type": "structural_tag", "format": fmt.structural_tag(functions, parallel)}
    return ToolPlan(None, StructuredOutputsParams(structural_tag=tag), functions, auto=True,
                    format=fmt)
