"""``tool_choice: "auto"`` / ``"none"`` and ``parallel_tool_calls`` (issue 29), through the
official ``openai`` client, streaming and not; and the forced calls (``"required"``, a named
function) streamed as they are written, as "auto"'s are.

The bundled model does not call tools of its own accord, so the tests that need a call steer it:
a wrapper around the runner's forward adds +1000 to the logits of a scripted token at each
position after the prompt (the model "decides" to write the script). The grammar still applies
on top: what is checked is the server's part — the structural tag that keeps a started call
valid for an offered tool, the parsing into ``tool_calls``, the stream that never shows the
markup, and the finish reasons. Unsteered, the model answers in text and nothing changes.

How the tools reach the prompt is checked by the prompt's token count against a render of the
expected conversation: the server's default tool prompt for the bundled model (its template has
no tools section), the ``tools`` variable for a template with one, whether it is the model's own
or ``--chat-template``'s.
"""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest

from infer_lab.model.loader import BUNDLED_MODEL_DIR
from infer_lab.serve.limits import ServerLimits
from infer_lab.serve.protocol import ChatCompletionRequest
from infer_lab.serve.server import make_app
from infer_lab.serve.tools import ToolStream, auto_plan, tool_plan
from tests.live_server import metric, running, wait_for
from tests.tool_helpers import accumulate, steered, streamed_like_whole, strict

MODEL = "tiny-kjv"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# A tool whose arguments nest an object in an object and hold a string with escaped quotes,
# braces, a colon and a comma: what a forced call's stream must not take for the JSON's own.
NOTE = {"type": "function", "function": {"name": "take_note", "parameters": {
    "type": "object", "properties": {
        "text": {"type": "string"},
        "where": {"type": "object", "properties": {"city": {"type": "string",
                                                            "enum": ["Paris", "Rome"]}},
                  "required": ["city"], "additionalProperties": False}},
    "required": ["text", "where"], "additionalProperties": False}}}
NOTE_ARGS = '{"text": "say \\"hi}\\" {not: json}, ok", "where": {"city": "Rome"}}'
FORCED = {"required": ("required", '{"name": "take_note", "arguments": ' + NOTE_ARGS + "}"),
          "named": ({"type": "function", "function": {"name": "take_note"}}, NOTE_ARGS)}
# The bundled model's format with a tools section, "### " before each message (so that it is
# told apart from the bundled template) and, for the message "spin", a render that never ends.
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>\nTools:{% for t in tools %} {{ t.function.name }}"
    "{{ t.function.parameters | tojson }}{% endfor %}<|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n### {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}: {{ c.function.arguments.city }}"
    "</call>{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    "{% if messages[0].content == 'spin' %}{% for i in range(100000) %}"
    "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}")


@pytest.fixture(scope="module")
def app():
    return make_app(None, device="cpu", num_kv_blocks=256, max_num_seqs=8)


@pytest.fixture(scope="module")
def server(app):
    with running(app) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)


@pytest.fixture()
def steer(app, client):
    """``steer(text, tools, pause=0, **kw)``: the model writes ``text`` after the prompt of ASK
    with those tools and ``kw`` (a ``tool_choice``: its prompt differs), as tokens of the
    tokenizer (the grammar may still refuse them). ``pause`` seconds per step give a stream's
    reader time to send each token as its own chunk (a reader that lags gets the tokens it
    missed merged into one chunk)."""
    engine = app.state.server.engine.engine
    real = engine.runner.forward

    def install(text: str, tools: list[dict], pause: float = 0.0, **kw) -> None:
        first = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools,
                                               max_tokens=1, **kw)  # kw: the prompt's tool_choice
        start = first.usage.prompt_tokens
        script = engine.tokenizer.encode(text) + sorted(engine.eos_ids)[:1]
        engine.runner.forward = steered(real, start, script, pause)

    yield install
    engine.runner.forward = real


def no_blocks_held(server: str) -> bool:
    return wait_for(lambda: metric(server, "kv_cache_blocks_used") == 0, 30)


