"""Structured output through the server (issue 19): ``response_format`` and ``tools`` via the
official ``openai`` client, on the bundled model and on SmolLM2-135M-Instruct; ``jsonschema``
is the referee."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import torch

import infer_lab as il
from infer_lab.serve.server import build_app
from tests.live_server import metric, running
from tests.tool_helpers import accumulate

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 12},
                "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "hobbies"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"], "additionalProperties": False}}}


def app_for(model_name: str | None, served: str):
    from infer_lab.engine import LLMEngine
    from infer_lab.serve.async_engine import AsyncEngine
    from infer_lab.serve.metrics import ServerMetrics

    model, tok = il.load(model_name, device="cpu", dtype=torch.float32)
    engine = LLMEngine(model, tok, il.EngineConfig(num_kv_blocks=512, max_num_seqs=16))
    return build_app(AsyncEngine(engine, ServerMetrics(served)), served)


@pytest.fixture(scope="module", params=[None, "smollm2-135m-instruct"],
                ids=["bundled", "smollm2"])
def server(request):
    served = request.param or "tiny-kjv"
    with running(app_for(request.param, served)) as base:
        yield base, served, openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)


ASK = [{"role": "user", "content": "Describe a person as JSON: name, age and hobbies."}]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_json_schema_response_validates(server, temperature):
    base, name, client = server
    for seed in range(2):
        r = client.chat.completions.create(
            model=name, messages=ASK, max_tokens=200, temperature=temperature, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": PERSON,
                                             "strict": True}})
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert metric(base, "structured_requests_total") >= 2


def test_json_object_and_completions_route(server):
    base, name, client = server
    r = client.chat.completions.create(model=name, messages=ASK, max_tokens=200,
                                       temperature=0, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].finish_reason == "length"
    c = client.completions.create(model=name, prompt="A person:", max_tokens=200,
                                  temperature=0, extra_body={"response_format": {
                                      "type": "json_schema",
                                      "json_schema": {"name": "p", "schema": PERSON}}})
    assert c.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(c.choices[0].text), PERSON)


def test_streamed_json_is_the_whole_json(server):
    base, name, client = server
    stream = client.chat.completions.create(
        model=name, messages=ASK, max_tokens=200, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    text, reasons = "", []
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_named_and_required_tool_calls_validate(server):
    """A forced call validates against its function's schema; the same greedy request streamed
    sends that same call as it is written (put together by ``index``, as a client does), with
    nothing as content."""
    base, name, client = server
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice, expected in (({"type": "function", "function": {"name": "get_weather"}},
                              {"get_weather"}), ("required", {"get_weather", "get_time"})):
        kw = {"model": name, "messages": ask, "max_tokens": 120, "temperature": 0,
              "tools": [WEATHER, TIME], "tool_choice": choice}
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
        assert r.choices[0].message.content is None
        (call,) = r.choices[0].message.tool_calls
        assert call.type == "function" and call.id and call.function.name in expected
        schema = (WEATHER if call.function.name == "get_weather" else TIME)["function"]
        jsonschema.validate(json.loads(call.function.arguments), schema["parameters"])
        content, calls, reason = accumulate(client.chat.completions.create(stream=True, **kw))
        assert reason == "tool_calls" and content == ""
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (call.function.name, call.function.arguments)]
        assert calls[0]["id"] and calls[0]["first"]["type"] == "function"


def test_truncated_tool_call_says_length(server):
    base, name, client = server
    r = client.chat.completions.create(
        model=name, messages=ASK, max_tokens=3, temperature=0, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls


@pytest.mark.parametrize(("extra", "param", "fragment"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format", "cannot be compiled"),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    # "auto" is served (issue 29; tests/test_server_tools.py); its grammar is checked too
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}]}, "tools",
     "cannot be compiled"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0]", "function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}],
      "tool_choice": "required"}, "tools", "cannot be compiled"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(server, extra, param, fragment):
    base, name, _ = server
    r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": name, "messages": ASK, "max_tokens": 8, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert ".cc:" not in error["message"]
