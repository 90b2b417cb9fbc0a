"""Tool calls as a client sees them: the calls and content parsed from a Qwen model's text, whole and streamed, and
the errors a bad `tools` / `tool_choice` gets."""

from __future__ import annotations

import json
import random
import re

import pytest

from qwen4exp.server.chat_answer import ChatAnswer
from qwen4exp.server.chat_prompt import ChatReading
from qwen4exp.server.tool_calls import (ToolCallStream, check_tool_choice, check_tools, forced_call_prefix,
                                        parse_tool_calls, tool_call_format)

PROPERTIES = {"city": {"type": "string"}, "zip": {"type": "string"}, "days": {"type": "integer"},
              "scale": {"type": "number"}, "metric": {"type": "boolean"}, "opts": {"type": "object"},
              "tags": {"type": "array"}, "limit": {"type": ["integer", "null"]}}
TOOLS = check_tools([
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                      "parameters": {"type": "object", "properties": PROPERTIES}}},
    {"type": "function", "function": {"name": "run_code", "parameters": {"properties": {"code": {"type": "string"}}}}},
])


def xml(name: str, wrapped: bool = True, **params: str) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params.items())
    function = f"<function={name}>\n{body}</function>"
    return f"<tool_call>\n{function}\n</tool_call>" if wrapped else function


def hermes(name: str, arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def calls_of(text: str) -> list[tuple[str, dict]]:
    _, calls = parse_tool_calls(text, TOOLS)
    return [(call.name, json.loads(call.arguments)) for call in calls]


def test_xml_parameters_take_the_types_of_the_tool_schema():
    text = xml("get_weather", city="Paris", zip="75001", days="3", scale="1.5", metric="TRUE",
               opts='{"unit": "C", "hourly": [1, 2]}', tags='["rain", "wind"]', limit="null")
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "" and len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris", "zip": "75001", "days": 3, "scale": 1.5,
                                              "metric": True, "opts": {"unit": "C", "hourly": [1, 2]},
                                              "tags": ["rain", "wind"], "limit": None}


@pytest.mark.parametrize("key, text, value", [
    ("days", "three", "three"), ("days", "2.5", "2.5"), ("scale", "7", 7), ("scale", "NaN", "NaN"),
    ("scale", "1e999", "1e999"), ("metric", "yes", "yes"), ("opts", "{broken", "{broken"), ("opts", "[1]", "[1]"),
    ("tags", '{"a": 1}', '{"a": 1}'), ("limit", "12", 12), ("limit", "many", "many"), ("unknown", "42", "42"),
    ("city", "  spaced  ", "  spaced  "),
])
def test_a_value_that_does_not_fit_its_type_stays_text(key, text, value):
    assert calls_of(xml("get_weather", **{key: text})) == [("get_weather", {key: value})]


def test_values_are_typed_only_by_their_own_function_schema():
    assert calls_of(xml("not_declared", days="3")) == [("not_declared", {"days": "3"})]
    _, calls = parse_tool_calls(xml("get_weather", days="3"), None)
    assert json.loads(calls[0].arguments) == {"days": "3"}


def test_multi_line_values_keep_everything_but_one_newline_at_each_end():
    code = "\nif a < b:\n    print('</function></tool_call><tool_call>')\n\n"
    assert calls_of(xml("run_code", code=code)) == [("run_code", {"code": code})]


def test_content_before_two_calls_and_whitespace_around_them_is_dropped():
    text = f"Let me check both.\n\n{xml('get_weather', city='Paris')}\n{xml('get_weather', city='Rome')}\n"
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Let me check both."
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]


def test_content_after_a_call_is_kept_without_the_space_touching_the_call():
    content, _ = parse_tool_calls(f"  Hi.  {hermes('run_code', {})}\n\n Done. ", TOOLS)
    assert content == "  Hi.Done. "


@pytest.mark.parametrize("text, expected", [
    (hermes("get_weather", {"city": "Paris", "days": 3}), {"city": "Paris", "days": 3}),
    (hermes("get_weather", '{"city": "Paris"}'), {"city": "Paris"}),
    ('<tool_call>\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n</tool_call>', {"city": "Paris"}),
    ('<tool_call>{"name": "get_weather"}</tool_call>', {}),
    (xml("get_weather", wrapped=False, city="Paris"), {"city": "Paris"}),
])
def test_json_form_and_bare_xml_function_are_calls(text, expected):
    assert parse_tool_calls(text, TOOLS)[0] == ""
    assert calls_of(text) == [("get_weather", expected)]


def test_both_forms_in_one_answer_are_indexed_in_order():
    text = xml("run_code", code="1") + hermes("get_weather", {"city": "Oslo"})
    assert calls_of(text) == [("run_code", {"code": "1"}), ("get_weather", {"city": "Oslo"})]


