"""``--tool-call-parser`` (issue 29): "auto" tool calls in the formats the major chat templates
teach — Hermes/Qwen's ``<tool_call>``, Llama 3.1/3.2's JSON (optionally after
``<|python_tag|>``), Mistral's ``[TOOL_CALLS] [...]`` — each constrained by its own structural
tag and parsed into ``tool_calls``, streaming and not, through the official ``openai`` client.

As in ``tests/test_server_tools.py``, the bundled model is steered into writing a call (+1000 on
the logits of a scripted token at each position after the prompt); the grammar still applies on
top, so a scripted call of a tool that was not offered cannot come out.
"""

from __future__ import annotations

import json

import openai
import pytest

from infer_lab.cli import main
from infer_lab.engine.structured import StructuredOutputs
from infer_lab.model.loader import load
from infer_lab.serve.server import make_app
from infer_lab.serve.tool_formats import FORMATS, call_format
from infer_lab.serve.tools import ToolStream, auto_plan
from tests.live_server import metric, running, wait_for
from tests.tool_helpers import accumulate, steered, streamed_like_whole, strict

MODEL = "tiny-kjv"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}}}
FUNCTIONS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
# Two calls, as each format writes them, after some text.
TWO_CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              '</tool_call><tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n'
              "</tool_call>",
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                   '{"name": "get_time", "parameters": {"zone": 2}}',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
               '{"name": "get_time", "arguments": {"zone": 2}}]',
}
MARKUP = ("<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", '{"name"', "<|", "[TOOL")
WANT = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": 2})]


def parsed(calls) -> list[tuple[str, dict]]:
    return [(c["name"], json.loads(c["arguments"])) for c in calls]


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_splits_text_and_calls_and_a_stream_never_shows_markup(name):
    """Every prefix of the output, as a stream would see it: the content shown only grows, never
    holds markup, and ends as the whole output's; the calls come out whole and in order."""
    plan = auto_plan(FUNCTIONS, True, FORMATS[name])
    text = "Let me look. " + TWO_CALLS[name]
    content, calls, _ = plan.split(text, True)
    assert content.strip() == "Let me look." and parsed(calls) == WANT
    shown, seen = "", 0
    for end in range(1, len(text) + 1):
        part, calls, _ = plan.split(text[:end], end == len(text))
        assert part.startswith(shown) and not any(m in part for m in MARKUP), (end, part)
        assert parsed(calls) == WANT[:len(calls)] and len(calls) >= seen
        shown, seen = part, len(calls)
    assert shown == content and seen == 2
    cut = plan.split(text[:-3], True)  # a call cut off at the end: dropped, not text
    assert not any(m in cut[0] for m in MARKUP) and len(cut[1]) < 2


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("step", [1, 3])
def test_a_stream_sends_each_call_as_it_is_written(name, step):
    """The text arriving ``step`` characters at a time: each call's name comes once, then its
    arguments in fragments that add up to exactly the whole answer's; content never holds
    markup; every call's first fragment comes before the output is complete."""
    plan = auto_plan(FUNCTIONS, True, FORMATS[name])
    text = "Let me look. " + TWO_CALLS[name]
    whole_content, whole_calls, _ = plan.split(text, True)
    state, content, calls = ToolStream(), "", {}
    for at in range(0, len(text), step):
        piece, deltas = state.delta(plan, text[at:at + step], at + step >= len(text), "c")
        content += piece
        for d in deltas:
            if "id" in d:
                assert d["index"] == len(calls) and d["type"] == "function"
                calls[d["index"]] = {"name": d["function"]["name"], "pieces": []}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]]["pieces"].append(d["function"]["arguments"])
        assert not any(m in content for m in MARKUP)
    assert content == whole_content
    assert [(c["name"], "".join(c["pieces"])) for c in calls.values()] == [
        (c["name"], c["arguments"]) for c in whole_calls]
    assert all(len([p for p in c["pieces"] if p]) > 1 for c in calls.values())


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_formats_grammar_takes_a_valid_call_and_refuses_an_unoffered_tool(grammar, name):
    text = "Let me look. " + TWO_CALLS[name]
    first_end = text.index("Paris") + len("Paris")  # the first call is written by then
    for parallel in (True, False):
        plan = auto_plan(FUNCTIONS, parallel, FORMATS[name])
        accepted = accepts(grammar, plan, text)
        if parallel:
            assert accepted == len(text)
        else:  # one call only: the second cannot start
            assert first_end < accepted < len(text)
        wrong = text.replace("get_weather", "get_wether")
        assert accepts(grammar, plan, wrong) < wrong.index("wether") + len("wether")


def accepts(grammar, plan, text: str) -> int:
    """How many characters of ``text`` the plan's grammar accepts, token by token."""
    so, tok = grammar
    matcher, done = so.matcher(plan.constraint), 0
    for token in tok.encode(text):
        if not matcher.accept_token(token):
            break
        done += len(tok.decode([token], skip_special_tokens=False))
    return done


@pytest.fixture(scope="module", params=["hermes", "llama3_json", "mistral"])
def app(request):
    return make_app(None, device="cpu", num_kv_blocks=256, max_num_seqs=8,
                    tool_call_parser=request.param)