def stream(client, **kw) -> tuple[str, list, str | None]:
    """The streamed content, tool calls (put together by index) and last finish reason."""
    return accumulate(client.chat.completions.create(model=MODEL, messages=ASK, stream=True,
                                                     **kw))


def test_auto_without_a_call_answers_in_text(client, server):
    for tools in ([WEATHER], [WEATHER, TIME]):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools,
                                           max_tokens=12, temperature=0)
        c = r.choices[0]
        assert not c.message.tool_calls and c.finish_reason in ("stop", "length")
        assert "<tool_call>" not in (c.message.content or "")
        content, calls, reason = stream(client, tools=tools, max_tokens=12, temperature=0)
        assert content == c.message.content and not calls and reason == c.finish_reason
    assert no_blocks_held(server)


def test_auto_parses_a_call_and_hides_its_markup(client, server, steer):
    steer("Let me look. " + CALL, [WEATHER, TIME])
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                       max_tokens=100, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content == "Let me look."
    [call] = c.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    content, calls, reason = stream(client, tools=[WEATHER, TIME], max_tokens=100,
                                    temperature=0)
    assert reason == "tool_calls" and "<" not in content and content.strip() == "Let me look."
    assert [d["name"] for d in calls] == ["get_weather"]
    assert calls[0]["arguments"] == call.function.arguments  # the pieces add up to it
    assert no_blocks_held(server)


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls(client, steer, parallel):
    second = CALL.replace("Paris", "Rome")
    steer(CALL + second, [WEATHER])
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                       max_tokens=160, temperature=0,
                                       parallel_tool_calls=parallel)
    c = r.choices[0]
    cities = [json.loads(t.function.arguments)["city"] for t in c.message.tool_calls]
    assert cities == (["Paris", "Rome"] if parallel else ["Paris"])
    assert c.finish_reason == "tool_calls"


def test_a_call_of_a_tool_not_offered_cannot_be_written(client, server, steer):
    steer(CALL.replace("get_weather", "get_wether"), [WEATHER])
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                       max_tokens=100, temperature=0)
    c = r.choices[0]
    assert c.finish_reason in ("tool_calls", "length", "stop")
    for call in c.message.tool_calls or []:  # the grammar allowed only offered names
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert "<tool_call>" not in (c.message.content or "")
    assert no_blocks_held(server)


def test_a_call_cut_by_max_tokens_is_not_text(client, steer):
    steer(CALL, [WEATHER])
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                       max_tokens=8, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls
    assert "<tool" not in (c.message.content or "")
    content, calls, reason = stream(client, tools=[WEATHER], max_tokens=8, temperature=0)
    assert reason == "length" and not calls and "<tool" not in content


def test_a_call_cut_mid_arguments_has_streamed_the_part_it_wrote(app, client, server, steer):
    """The stream and the whole answer differ here: the stream has already sent the call's name
    and a part of its arguments (all but what the last chunk wrote: at the end the cut call is
    dropped, not sent on); the whole answer, parsed at the end, has no call."""
    steer(CALL, [WEATHER], pause=0.02)
    kw = {"tools": [WEATHER], "temperature": 0}
    uncut = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=100, **kw)
    [call] = uncut.choices[0].message.tool_calls
    # the steered output is CALL's tokens: cut where the city's value has begun, not ended
    tokenizer = app.state.server.engine.engine.tokenizer
    script = tokenizer.encode(CALL)
    cut = next(k for k in range(len(script)) if '"city": "Par' in tokenizer.decode(script[:k]))
    assert '"Paris"' not in tokenizer.decode(script[:cut])
    content, calls, reason = stream(client, max_tokens=cut, **kw)
    assert reason == "length" and "<tool" not in content
    [part] = calls
    assert part["name"] == "get_weather"
    assert call.function.arguments.startswith(part["arguments"])
    assert part["arguments"] != call.function.arguments
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=cut, **kw)
    c = whole.choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls
    assert "<tool" not in (c.message.content or "")
    assert no_blocks_held(server)


