"""Tool-call markers that are one special token (issue 29): Mistral's ``[TOOL_CALLS]`` and Llama
3's ``<|python_tag|>`` are single special tokens of those models' tokenizers. The bundled model's
tokenizer is rebuilt with both as special added tokens (``tests.tool_helpers.marker_model``; no
tokenizer comes from a hub), and a call that the model begins with the marker *token* must come
out as ``tool_calls``, the marker in neither ``content`` nor the arguments, streamed or not,
through the official ``openai`` client; the grammar must take the one token as the trigger.

As in ``tests/test_server_tools.py``, the model is steered into writing a call (+1000 on a
scripted token at each position after the prompt); the grammar still applies on top.
"""

from __future__ import annotations

import json

import openai
import pytest

from infer_lab.engine.sampling_params import SamplingParams
from infer_lab.engine.structured import StructuredOutputs
from infer_lab.model.loader import load
from infer_lab.model.tokenizer import Tokenizer
from infer_lab.serve.server import make_app
from infer_lab.serve.tool_formats import FORMATS
from infer_lab.serve.tools import auto_plan
from tests.live_server import metric, running, wait_for
from tests.tool_helpers import marker_model, steered, streamed_like_whole, strict

MODEL = "tiny-kjv"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [strict(WEATHER), strict(TIME)]
FUNCTIONS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
MARKER = {"mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}
# Two calls after some text, each format's marker first (the one special token).
TWO_CALLS = {
    "mistral": 'Let me look. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": '
               '"Paris"}}, {"name": "get_time", "arguments": {"zone": 2}}]',
    "llama3_json": 'Let me look. <|python_tag|>{"name": "get_weather", "parameters": {"city": '
                   '"Paris"}}; {"name": "get_time", "parameters": {"zone": 2}}',
}
WANT = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": 2})]
MARKUP = ("[TOOL", "<|", '{"name"', "python_tag", "[{")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return marker_model(tmp_path_factory.mktemp("markers") / MODEL)


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def test_the_markers_are_one_special_token_and_kept_only_when_asked(tok):
    bundled = load(None, device="cpu")[1]
    for name, marker in MARKER.items():
        [marker_id] = tok.encode(marker)
        assert marker_id in tok.special_ids and marker_id < 3072  # the model can write it
        assert FORMATS[name].special_marker_ids(tok) == {marker_id}
        assert not FORMATS[name].special_marker_ids(bundled)  # there it is text
        ids = tok.encode(TWO_CALLS[name])
        assert marker_id in ids
        assert marker not in tok.decode(ids)  # skipped with the other special tokens...
        kept = tok.decode(ids + [0], keep={marker_id})
        assert kept == TWO_CALLS[name]  # ...unless kept, while EOS (0) is still skipped
        detok = tok.detokenizer(tok.encode("<|assistant|>\n"), keep={marker_id})
        streamed = "".join(detok.add(t) for t in ids + [0]) + detok.flush()
        assert streamed == kept  # streaming agrees with the whole decode
    assert not FORMATS["hermes"].special_marker_ids(tok)
    with pytest.raises(TypeError, match="keep_special_token_ids"):
        SamplingParams(keep_special_token_ids=["[TOOL_CALLS]"])


@pytest.mark.parametrize("name", list(MARKER))
def test_the_grammar_takes_the_marker_token_as_its_trigger(tok, name):
    """Token by token, the structural tag accepts a call begun by the one-token marker, and
    after that token refuses a tool that was not offered."""
    so = StructuredOutputs(tok, 3072, {0})
    marker_id = tok.token_to_id(MARKER[name])
    for parallel in (True, False):
        plan = auto_plan(FUNCTIONS, parallel, FORMATS[name])
        ids = tok.encode(TWO_CALLS[name])
        at = ids.index(marker_id)
        matcher, taken = so.matcher(plan.constraint), 0
        for t in ids:
            if not matcher.accept_token(t):
                break
            taken += 1
        second = len(tok.encode(TWO_CALLS[name].split(";")[0].split("}}, ")[0]))
        assert taken == len(ids) if parallel else at < second <= taken < len(ids)
        wrong = tok.encode(TWO_CALLS[name].replace("get_weather", "get_wether"))
        matcher = so.matcher(plan.constraint)
        assert all(matcher.accept_token(t) for t in wrong[: at + 1])  # the marker token
        assert not all(matcher.accept_token(t) for t in wrong[at + 1:])


@pytest.fixture(scope="module", params=list(MARKER))
def app(request, model_dir):
    return make_app(model_dir, device="cpu", num_kv_blocks=256, max_num_seqs=8,
                    tool_call_parser=request.param)


@pytest.fixture(scope="module")
def server(app):
    with running(app) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)


@pytest.fixture()
def steer(app, client):
    """``steer(text, tools)``: the model writes the tokens of ``text`` (then EOS) after the
    prompt of ASK with those tools; returns them."""
    engine = app.state.server.engine.engine
    real = engine.runner.forward

    def install(text: str, tools: list | None = TOOLS) -> list[int]:
        start = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools,
                                               max_tokens=1).usage.prompt_tokens
        script = engine.tokenizer.encode(text) + sorted(engine.eos_ids)[:1]
        engine.runner.forward = steered(real, start, script)
        return script

    yield install
    engine.runner.forward = real


def test_a_call_begun_with_the_marker_token_becomes_tool_calls(app, client, server, steer):
    name = app.state.server.tool_format.name
    marker = MARKER[name]
    script = steer(TWO_CALLS[name])
    assert app.state.server.tokenizer.token_to_id(marker) in script  # written as one token
    kw = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 120,
          "temperature": 0}
    r = client.chat.completions.create(logprobs=True, **kw).choices[0]
    assert marker in [t.token for t in r.logprobs.content]  # the model wrote the one token
    assert r.finish_reason == "tool_calls" and r.message.content == "Let me look."
    assert [(t.function.name, json.loads(t.function.arguments))
            for t in r.message.tool_calls] == WANT
    whole, calls, content = streamed_like_whole(client, **kw)
    assert content.strip() == "Let me look." and not any(m in content for m in MARKUP)
    for call in calls:
        assert not any(m in call["arguments"] for m in MARKUP)
    assert wait_for(lambda: metric(server, "kv_cache_blocks_used") == 0, 30)


def test_without_tools_the_marker_is_skipped_as_any_special_token(app, client, steer):
    """Only an "auto" tool request keeps the marker's text: a plain chat that writes the same
    tokens skips it, as every special token."""
    name = app.state.server.tool_format.name
    script = steer(TWO_CALLS[name], tools=openai.omit)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120,
                                           temperature=0).choices[0]
    tok = app.state.server.tokenizer
    assert plain.message.content == tok.decode(script) != tok.decode(script, keep=set(script))
    assert MARKER[name] not in plain.message.content