UNPARSED = [
    "Sure.\n" + xml("get_weather", city="Paris")[:-len("</tool_call>")],          # generation stopped
    "Sure.\n" + hermes("get_weather", {"city": "Paris"})[:-3],
    "<tool_call>\n<function=run_code>\n<parameter=code>\nprint(1)\n</function>\n</tool_call>",
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {city: Paris}}\n</tool_call>",           # bad JSON
    "<tool_call>\n{\"arguments\": {}}\n</tool_call>",                                                # no name
    "<tool_call>\n[1, 2]\n</tool_call>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": \"not json\"}\n</tool_call>",
    "<function=>\n</function>", "<function=get weather\n>",
    "Use <tool_call> tags and <function=NAME> blocks.", "a < b, a <tool, x<function",
]


@pytest.mark.parametrize("text", UNPARSED)
def test_text_that_is_not_a_complete_call_stays_content(text):
    assert parse_tool_calls(text, TOOLS) == (text, [])


def test_a_broken_call_does_not_hide_the_next_one():
    text = '<tool_call>\n{"name": "get_weather", bad}\n</tool_call>\n' + xml("run_code", code="x")
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == '<tool_call>\n{"name": "get_weather", bad}\n</tool_call>'
    assert [c.name for c in calls] == ["run_code"]


def test_ids_are_unique_and_openai_shaped():
    _, calls = parse_tool_calls(xml("run_code", code="1") * 3, TOOLS)
    assert len({c.id for c in calls}) == 3 and all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)
    assert calls[0].to_openai() == {"id": calls[0].id, "type": "function",
                                    "function": {"name": "run_code", "arguments": '{"code": "1"}'}}


# ---- streaming -----------------------------------------------------------------------------------------------
STREAMED = UNPARSED + [
    "plain answer, no tools\n",
    "Checking…\n\n" + xml("get_weather", city="Zürich", days="2") + "\n" + hermes("run_code", {"code": "a<b"}),
    xml("run_code", code="x = '<tool_call>'\n") + "\n\nAfter. <tool",
    "<<tool_call>" + hermes("get_weather", {"city": "Paris"})[len("<tool_call>"):] + " <",
    xml("get_weather", wrapped=False, metric="false") + "  ",
]


def run_stream(pieces: list[str]) -> tuple[str, list[tuple[str, dict]], list[dict]]:
    stream = ToolCallStream(TOOLS)
    deltas = [delta for piece in pieces for delta in stream.push(piece)] + stream.finish()
    content = "".join(d["content"] for d in deltas if "content" in d)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    assert [c["id"] for c in calls] == [c.id for c in stream.calls]
    assert all(d.get("content") != "" for d in deltas)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls], deltas


def splits(text: str) -> list[list[str]]:
    """The text one character at a time, in two at every boundary, and in random token-sized pieces."""
    ways = [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for seed in range(20):
        rng, cuts = random.Random(seed), [0]
        while cuts[-1] < len(text):
            cuts.append(cuts[-1] + rng.randint(1, 6))
        ways.append([text[a:b] for a, b in zip(cuts, cuts[1:])])
    return ways


@pytest.mark.parametrize("text", STREAMED)
def test_streaming_any_split_gives_the_content_and_calls_of_whole_parsing(text):
    content, _ = parse_tool_calls(text, TOOLS)
    whole = (content, calls_of(text))
    for pieces in splits(text):
        assert run_stream(pieces)[:2] == whole, pieces


def test_stream_sends_a_call_as_one_delta_as_soon_as_it_closes():
    stream = ToolCallStream(TOOLS)
    assert stream.push("Looking it up.\n<tool_call>\n<function=get_weather>\n<parameter=days>\n4") == [
        {"content": "Looking it up."}]
    [delta] = stream.push("\n</parameter>\n</function>\n</tool_call>")
    assert delta == {"tool_calls": [{"index": 0, "id": stream.calls[0].id, "type": "function",
                                     "function": {"name": "get_weather", "arguments": '{"days": 4}'}}]}
    assert stream.finish() == [] and len(stream.calls) == 1


def test_stream_holds_back_only_what_could_start_a_tag():
    stream = ToolCallStream(TOOLS)
    assert stream.push("if a < b") == [{"content": "if a < b"}]
    assert stream.push(" then <tool") == [{"content": " then"}]
    assert stream.push("box") == [{"content": " <toolbox"}]
    assert stream.push(" <tool_call> is a tag") == [{"content": " <tool_call> is a tag"}]
    assert stream.push("\n<func") == [] and stream.finish() == [{"content": "\n<func"}]
    assert stream.calls == ()


# ---- forcing a call and checking the request -----------------------------------------------------------------
@pytest.mark.parametrize("template, form, continuation", [
    ("... <function=example_function_name> ...", "xml", "<parameter=city>\nLima\n</parameter>\n</function>\n"
                                                        "</tool_call>"),
    ("{{ tools }} <tool_call>", "json", '{"city": "Lima"}}\n</tool_call>'),
    (None, "json", '{"city": "Lima"}}\n</tool_call>'),
])
def test_a_forced_prefix_and_the_model_continuation_parse_as_the_named_call(template, form, continuation):
    assert tool_call_format(template) == form
    assert calls_of(forced_call_prefix(form, "get_weather") + continuation) == [("get_weather", {"city": "Lima"})]
    assert forced_call_prefix(form, None) == "<tool_call>\n"


def forced_answer(form: str, name: str | None, pieces: list[str]) -> tuple[dict, list[dict]]:
    """The whole message and the streamed deltas of a model's text `pieces` after the server forced a call."""
    reading = ChatReading(tools=TOOLS, forced=forced_call_prefix(form, name))
    streamed = ChatAnswer(reading)
    deltas = [d for piece in pieces for d in streamed.push(piece)] + streamed.finish()
    return ChatAnswer(reading).message("".join(pieces)), deltas


@pytest.mark.parametrize("form, name", [("xml", None), ("xml", "get_weather"), ("json", "get_weather")])
@pytest.mark.parametrize("pieces", [[], ["\n"], ["Sorry, I cannot."], ["<fun", "ction=oops"], ["{\"city\": \"Li"]])
def test_a_forced_call_the_model_does_not_finish_leaves_only_the_models_text(form, name, pieces):
    """tool_choice "required" or a named function: the call's start is the server's, not the model's; where the model
    stops at once or writes no call, the content is what the model wrote, whole and streamed."""
    message, deltas = forced_answer(form, name, pieces)
    streamed = "".join(d.get("content", "") for d in deltas)
    assert "tool_calls" not in message and not any("tool_calls" in d for d in deltas)
    assert streamed == message["content"]
    assert "<tool_call>" not in streamed and '{"name"' not in streamed
    assert streamed.strip() == "".join(pieces).strip()


@pytest.mark.parametrize("form, name, pieces", [
    ("xml", None, ["<function=get_", "weather>\n<parameter=city>\nLima\n</parameter>\n</function>\n</tool_call>"]),
    ("xml", "get_weather", ["<parameter=city>\nLima\n</parameter>\n</function>\n</tool_call>"]),
    ("json", "get_weather", ['{"city": "Lima"}}', "\n</tool_call>"]),
])
def test_a_forced_call_the_model_finishes_is_the_call(form, name, pieces):
    message, deltas = forced_answer(form, name, pieces)
    assert message["content"] is None and not any(d.get("content") for d in deltas)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("get_weather", {"city": "Lima"})]