FUNCTIONS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, NOTE)}
# The forced outputs as the grammar writes them, and with free whitespace (what a grammar with
# any_whitespace would allow): the arguments are found either way.
SPACED = {"required": ' {\n "name" : "take_note" ,\n "arguments":\t' + NOTE_ARGS + " \n}\n",
          "named": "\n " + NOTE_ARGS + " "}


@pytest.mark.parametrize("how", list(FORCED))
@pytest.mark.parametrize("stop_reason", [None, '"', 13])
def test_a_forced_call_ended_by_a_stop_string_or_token_is_dropped(how, stop_reason):
    """A forced call is one only when the grammar ended it (``stop`` with nothing behind it):
    the same complete JSON ended by a stop string or a stop token id is dropped, with an empty
    content and the finish reason ``stop``, as a call cut by ``max_tokens`` is."""
    from infer_lab.engine.outputs import CompletionOutput
    from infer_lab.serve.responses import Shape

    choice, text = FORCED[how]
    plan = tool_plan(ChatCompletionRequest(messages=ASK, tools=[WEATHER, NOTE],
                                           tool_choice=choice))
    shape = Shape("chatcmpl-x", True, "m", None, tools=plan)
    message, finish = shape.tool_message(CompletionOutput(0, text, [], "stop", stop_reason))
    if stop_reason is None:
        assert finish == "tool_calls" and message["tool_calls"][0]["function"] == {
            "name": "take_note", "arguments": NOTE_ARGS}
    else:
        assert finish == "stop" and message == {"role": "assistant", "content": ""}


@pytest.mark.parametrize("how", list(FORCED))
@pytest.mark.parametrize("spaced", [False, True])
def test_a_forced_calls_arguments_are_found_in_the_growing_json(how, spaced):
    """The output arriving 1 to 4 characters at a time: the call's first delta (``index``,
    ``id``, ``type``, name) comes in the first chunk for a named function and in the chunk
    that completes the name's string for "required", the rest carry only argument
    text, and the pieces add up to exactly the whole answer's arguments at every split of the
    escaped quotes and braces; nothing is content. Cut anywhere, the output sends no complete
    call and what it sent is a prefix of the arguments."""
    choice, text = FORCED[how]
    text = SPACED[how] if spaced else text
    plan = tool_plan(ChatCompletionRequest(messages=ASK, tools=[WEATHER, NOTE],
                                           tool_choice=choice))
    whole = plan.call(text, "c")
    assert whole["function"] == {"name": "take_note", "arguments": NOTE_ARGS}
    name_end = text.find('"take_note"') + len('"take_note"')
    for step in (1, 2, 3, 4):
        state, content, pieces = ToolStream(), "", []
        for at in range(0, len(text), step):
            piece, deltas = state.delta(plan, text[at:at + step], at + step >= len(text), "c")
            content += piece
            for d in deltas:
                if not pieces:
                    assert at + step < len(text)  # before the JSON is complete
                    # a named function's in the first chunk; "required"'s in the chunk that
                    # completes the name's string, not later
                    assert at == 0 if how == "named" else at < name_end <= at + step
                    assert d == {"index": 0, "id": "c_0", "type": "function", "function": {
                        "name": "take_note", "arguments": d["function"]["arguments"]}}
                else:
                    assert d.keys() == {"index", "function"} and d["function"].keys() == {
                        "arguments"} and d["index"] == 0
                pieces.append(d["function"]["arguments"])
        assert content == "" and "".join(pieces) == NOTE_ARGS
        assert len([p for p in pieces if p]) > 1
    for end in range(len(text.rstrip()) - 1):  # cut before the last brace: never a call
        state = ToolStream()
        _, deltas = state.delta(plan, text[:end], True, "c")
        assert deltas == [] and state.calls == [] and plan.call(text[:end], "c") is None
        state = ToolStream()
        state.delta(plan, text[:end], False, "c")
        assert all(NOTE_ARGS.startswith(sent) for sent in state.sent)


