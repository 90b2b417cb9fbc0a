"""What agent frameworks and eval harnesses ask of the OpenAI endpoints, through the official openai client
against a real server: log-probabilities, reasoning apart from the answer, tool calls. The model's words come from
tests/scripted_worker.py where a test needs the model to say something specific."""

from __future__ import annotations

import json
import math
import re

import pytest

from live_server import API_KEY, Server
from qwen4exp.engine.engine import Engine
from qwen4exp.engine.request import Request
from qwen4exp.engine.sampling import SamplingParams
from qwen4exp.tokenizer import Tokenizer

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    from scripted_worker import scripted_worker_main

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("qwen4exp.server.supervisor.worker_main", scripted_worker_main)
        s = Server(tiny_checkpoint, context=2048)   # room for the tools a system turn lists
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=API_KEY)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return Tokenizer.from_path(tiny_checkpoint)


def engine_logprobs(server, prompt_ids: list[int], max_tokens: int, top: int):
    """The same request in an engine of this process, built from the server's own config."""
    config = server.supervisor.config
    _, model = config.load_model(progress=False)
    engine = Engine.from_config(model, config)
    request = engine.submit(Request(prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=SamplingParams(),
                                    logprobs=top))
    engine.run_until_idle()
    return request


def test_chat_logprobs_are_the_engines_and_rebuild_the_text(server, client, tokenizer):
    messages = [{"role": "user", "content": "Tell me about the mill"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    want = engine_logprobs(server, tokenizer.encode_chat(messages), 8, 3)
    assert [e.logprob for e in content] == [p.logprob for p in want.output_logprobs]
    assert [[t.logprob for t in e.top_logprobs] for e in content] == \
        [[lp for _, lp in p.top] for p in want.output_logprobs]
    assert [bytes(e.bytes) for e in content] == [tokenizer.token_bytes(t) for t in want.output_ids]
    assert all(e.top_logprobs[0].token == e.token for e in content)           # greedy: the most likely
    assert b"".join(bytes(e.bytes) for e in content).decode() == chat.choices[0].message.content
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == chat.choices[0].message.content


def test_completion_logprobs_in_the_legacy_shape(server, client, tokenizer):
    completion = client.completions.create(model="tiny", prompt="The river ran", max_tokens=6, temperature=0,
                                           logprobs=2)
    got = completion.choices[0].logprobs
    want = engine_logprobs(server, tokenizer.encode("The river ran"), 6, 2)
    assert got.token_logprobs == [p.logprob for p in want.output_logprobs]
    assert all(len(top) <= 2 and max(top.values()) >= lp for top, lp in zip(got.top_logprobs, got.token_logprobs))
    text = completion.choices[0].text
    assert "".join(got.tokens) == text and got.text_offset[0] == 0
    assert all(text[offset:].startswith(token) for token, offset in zip(got.tokens, got.text_offset))
    assert all(math.isfinite(lp) and lp <= 0 for lp in got.token_logprobs)


@pytest.mark.parametrize("body, message", [
    ({"logprobs": 21}, "'logprobs' must be an integer in [0, 20]"),
    ({"logprobs": True}, "'logprobs' must be an integer in [0, 20]"),
])
def test_bad_completion_logprobs_are_refused_by_name(client, body, message):
    with pytest.raises(openai.BadRequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body=body)


@pytest.mark.parametrize("body, message", [
    ({"top_logprobs": 2}, "'top_logprobs' needs 'logprobs': true"),
    ({"logprobs": True, "top_logprobs": 30}, r"'top_logprobs' must be an integer in \[0, 20\]"),
    ({"logprobs": 3}, "'logprobs' must be a boolean"),
])
def test_bad_chat_logprobs_are_refused_by_name(client, body, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       extra_body=body)


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
XML_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n" \
           "</parameter>\n</function>\n</tool_call>"


def ask(text: str) -> list[dict]:
    """A user turn that has the scripted model answer `text`."""
    return [{"role": "user", "content": f"«{text}»"}]


def accumulated(stream) -> dict:
    """What a client builds from a streamed chat: the texts joined, each call's pieces added up by index."""
    out = {"content": "", "reasoning_content": "", "reasoning": "", "calls": {}, "finish_reason": None}
    for chunk in stream:
        if not chunk.choices:
            continue
        delta, reason = chunk.choices[0].delta, chunk.choices[0].finish_reason
        for key in ("content", "reasoning_content", "reasoning"):
            out[key] += (getattr(delta, key, None) or "")
        for call in delta.tool_calls or ():
            slot = out["calls"].setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] += call.id or ""
            slot["name"] += call.function.name or ""
            slot["arguments"] += call.function.arguments or ""
        out["finish_reason"] = reason or out["finish_reason"]
    return out


@pytest.mark.parametrize("call", [XML_CALL, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                                            '"days": 3}}\n</tool_call>'])
def test_a_tool_call_comes_back_as_tool_calls_whole_and_streamed(client, call):
    said = f"Let me look that up.\n\n{call}"
    chat = client.chat.completions.create(model="tiny", messages=ask(said), tools=WEATHER, max_tokens=200)
    message, choice = chat.choices[0].message, chat.choices[0]
    assert choice.finish_reason == "tool_calls" and message.content == "Let me look that up."
    [got] = message.tool_calls
    assert got.type == "function" and got.function.name == "get_weather" and got.id.startswith("call_")
    assert json.loads(got.function.arguments) == {"city": "Paris", "days": 3}           # typed by the schema
    streamed = accumulated(client.chat.completions.create(model="tiny", messages=ask(said), tools=WEATHER,
                                                          max_tokens=200, stream=True))
    assert streamed["content"] == message.content and streamed["finish_reason"] == "tool_calls"
    [call_streamed] = streamed["calls"].values()
    assert call_streamed["name"] == "get_weather" and json.loads(call_streamed["arguments"]) == {"city": "Paris",
                                                                                                 "days": 3}


def test_without_tools_or_with_tool_choice_none_the_call_is_text(client):
    for extra in ({}, {"tools": WEATHER, "tool_choice": "none"}):
        chat = client.chat.completions.create(model="tiny", messages=ask(XML_CALL), max_tokens=200, **extra)
        assert chat.choices[0].message.content == XML_CALL and not chat.choices[0].message.tool_calls
        assert chat.choices[0].finish_reason == "stop"


def test_reasoning_comes_apart_from_the_answer(client):
    said = "The user wants a number.\nSix times seven.\n</think>\n\nIt is 42."
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    chat = client.chat.completions.create(model="tiny", messages=ask(said), max_tokens=200, extra_body=thinking)
    message = chat.choices[0].message
    assert message.content == "It is 42."
    assert message.reasoning_content == message.reasoning == "The user wants a number.\nSix times seven."
    streamed = accumulated(client.chat.completions.create(model="tiny", messages=ask(said), max_tokens=200,
                                                          stream=True, extra_body=thinking))
    assert streamed["content"] == message.content and streamed["reasoning_content"] == message.reasoning_content
    plain = client.chat.completions.create(model="tiny", messages=ask("<think>\nhm\n</think>\n\nNo."), max_tokens=50)
    assert plain.choices[0].message.content == "No." and plain.choices[0].message.reasoning_content == "hm"
    off = client.chat.completions.create(model="tiny", messages=ask("Just this."), max_tokens=50,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == "Just this." and off.choices[0].message.reasoning_content is None


def test_reasoning_then_a_call(client):
    said = "I need the forecast.</think>\n\n" + XML_CALL
    chat = client.chat.completions.create(model="tiny", messages=ask(said), tools=WEATHER, max_tokens=200,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = chat.choices[0].message
    assert message.reasoning_content == "I need the forecast." and message.content is None
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_required_or_named_call_is_started_by_the_server(client, tool_choice):
    """The server writes the call's start after the prompt, so the model's words continue a call."""
    head = "<tool_call>\n" if tool_choice == "required" else "<tool_call>\n<function=get_weather>\n"
    rest = XML_CALL[len(head):]
    chat = client.chat.completions.create(model="tiny", messages=ask(rest), tools=WEATHER, tool_choice=tool_choice,
                                          max_tokens=200)
    [got] = chat.choices[0].message.tool_calls
    assert got.function.name == "get_weather" and json.loads(got.function.arguments)["city"] == "Paris"
    streamed = accumulated(client.chat.completions.create(model="tiny", messages=ask(rest), tools=WEATHER,
                                                          tool_choice=tool_choice, max_tokens=200, stream=True))
    assert [c["name"] for c in streamed["calls"].values()] == ["get_weather"]


def test_parallel_calls_and_a_history_with_calls_and_results(client):
    two = XML_CALL + "\n" + XML_CALL.replace("Paris", "Oslo")
    chat = client.chat.completions.create(model="tiny", messages=ask(two), tools=WEATHER, max_tokens=300)
    calls = chat.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Oslo"]
    assert len({c.id for c in calls}) == 2
    one = client.chat.completions.create(model="tiny", messages=ask(two), tools=WEATHER, max_tokens=300,
                                         parallel_tool_calls=False)
    assert [json.loads(c.function.arguments)["city"] for c in one.choices[0].message.tool_calls] == ["Paris"]
    history = [{"role": "user", "content": "Weather in Paris and Oslo?"}, chat.choices[0].message.model_dump(
        exclude_none=True), *[{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in calls],
        {"role": "user", "content": "«Both sunny.»"}]
    after = client.chat.completions.create(model="tiny", messages=history, tools=WEATHER, max_tokens=50)
    assert after.choices[0].message.content == "Both sunny." and after.choices[0].finish_reason == "stop"


def test_the_template_shows_the_model_the_tools_calls_and_results(tokenizer):
    """What the model reads: the tools in the system turn, an earlier call written back in the XML form it is told
    to use, the results as tool responses; a description holding a turn marker stays text."""
    from qwen4exp.server.chat_prompt import chat_prompt

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "x<|im_end|>y"}}]
    body = {"messages": [{"role": "user", "content": "Paris?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function",
                              "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], "tools": tools}
    ids, reading = chat_prompt(body, tokenizer)
    text = tokenizer.decode(ids)
    assert '"description": "x<|im_end|>y"' in text and text.count("<|im_end|>") == 5
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>" in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and reading.tools == tools and not reading.thinking


def test_an_assistant_turns_reasoning_is_rendered_under_either_name_and_null_is_unset(tokenizer):
    from qwen4exp.server.chat_prompt import chat_prompt
    from qwen4exp.server.errors import ApiError

    def ids(**reasoning):
        turn = {"role": "assistant", "content": "a"} | reasoning
        return chat_prompt({"messages": [{"role": "user", "content": "q"}, turn,
                                         {"role": "user", "content": "r"}]}, tokenizer)[0]

    shown = ids(reasoning_content="think hard")
    assert shown != ids() and "think hard" in tokenizer.decode(shown)
    assert ids(reasoning="think hard") == ids(reasoning="think hard", reasoning_content=None) == shown
    assert ids(reasoning_content="think hard", reasoning=None) == ids(reasoning="think hard",
                                                                      reasoning_content="think hard") == shown
    for bad, message in [({"reasoning": 7, "reasoning_content": "x"}, "messages[1].reasoning' must be a string"),
                         ({"reasoning": "x", "reasoning_content": "y"}, "both reasoning_content and reasoning")]:
        with pytest.raises(ApiError, match=re.escape(message)):
            ids(**bad)


@pytest.mark.parametrize("body, param, message", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "tools[0].function.name must be"),
    ({"tools": WEATHER, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "must name one of the tools (get_weather)"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "cannot set messages"),
    ({"reasoning_effort": "max"}, "reasoning_effort", "must be one of none, minimal, low, medium, high"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages",
     "messages[0].tool_calls[0].function.arguments is not valid JSON"),
])
def test_bad_tool_and_template_fields_get_400s_naming_them(server, body, param, message):
    status, answer, _ = server.request("POST", "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2} | body)
    assert status == 400 and answer["error"]["param"] == param and message in answer["error"]["message"], answer


def test_a_chat_the_template_refuses_is_a_400_naming_the_template(tokenizer, monkeypatch):
    """A real model's template can raise on what a client sent (Qwen's raise on a chat without a user turn, or on
    chat_template_kwargs it cannot render): the client gets a 400 saying so, not a 500."""
    from jinja2.exceptions import TemplateError

    from qwen4exp.server.chat_prompt import chat_prompt
    from qwen4exp.server.errors import ApiError

    def refusing(*args, **kwargs):
        raise TemplateError("No user query found in messages.")

    monkeypatch.setattr(tokenizer, "encode_chat", refusing)
    with pytest.raises(ApiError, match="chat template refused this chat: No user query found") as caught:
        chat_prompt({"messages": [{"role": "system", "content": "x"}]}, tokenizer)
    assert caught.value.status == 400
