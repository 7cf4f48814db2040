"""The tool-call formats the major chat templates teach, chosen by ``infer-lab serve
--tool-call-parser`` (vLLM's flag and names); each knows how a call is written, how to describe
that to the model, the XGrammar structural tag that makes a started call valid, and how to split
an output into text and calls.

- ``hermes`` (Hermes, Qwen; the default)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- ``llama3_json`` (Llama 3.1/3.2's JSON tool calling; the template asks for the arguments as
  ``parameters``), optionally after ``<|python_tag|>``, several calls separated by ``;``::

      {"name": "get_weather", "parameters": {"city": "Paris"}}

- ``mistral`` (Mistral 7B Instruct v0.3 and its template): every call of the turn in one JSON
  list after the marker, which ends the output::

      [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

A marker may be one special token of the model's tokenizer (Mistral's ``[TOOL_CALLS]``, Llama
3's ``<|python_tag|>``): :meth:`CallFormat.special_marker_ids` names those, and the server asks
the engine's detokenizer to keep their text although it skips special tokens, so the parser sees
the same text either way. XGrammar reads a token by its text, so the one token is the trigger as
much as the characters spelled out are (``tests/test_server_tool_markers.py``).

A stream sends each call as it is written, as vLLM's tool parsers do (:meth:`CallFormat.scan`,
:meth:`CallFormat.opened`): the name once it is written, then the arguments' text as it grows.
The arguments of a call are the text of the JSON value as the model wrote it, so the pieces a
stream sends add up to exactly what the whole answer gives.
"""

from __future__ import annotations

import json
import re
from typing import Any

Call = dict[str, str]  # {"name": ..., "arguments": <JSON text, as the model wrote it>}
_WS = re.compile(r"\s*")


class CallFormat:
    """How calls are written in one format. Subclasses set ``name``, ``trigger`` (the text
    that starts calls: from it on, the grammar allows only a valid call) and ``markers`` (text
    a stream holds back while it may be starting: the trigger and any optional prefix)."""

    name = ""
    trigger = ""
    markers: tuple[str, ...] = ()
    tokens: tuple[str, ...] = ()  # markup a tokenizer may hold as one special token

    def special_marker_ids(self, tokenizer: Any) -> frozenset[int]:
        """The ids of the markup that is one special token of ``tokenizer``: its detokenizer
        must keep their text (it skips special tokens) for the calls to be parsed."""
        ids = (tokenizer.token_to_id(t) for t in self.tokens)
        return frozenset(i for i in ids if i is not None and i in tokenizer.special_ids)

    def teach(self) -> str:
        """The sentence of the default tool prompt that spells out the format."""
        raise NotImplementedError

    def write(self, calls: list[tuple[str, Any]]) -> str:
        """Earlier calls (name, arguments as an object) as the model would have written them."""
        raise NotImplementedError

    def structural_tag(self, functions: dict[str, dict[str, Any]],
                       parallel: bool) -> dict[str, Any]:
        """XGrammar's structural tag for "auto": free text, calls of offered functions only."""
        raise NotImplementedError

    def parse_at(self, text: str, start: int) -> tuple[list[Call] | None, int]:
        """The calls written from ``start`` (where the trigger is) and where they end; None
        while they are not complete (or, finished, were cut off)."""
        raise NotImplementedError

    def opened(self, text: str, start: int) -> list[Call]:
        """The calls begun at ``start`` (a trigger whose calls are not complete) as far as they
        are written: each once its name is, with the part of its arguments written so far (a
        prefix of what :meth:`parse_at` will give)."""
        raise NotImplementedError

    def text(self, segment: str, after_call: bool, final: bool) -> str:
        """A stretch of text outside calls as content (``after_call``: it follows a call;
        ``final``: nothing more will be appended to it)."""
        return segment

    def split(self, text: str, finished: bool) -> tuple[str, list[Call]]:
        """The text outside calls and the complete calls. Text from a call not yet complete,
        or (``finished`` False) a trailing prefix of a marker, is held back; a finished
        output's unfinished call is dropped."""
        content, calls, _ = self.scan(text, finished)
        return content, calls

    def scan(self, text: str, finished: bool) -> tuple[str, list[Call], int | None]:
        """:meth:`split`, and where the calls not yet complete begin (None: there are none)."""
        content, calls, at = [], [], 0
        while (start := text.find(self.trigger, at)) >= 0:
            content.append(self.text(text[at:start], bool(calls), True))
            found, end = self.parse_at(text, start)
            if found is None:
                return "".join(content), calls, None if finished else start
            calls += found
            at = end
        tail = self.text(text[at:], bool(calls), finished)
        if not finished:
            tail = tail[: len(tail) - _marker_prefix(tail, self.markers)]
        content.append(tail)
        return "".join(content), calls, None