def test_an_unfinished_call_the_model_started_itself_stays_its_content():
    answer = ChatAnswer(ChatReading(tools=TOOLS))
    assert answer.message("<tool_call>\n<function=get_weather>")["content"] == "<tool_call>\n<function=get_weather>"


def tool(name="f", **function) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


@pytest.mark.parametrize("tools, field", [
    ({"type": "function"}, "tools must be a list"), ([tool(), "f"], "tools[1]"),
    ([tool(), {**tool("g"), "extra": 1}], "tools[1].extra"), ([{"type": "code", "function": {}}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].function"), ([tool(), tool("bad name")], "tools[1].function.name"),
    ([tool(), tool("")], "tools[1].function.name"), ([tool("x" * 65)], "tools[0].function.name"),
    ([tool(), tool("f")], "tools[1].function.name"), ([tool(parameters=[])], "tools[0].function.parameters"),
    ([tool(description=3)], "tools[0].function.description"), ([tool(strict="yes")], "tools[0].function.strict"),
    ([tool(examples=[])], "tools[0].function.examples"),
])
def test_check_tools_names_the_bad_field(tools, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        check_tools(tools)


def test_check_tools_accepts_the_openai_shape():
    tools = [tool("a.b-c_1", description="d", parameters={"type": "object"}, strict=True), tool("g", description=None)]
    assert check_tools(tools) == tools and check_tools([]) == []


@pytest.mark.parametrize("choice, tools, expected", [
    (None, TOOLS, ("auto", None)), (None, None, ("none", None)), ("none", TOOLS, ("none", None)),
    ("auto", TOOLS, ("auto", None)), ("required", TOOLS, ("required", None)),
    ({"type": "function", "function": {"name": "run_code"}}, TOOLS, ("named", "run_code")),
])
def test_check_tool_choice_modes(choice, tools, expected):
    assert check_tool_choice(choice, tools) == expected


@pytest.mark.parametrize("choice, tools, field", [
    ("required", None, "tool_choice"), ("sometimes", TOOLS, "tool_choice"), (3, TOOLS, "tool_choice"),
    ({"type": "function", "function": {"name": "nope"}}, TOOLS, "tool_choice.function.name"),
    ({"type": "function", "function": {"name": "run_code"}}, [], "tool_choice.function.name"),
    ({"type": "tool", "function": {"name": "run_code"}}, TOOLS, "tool_choice.type"),
    ({"type": "function", "function": {"name": "run_code", "x": 1}}, TOOLS, "tool_choice.function.x"),
    ({"type": "function"}, TOOLS, "tool_choice.function"),
])
def test_check_tool_choice_names_the_bad_field(choice, tools, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        check_tool_choice(choice, tools)
