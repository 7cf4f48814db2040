"""Tool calls by constrained decoding: ``tools`` with ``tool_choice`` "required" or a named
function become a JSON Schema the output must follow, and the output becomes OpenAI's
``tool_calls``. ``tool_choice: "auto"`` is refused: a 135 M-parameter model cannot be trusted
to decide between answering and calling, and a server that guessed for it would not be honest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from infer_lab.engine.structured import StructuredOutputsParams
from infer_lab.serve.protocol import ChatCompletionRequest, UnsupportedField

_TOOL_SHAPE = "a tool is {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}"


@dataclass
class ToolPlan:
    """How a request's tools are answered: the function called (None: the output names it),
    the constraint that makes the output a valid call, and the functions offered."""

    name: str | None
    constraint: StructuredOutputsParams
    functions: dict[str, dict[str, Any]]

    def with_system(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """The conversation with the functions described in its system message."""
        offered = json.dumps([{"name": n, "parameters": p} for n, p in self.functions.items()])
        what = (f"Call the function {self.name} by replying with its arguments as JSON."
                if self.name else "Call one of them by replying with JSON: "
                '{"name": ..., "arguments": {...}}.')
        note = f"You can call these functions: {offered}\n{what}"
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": messages[0]["content"] + "\n\n" + note},
                    *messages[1:]]
        return [{"role": "system", "content": note}, *messages]

    def call(self, text: str, call_id: str) -> dict[str, Any] | None:
        """OpenAI's tool call from a complete (grammar-valid) output; None if ``text`` is not
        one (it does not parse, or lacks the name or the arguments)."""
        try:
            data = json.loads(text)
            if self.name is not None:
                name, arguments = self.name, text
            else:
                name = data["name"]
                arguments = json.dumps(data["arguments"], ensure_ascii=False)
        except (ValueError, TypeError, KeyError):
            return None
        return {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not (
                isinstance(fn.get("name"), str) and fn["name"]):
            raise UnsupportedField(f"tools[{i}]", _TOOL_SHAPE)
        parameters = fn.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise UnsupportedField(f"tools[{i}].function.parameters", "must be a JSON Schema "
                                   "object")
        functions[fn["name"]] = parameters
    return functions


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """The plan for ``body``'s tools, None if it has none (or ``tool_choice: "none"``)."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise UnsupportedField("tool_choice", "needs tools")
        return None
    if choice == "none":
        return None
    if choice in (None, "auto"):
        raise UnsupportedField("tool_choice", "'auto' (the default when tools are given) is "
                               "not supported: this model cannot be trusted to choose between "
                               "answering and calling; pass 'required' or "
                               "{'type': 'function', 'function': {'name': ...}}")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise UnsupportedField("response_format", "cannot be combined with tools")
    functions = _functions(body.tools)
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