def _marker_prefix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    longest = max((len(m) for m in markers), default=1)
    for k in range(min(len(text), longest - 1), 0, -1):
        if any(m.startswith(text[-k:]) and len(m) > k for m in markers):
            return k
    return 0


def _json_tag(begin: str, schema: dict[str, Any], end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin,
            "content": {"type": "json_schema", "json_schema": schema}, "end": end}


def _arguments(text: str, at: int) -> tuple[Any, int] | None:
    """The JSON value at ``at`` and where it ends; None if it is not (yet) complete."""
    try:
        return json.JSONDecoder().raw_decode(text, _WS.match(text, at).end())
    except ValueError:
        return None


def _call(name: str, arguments: Any) -> Call:
    return {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}


# What json_written looks at: a string (escapes skipped; group 1 the closing quote, absent while
# it is open) or a bracket; everything else (numbers, literals, commas, colons, whitespace) is
# stepped over inside the regex engine, not a Python loop (a stream scans its call once a chunk).
_JSON_PARTS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(")?|[{}\[\]]', re.DOTALL)


def json_written(text: str, at: int) -> tuple[int, bool]:
    """How much of the JSON value at ``at`` is surely written: (its end, True) once complete,
    else (where the text that is surely part of it ends, False). An object, array or string is
    sent as it grows; a bare number, ``true``, ``false`` or ``null`` only whole (its end shows
    only in what follows). Validity is the grammar's business: this only counts brackets,
    outside strings (a quote or bracket escaped or inside a string does not count)."""
    if at >= len(text) or text[at] not in '{["':
        return at, False
    depth = 0
    for m in _JSON_PARTS.finditer(text, at):
        c = text[m.start()]
        if c == '"':
            if m.group(1) is None:  # a string still open: the rest of the text is in it
                return len(text), False
            if depth == 0:
                return m.end(), True
        elif c in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return m.end(), True
    return len(text), False


def _open_call(name: str, text: str, at: int) -> Call:
    """A call whose arguments begin at ``at`` (after whitespace), as far as they are written."""
    start = _WS.match(text, at).end()
    return {"name": name, "arguments": text[start:json_written(text, start)[0]]}


def _raw_call(name: str, text: str, at: int) -> tuple[Call, int] | None:
    """The call whose arguments are the JSON value at ``at`` (after whitespace), its arguments
    the value's text as written, and where it ends; None if it is not (yet) complete."""
    start = _WS.match(text, at).end()
    found = _arguments(text, start)
    if found is None:
        return None
    return {"name": name, "arguments": text[start:found[1]]}, found[1]


class Hermes(CallFormat):
    name = "hermes"
    trigger = "<tool_call>"
    markers = (trigger,)
    tokens = (trigger, "</tool_call>")
    end = "}\n</tool_call>"
    _head = re.compile(r'\n\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')

    def begin(self, name: str) -> str:
        return f'{self.trigger}\n{{"name": "{name}", "arguments": '

    def teach(self) -> str:
        return ("To call one, write <tool_call>, a newline, "
                '{"name": <function name>, "arguments": <arguments as JSON>}, a newline and '
                "</tool_call>. Otherwise answer in text.")

    def write(self, calls: list[tuple[str, Any]]) -> str:
        return "".join(self.begin(name) + json.dumps(arguments, ensure_ascii=False) + self.end
                       for name, arguments in calls)

    def structural_tag(self, functions: dict[str, dict[str, Any]],
                       parallel: bool) -> dict[str, Any]:
        tags = [_json_tag(self.begin(n), s, self.end) for n, s in functions.items()]
        return {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags,
                "at_least_one": False, "stop_after_first": not parallel}

    def parse_at(self, text: str, start: int) -> tuple[list[Call] | None, int]:
        m = self._head.match(text, start + len(self.trigger))
        found = _raw_call(m.group(1), text, m.end()) if m else None
        if found is None or not text.startswith(self.end, found[1]):
            return None, start
        return [found[0]], found[1] + len(self.end)

    def opened(self, text: str, start: int) -> list[Call]:
        m = self._head.match(text, start + len(self.trigger))
        return [_open_call(m.group(1), text, m.end())] if m else []


class Llama3Json(CallFormat):
    name = "llama3_json"
    trigger = '{"name": '
    python_tag = "<|python_tag|>"
    markers = (trigger, python_tag)
    tokens = (python_tag,)
    _head = re.compile(r'"([A-Za-z0-9_-]{1,64})", "(?:parameters|arguments)": ')
    _separator = re.compile(r"\s*;\s*")

    def begin(self, name: str) -> str:
        return f'{self.trigger}"{name}", "parameters": '

    def teach(self) -> str:
        return ('To call one, reply with JSON: {"name": <function name>, "parameters": '
                "<arguments as JSON>} (several calls separated by ;). Otherwise answer in "
                "text.")

    def write(self, calls: list[tuple[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
                         for name, arguments in calls)

    def structural_tag(self, functions: dict[str, dict[str, Any]],
                       parallel: bool) -> dict[str, Any]:
        tags = [_json_tag(self.begin(n), s, "}") for n, s in functions.items()]
        return {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags,
                "at_least_one": False, "stop_after_first": not parallel}

    def parse_at(self, text: str, start: int) -> tuple[list[Call] | None, int]:
        m = self._head.match(text, start + len(self.trigger))
        found = _raw_call(m.group(1), text, m.end()) if m else None
        if found is None:
            return None, start
        close = _WS.match(text, found[1]).end()
        if not text.startswith("}", close):
            return None, start
        return [found[0]], close + 1

    def opened(self, text: str, start: int) -> list[Call]:
        m = self._head.match(text, start + len(self.trigger))
        return [_open_call(m.group(1), text, m.end())] if m else []

    def text(self, segment: str, after_call: bool, final: bool) -> str:
        """Without ``<|python_tag|>`` and, after a call, the ``;`` that separates calls
        (held back while only whitespace has followed the call)."""
        segment = segment.replace(self.python_tag, "")
        if after_call:
            if not final and not segment.strip():
                return ""
            if m := self._separator.match(segment):
                segment = segment[m.end():]
        return segment


class Mistral(CallFormat):
    name = "mistral"
    trigger = "[TOOL_CALLS]"
    markers = (trigger,)
    tokens = (trigger,)
    # a call as the grammar writes it, up to its arguments (whose text is then kept as written)
    _item = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:')
    _next = re.compile(r"\s*([,\]])")

    def teach(self) -> str:
        return ('To call functions, write [TOOL_CALLS] and then a JSON list of calls: '
                '[{"name": <function name>, "arguments": <arguments as JSON>}, ...]. '
                "Otherwise answer in text.")

    def write(self, calls: list[tuple[str, Any]]) -> str:
        return f"{self.trigger} " + json.dumps(
            [{"name": name, "arguments": arguments} for name, arguments in calls],
            ensure_ascii=False)

    def structural_tag(self, functions: dict[str, dict[str, Any]],
                       parallel: bool) -> dict[str, Any]:
        """One list after the marker, then the end of the output (the format's own rule):
        calls of offered functions separated by ``, ``, one only if not ``parallel``."""
        calls = [_json_tag(f'{{"name": "{n}", "arguments": ', s, "}")
                 for n, s in functions.items()]
        listed = {"type": "tags_with_separator", "tags": calls, "separator": ", ",
                  "at_least_one": True, "stop_after_first": not parallel}
        block = {"type": "tag", "begin": f"{self.trigger} [", "content": listed, "end": "]"}
        return {"type": "triggered_tags", "triggers": [self.trigger], "tags": [block],
                "at_least_one": False, "stop_after_first": True}

    def parse_at(self, text: str, start: int) -> tuple[list[Call] | None, int]:
        items, end = self._items(text, start)
        if end is None:
            return None, start
        return [call for call, _ in items], end

    def opened(self, text: str, start: int) -> list[Call]:
        return [call for call, _ in self._items(text, start)[0]]

    def _items(self, text: str, start: int) -> tuple[list[tuple[Call, bool]], int | None]:
        """The calls of the list after the marker at ``start`` as far as they are written,
        each with whether it is complete, and where the list ends (None while it is open, or
        if it is not a non-empty list of calls). A call written as the grammar writes it keeps
        its arguments' text and shows as it grows; another one (keys in another order) only
        once complete, its arguments re-serialized."""
        at = _WS.match(text, start + len(self.trigger)).end()
        if not text.startswith("[", at):
            return [], None
        items: list[tuple[Call, bool]] = []
        at += 1
        while True:
            at = _WS.match(text, at).end()
            m = self._item.match(text, at)
            whole = _arguments(text, at)
            call = _open_call(m.group(1), text, m.end()) if m else None
            if whole is None:
                return items + ([(call, False)] if call else []), None
            item, at = whole
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and "arguments" in item):
                return items, None
            raw = _raw_call(m.group(1), text, m.end()) if m else None
            items.append((raw[0] if raw else _call(item["name"], item["arguments"]), True))
            follows = self._next.match(text, at)
            if follows is None:
                return items, None
            at = follows.end()
            if follows.group(1) == "]":
                return items, at


FORMATS: dict[str, CallFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Mistral())}
TOOL_CALL_PARSERS = tuple(FORMATS)  # --tool-call-parser's choices (the CLI spells them out)
DEFAULT_TOOL_CALL_PARSER = "hermes"


def call_format(name: str) -> CallFormat:
    """The format ``--tool-call-parser name`` selects; a ``ValueError`` naming the choices."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"--tool-call-parser {name!r}: not one of "
                         f"{', '.join(TOOL_CALL_PARSERS)}") from None