@pytest.fixture(scope="module")
def grammar():
    """The engine's grammar side over the bundled model's tokenizer."""
    model, tok = load(None, device="cpu")
    return StructuredOutputs(tok, model.config.vocab_size, set(tok.eos_token_ids)), tok


@pytest.fixture(scope="module")
def server(app):
    with running(app) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)


@pytest.fixture()
def steer(app, client):
    """``steer(text, tools)``: the model writes ``text`` after the prompt of ASK with those
    tools (the grammar may still refuse it)."""
    engine = app.state.server.engine.engine
    real = engine.runner.forward

    def install(text: str, tools: list[dict]) -> None:
        start = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools,
                                               max_tokens=1).usage.prompt_tokens
        script = engine.tokenizer.encode(text) + sorted(engine.eos_ids)[:1]
        engine.runner.forward = steered(real, start, script)

    yield install
    engine.runner.forward = real


def stream(client, **kw) -> tuple[str, list, str | None]:
    """The streamed content, calls (put together by index) and last finish reason."""
    return accumulate(client.chat.completions.create(model=MODEL, messages=ASK, stream=True,
                                                     **kw))


def fmt_of(app) -> str:
    return app.state.server.tool_format.name


@pytest.mark.parametrize("parallel", [True, False])
def test_calls_in_the_servers_format_become_tool_calls(app, client, server, steer, parallel):
    name = fmt_of(app)
    steer("Let me look. " + TWO_CALLS[name], [WEATHER, TIME])
    kw = {"tools": [WEATHER, TIME], "max_tokens": 120, "temperature": 0,
          "parallel_tool_calls": parallel}
    want = WANT if parallel else WANT[:1]
    c = client.chat.completions.create(model=MODEL, messages=ASK, **kw).choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content == "Let me look."
    assert [(t.function.name, json.loads(t.function.arguments))
            for t in c.message.tool_calls] == want
    assert len({t.id for t in c.message.tool_calls}) == len(want)
    content, calls, reason = stream(client, **kw)
    assert reason == "tool_calls" and content.strip() == "Let me look."
    assert not any(m in content for m in MARKUP)
    assert [(d["name"], json.loads(d["arguments"])) for d in calls] == want
    assert len({d["id"] for d in calls}) == len(want) and all(d["id"] for d in calls)
    assert wait_for(lambda: metric(server, "kv_cache_blocks_used") == 0, 30)


def test_streamed_arguments_add_up_to_the_whole_answers(app, client, steer):
    """Greedy, the same request whole and through the ``openai`` client's stream helper: the
    calls stream as they are written and add up to the whole answer's."""
    name = fmt_of(app)
    steer("Let me look. " + TWO_CALLS[name], [WEATHER, TIME])
    whole, calls, content = streamed_like_whole(
        client, model=MODEL, messages=ASK, tools=[strict(WEATHER), strict(TIME)],
        max_tokens=120, temperature=0)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == WANT
    assert content.strip() == whole.message.content == "Let me look."


def test_a_call_of_a_tool_not_offered_cannot_be_written(app, client, server, steer):
    steer(TWO_CALLS[fmt_of(app)].replace("get_weather", "get_wether"), [WEATHER, TIME])
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                       max_tokens=100, temperature=0)
    c = r.choices[0]
    for call in c.message.tool_calls or []:
        assert call.function.name in ("get_weather", "get_time")
    assert not any(m in (c.message.content or "") for m in MARKUP)
    assert wait_for(lambda: metric(server, "kv_cache_blocks_used") == 0, 30)


def test_the_default_tool_prompt_teaches_the_servers_format(app, client):
    """The bundled template has no tools section: the server's default prompt describes the
    tools and spells out this format, and an earlier call is written back in it."""
    server = app.state.server
    fmt = server.tool_format
    plan = auto_plan({"get_weather": WEATHER["function"]["parameters"]}, True, fmt)
    prompted = plan.with_system(ASK)
    assert fmt.trigger.strip() in prompted[0]["content"]
    tok = server.tokenizer
    count = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                           max_tokens=1).usage.prompt_tokens
    assert count == len(tok.apply_chat_template(prompted, tokenize=True))
    past = {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    thanks = {"role": "user", "content": "Thanks."}
    written = fmt.write([("get_weather", {"city": "Paris"})])
    assert plan.split(written, True)[1] == [{"name": "get_weather",
                                              "arguments": '{"city": "Paris"}'}]
    seen = plan.with_system([*ASK, {"role": "assistant", "content": written}, thanks])
    count = client.chat.completions.create(model=MODEL, messages=[*ASK, past, thanks],
                                           tools=[WEATHER], max_tokens=1).usage.prompt_tokens
    assert count == len(tok.apply_chat_template(seen, tokenize=True))


def test_an_unknown_parser_is_a_startup_error(capsys):
    """Refused before the model loads (the model that does not exist is never looked at)."""
    with pytest.raises(ValueError, match="--tool-call-parser 'pythonic': not one of hermes"):
        make_app("/nonexistent/model", tool_call_parser="pythonic")
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", "/nonexistent/model", "--tool-call-parser", "pythonic"])
    assert exit_.value.code == 2
    assert "--tool-call-parser: invalid choice: 'pythonic'" in capsys.readouterr().err
    assert call_format("mistral") is FORMATS["mistral"]