@pytest.mark.parametrize("how", list(FORCED))
def test_a_forced_call_streams_as_it_is_written(client, server, steer, how):
    """``tool_choice`` "required" or a named function, greedy, whole and through the ``openai``
    client's stream helper: the stream sends the call's ``index``, ``id``, ``type`` and name
    first, then its arguments in several pieces that add up to exactly the whole answer's
    (escaped quotes, braces and nesting in them included), and none of its JSON as content."""
    choice, script = FORCED[how]
    tools = [strict(WEATHER), strict(NOTE)]
    steer(script, tools, pause=0.02, tool_choice=choice)
    kw = {"model": MODEL, "messages": ASK, "tools": tools, "tool_choice": choice,
          "max_tokens": 100, "temperature": 0}
    whole, [call], content = streamed_like_whole(client, **kw)
    assert whole.message.content is None
    assert call["name"] == "take_note" and call["arguments"] == NOTE_ARGS
    assert json.loads(call["arguments"])["where"] == {"city": "Rome"}
    assert "{" not in content and "take_note" not in content
    # the name comes before the arguments are complete: a named function's in the stream's
    # first chunk, "required"'s as soon as the name in its JSON is
    assert len(call["first"]["function"]["arguments"] or "") < len(NOTE_ARGS)
    first = list(client.chat.completions.create(stream=True, **kw))[0].choices[0].delta
    assert first.role == "assistant"
    if how == "named":
        assert first.tool_calls[0].function.name == "take_note"
    assert no_blocks_held(server)


@pytest.mark.parametrize("how", list(FORCED))
def test_a_forced_call_cut_by_max_tokens_behaves_as_autos(app, client, server, steer, how):
    """Cut in its arguments by ``max_tokens``: the stream has sent the name and the part of the
    arguments written before its last chunk (a prefix of the uncut call's), and says
    ``length``; the whole answer has no call and no JSON as content."""
    choice, script = FORCED[how]
    steer(script, [WEATHER, NOTE], pause=0.02, tool_choice=choice)
    kw = {"tools": [WEATHER, NOTE], "tool_choice": choice, "temperature": 0}
    tokenizer = app.state.server.engine.engine.tokenizer
    ids = tokenizer.encode(script)
    cut = next(k for k in range(len(ids)) if "{not" in tokenizer.decode(ids[:k]))
    content, calls, reason = stream(client, max_tokens=cut, **kw)
    assert reason == "length" and "{" not in content
    [part] = calls
    assert part["name"] == "take_note" and part["arguments"]
    assert NOTE_ARGS.startswith(part["arguments"]) and part["arguments"] != NOTE_ARGS
    c = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=cut, **kw)
    c = c.choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls
    assert not c.message.content
    assert no_blocks_held(server)


def test_none_does_not_offer_the_tools(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                       tool_choice="none", max_tokens=8, temperature=0)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                           temperature=0)
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert not r.choices[0].message.tool_calls


@pytest.mark.parametrize(("extra", "field"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "parallel_tool_calls": "maybe"}, "parallel_tool_calls"),
])
def test_bad_tool_requests_are_400(server, extra, field):
    r = httpx.post(f"{server}/v1/chat/completions",
                   json={"messages": ASK, "max_tokens": 4, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert no_blocks_held(server)


def prompt_tokens(client, messages=ASK, **kw) -> int:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                       temperature=0, **kw)
    return r.usage.prompt_tokens


def rendered(tok, messages, template=None, tools=None) -> int:
    """Tokens of the conversation as the template renders it."""
    return len(tok.apply_chat_template(messages, tokenize=True, chat_template=template,
                                       tools=tools))


PAST_CALL = {"role": "assistant", "content": None, "tool_calls": [{
    "id": "call_1", "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}


def test_without_a_tools_section_the_default_tool_prompt_describes_them(app, client):
    server = app.state.server
    assert not server.renderer.reads_tools  # the bundled model's template
    tok = server.tokenizer
    plan = auto_plan({"get_weather": WEATHER["function"]["parameters"]}, True)
    prompted = plan.with_system(ASK)
    assert "get_weather" in prompted[0]["content"] and "<tool_call>" in prompted[0]["content"]
    assert prompt_tokens(client, tools=[WEATHER]) == rendered(tok, prompted)
    assert prompt_tokens(client, tools=[WEATHER], tool_choice="none") == rendered(tok, ASK)
    # an earlier call is written into the assistant's text in the format the prompt teaches
    thanks = {"role": "user", "content": "Thanks."}
    seen = [*ASK, {"role": "assistant", "content": CALL}, thanks]
    assert prompt_tokens(client, [*ASK, PAST_CALL, thanks], tools=[WEATHER]) == rendered(
        tok, plan.with_system(seen))


@pytest.mark.parametrize(("call", "field"), [
    ({"type": "function", "function": {"name": "get_weather", "arguments": "{nope"}},
     "messages[1].tool_calls[0].function.arguments"),
    ({"type": "function", "function": {"arguments": "{}"}}, "messages[1].tool_calls[0]"),
    ({"type": "function", "function": {"name": "f", "arguments": '{"a": "\\ud800"}'}},
     "messages[1].tool_calls[0]"),
])
def test_bad_earlier_tool_calls_are_400(server, call, field):
    messages = [*ASK, {"role": "assistant", "tool_calls": [call]}]
    r = httpx.post(f"{server}/v1/chat/completions", timeout=60,
                   json={"messages": messages, "tools": [WEATHER], "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    """The bundled model with TOOLS_TEMPLATE as its own chat template."""
    path = tmp_path_factory.mktemp("tools-model") / MODEL
    shutil.copytree(BUNDLED_MODEL_DIR, path)
    config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = TOOLS_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


@pytest.mark.parametrize("where", ["the model's", "--chat-template"])
def test_a_template_with_a_tools_section_gets_the_tools(tools_model, where):
    limits = ServerLimits(template_timeout=2.0)
    app = (make_app(tools_model, device="cpu", num_kv_blocks=64, limits=limits)
           if where == "the model's" else
           make_app(None, device="cpu", num_kv_blocks=64, limits=limits,
                    chat_template=TOOLS_TEMPLATE))
    server = app.state.server
    tok = server.tokenizer
    assert server.renderer.reads_tools
    with running(app) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        plain = rendered(tok, ASK, TOOLS_TEMPLATE)
        if where == "--chat-template":
            assert plain != rendered(tok, ASK)  # the model's own template would differ
        assert prompt_tokens(client) == plain  # the template of every request
        for tools in ([WEATHER], [WEATHER, TIME]):
            want = rendered(tok, ASK, TOOLS_TEMPLATE, tools)
            assert want > plain  # the tools section was rendered, not the default prompt
            for choice in ("auto", "required"):
                assert prompt_tokens(client, tools=tools, tool_choice=choice) == want
        assert prompt_tokens(client, tools=[WEATHER], tool_choice="none") == plain
        # the template still renders in a child process, under the deadline
        r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "spin"}], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "chat_template_limit"
        assert prompt_tokens(client, tools=[WEATHER]) == rendered(  # and the next is served
            tok, ASK, TOOLS_TEMPLATE, [WEATHER])
        # an earlier call reaches the template as a field, its arguments parsed
        sent = [*ASK, PAST_CALL, {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
        seen = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Paris"}}}]}, sent[-1]]
        want = rendered(tok, seen, TOOLS_TEMPLATE, [WEATHER])
        assert want > rendered(tok, [*ASK, {"role": "assistant", "content": ""}, sent[-1]],
                               TOOLS_TEMPLATE, [WEATHER]) + 3  # the call and its city
        assert prompt_tokens(client, sent, tools=[WEATHER]) == want
        assert no_blocks_held(base)


def test_a_chat_template_that_does_not_parse_is_refused_before_loading():
    with pytest.raises(ValueError, match="does not parse"):
        make_app("/nonexistent/model", chat_template="{% if %}")
