"""Tool calls: checking a request's `tools` and `tool_choice`, and turning the text a Qwen model generates into
OpenAI `tool_calls`, whole (`parse_tool_calls`) or while it streams (`ToolCallStream`).

Qwen models write a call in one of two forms; the parser accepts both, even mixed in one answer:

    XML (Qwen3.5, Qwen3-Coder, Qwen3-Next)      JSON (Qwen2.5, Qwen3: "hermes" style)
    <tool_call>                                 <tool_call>
    <function=get_weather>                      {"name": "get_weather", "arguments": {"city": "Paris"}}
    <parameter=city>                            </tool_call>
    Paris
    </parameter>
    </function>
    </tool_call>

Grammar, and what happens to text that breaks it:
- XML: `<function=NAME>`, then any number of `<parameter=KEY>VALUE</parameter>`, then `</function>`, with only
  whitespace between the tags. The `<tool_call>` wrapper is optional (models sometimes leave it out). A VALUE is any
  text up to the next `</parameter>`, less one leading and one trailing newline, typed by the tool's JSON schema
  (`typed_value`).
- JSON: the text between `<tool_call>` and the first `</tool_call>` is one object with "name" and "arguments"
  ("parameters" is taken as a synonym), the arguments an object or a JSON string holding one.
- An opening tag that cannot start a well-formed call is plain text: its `<` goes to the content and reading
  resumes right after it, so a well-formed `<function=...>` inside a broken wrapper still counts (as a bare call).
- A call still open when the text ends (generation stopped) is content, from its opening tag to the end.
- A call naming a function that is not in `tools` is still a call: the client sees the name and decides.

Whitespace: content is the text outside calls, less the whitespace that touches a call (the run just before each
call and just after it). An answer that is only calls and whitespace has content "". Streaming and whole parsing
apply this same rule, so the streamed content deltas join to exactly `parse_tool_calls`'s content.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

WRAPPER_OPEN, WRAPPER_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
OPENING_TAGS = (WRAPPER_OPEN, FUNCTION_OPEN)       # where a call can start in free text

TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")   # OpenAI's rule for function names
TOOL_KEYS = {"type", "function"}
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
TOOL_CHOICE_MODES = ("none", "auto", "required")

JSON_TYPES = {"integer": int, "number": (int, float), "object": dict, "array": list}   # what json.loads gives
_TAG_NAME = re.compile(r"[^<>\n]*")               # a function or parameter name: one line, no angle brackets


@dataclass(frozen=True)
class ToolCall:
    """One complete call; `arguments` is a JSON object in text, as OpenAI sends it."""
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        """The call as an entry of an OpenAI message's `tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _new_call(name: str, arguments: dict) -> ToolCall:
    """A call with a fresh id: "call_" and 24 random hex digits."""
    return ToolCall(id="call_" + secrets.token_hex(12), name=name,
                    arguments=json.dumps(arguments, ensure_ascii=False))


# ---- request checks ------------------------------------------------------------------------------------------
def _refuse_unknown_keys(obj: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ValueError(f"{where}.{unknown[0]} is not a known field (allowed: {', '.join(sorted(allowed))})")


def check_tools(tools) -> list[dict]:
    """The request's `tools`, checked: a list of {"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}} with distinct names. Raises ValueError naming the field, e.g. tools[1].function.name.
    An optional field given as null counts as absent."""
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    first_index: dict[str, int] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{where} must be an object")
        _refuse_unknown_keys(tool, TOOL_KEYS, where)
        if tool.get("type") != "function":
            raise ValueError(f"{where}.type must be \"function\", got {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function must be an object")
        where += ".function"
        _refuse_unknown_keys(function, FUNCTION_KEYS, where)
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ValueError(f"{where}.name must be 1 to 64 of the characters A-Z a-z 0-9 _ . -, got {name!r}")
        if name in first_index:
            raise ValueError(f"{where}.name {name!r} is already the name of tools[{first_index[name]}]")
        first_index[name] = i
        for key, kind, kind_name in (("description", str, "a string"), ("parameters", dict, "a JSON Schema object"),
                                     ("strict", bool, "a boolean")):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise ValueError(f"{where}.{key} must be {kind_name}")
    return tools


def check_tool_choice(choice, tools: list[dict] | None) -> tuple[str, str | None]:
    """(mode, name) from the request's `tool_choice`, given its checked `tools`: mode is "none", "auto",
    "required" or "named" (name set only for "named"). Absent, it is "auto" when there are tools, else "none".
    Raises ValueError naming the field."""
    names = [tool["function"]["name"] for tool in tools or ()]
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in TOOL_CHOICE_MODES:
            raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICE_MODES)} or "
                             f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}")
        if choice == "required" and not names:
            raise ValueError("tool_choice \"required\" needs tools, and the request has none")
        return choice, None
    if not isinstance(choice, dict):
        raise ValueError("tool_choice must be a string or an object")
    _refuse_unknown_keys(choice, {"type", "function"}, "tool_choice")
    if choice.get("type") != "function":
        raise ValueError(f"tool_choice.type must be \"function\", got {choice.get('type')!r}")
    function = choice.get("function")
    if not isinstance(function, dict):
        raise ValueError("tool_choice.function must be an object")
    _refuse_unknown_keys(function, {"name"}, "tool_choice.function")
    name = function.get("name")
    if not isinstance(name, str) or name not in names:
        raise ValueError(f"tool_choice.function.name must name one of the tools ({', '.join(names) or 'none given'})"
                         f", got {name!r}")
    return "named", name


# ---- forcing a call ------------------------------------------------------------------------------------------
def tool_call_format(chat_template: str | None) -> str:
    """The call form the model's chat template teaches: "xml" if it shows `<function=...>`, else "json"."""
    return "xml" if chat_template and FUNCTION_OPEN in chat_template else "json"


def forced_call_prefix(form: str, name: str | None) -> str:
    """The start of a call in `form` ("xml" or "json"), for tool_choice "required" (name None) or a named function.
    The server appends it to the prompt, so the model can only continue the call; since the model's text then lacks
    this start, the server pushes it into the ToolCallStream (or prepends it to the text) before the model's text."""
    if form not in ("xml", "json"):
        raise ValueError(f"tool call form must be \"xml\" or \"json\", got {form!r}")
    if name is None:
        return WRAPPER_OPEN + "\n"
    if form == "xml":
        return f"{WRAPPER_OPEN}\n{FUNCTION_OPEN}{name}>\n"
    return f'{WRAPPER_OPEN}\n{{"name": {json.dumps(name)}, "arguments": '


# ---- typing XML parameter values -----------------------------------------------------------------------------
def _reject(text: str):
    raise ValueError(f"{text} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} overflows a float")
    return value


def _strict_json(text: str):
    """json.loads, refusing NaN and infinities, which JSON cannot write back: arguments must stay valid JSON."""
    return json.loads(text, parse_constant=_reject, parse_float=_finite_float)


def _as_type(text: str, schema_type) -> object:
    """`text` as a value of one JSON schema type, or ValueError."""
    if schema_type == "string":
        return text
    stripped = text.strip()
    if schema_type == "boolean" and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if schema_type == "null" and stripped == "null":
        return None
    if isinstance(schema_type, str) and schema_type in JSON_TYPES:
        try:
            value = _strict_json(stripped)
        except RecursionError:      # absurdly deep nesting: keep the text
            raise ValueError("too deeply nested") from None
        if isinstance(value, JSON_TYPES[schema_type]) and not isinstance(value, bool):   # json's true is an int
            return value
    raise ValueError(f"not a {schema_type}")


def typed_value(text: str, schema_type) -> object:
    """A parameter's text as its schema type says: "integer", "number", "boolean", "null", "object", "array", or a
    list of these tried in order. Text that fits none, an unknown or missing type, or "string" stays the text."""
    for candidate in schema_type if isinstance(schema_type, list) else [schema_type]:
        try:
            return _as_type(text, candidate)
        except ValueError:
            continue
    return text


def _parameter_types(tools: list[dict] | None) -> dict[str, dict[str, object]]:
    """Function name -> parameter name -> JSON schema type, for the tools that declare them."""
    types: dict[str, dict[str, object]] = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        parameters = function.get("parameters") if isinstance(function, dict) else None
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        if isinstance(properties, dict):
            types[function.get("name")] = {key: schema.get("type") for key, schema in properties.items()
                                           if isinstance(schema, dict)}
    return types


# ---- reading one call ----------------------------------------------------------------------------------------
class _NeedMore(Exception):
    """The text ends inside the call: more text could still complete it."""


class _Malformed(Exception):
    """The call breaks the grammar: no continuation can make it a call."""


def _one_of(text: str, pos: int, literals: tuple[str, ...]) -> str:
    """Which of `literals` starts at `pos`."""
    for literal in literals:
        if text.startswith(literal, pos):
            return literal
    if any(literal.startswith(text[pos:]) for literal in literals):    # the text stops partway through one
        raise _NeedMore
    raise _Malformed


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _tag_name(text: str, pos: int) -> tuple[str, int]:
    """The NAME of `<function=NAME>` or `<parameter=NAME>` read from `pos`, and the position after its `>`."""
    end = _TAG_NAME.match(text, pos).end()
    if end == len(text):
        raise _NeedMore
    name = text[pos:end].strip()
    if text[end] != ">" or not name:
        raise _Malformed
    return name, end + 1


def _read_function(text: str, pos: int, types: dict[str, dict[str, object]]) -> tuple[str, dict, int]:
    """An XML `<function=...>...</function>` at `pos`: (name, typed arguments, position after it)."""
    name, pos = _tag_name(text, pos + len(FUNCTION_OPEN))
    raw: dict[str, str] = {}
    while True:
        pos = _skip_space(text, pos)
        if _one_of(text, pos, (PARAMETER_OPEN, FUNCTION_CLOSE)) == FUNCTION_CLOSE:
            break
        key, pos = _tag_name(text, pos + len(PARAMETER_OPEN))
        close = text.find(PARAMETER_CLOSE, pos)
        if close < 0:
            raise _NeedMore
        value = text[pos:close]
        value = value[1:] if value.startswith("\n") else value
        raw[key] = value[:-1] if value.endswith("\n") else value
        pos = close + len(PARAMETER_CLOSE)
    schema = types.get(name, {})
    return name, {key: typed_value(value, schema.get(key)) for key, value in raw.items()}, pos + len(FUNCTION_CLOSE)


def _json_call(body: str) -> tuple[str, dict]:
    """(name, arguments) from a hermes-style JSON call."""
    try:
        call = _strict_json(body)
        if not isinstance(call, dict):
            raise _Malformed
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = _strict_json(arguments)
    except (ValueError, RecursionError):
        raise _Malformed from None
    name = call.get("name")
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        raise _Malformed
    return name, arguments


def _read_call(text: str, pos: int, types: dict[str, dict[str, object]]) -> tuple[ToolCall, int]:
    """The call whose opening tag is at `pos`, and the position after it; raises _NeedMore or _Malformed."""
    if text.startswith(FUNCTION_OPEN, pos):
        name, arguments, end = _read_function(text, pos, types)
        return _new_call(name, arguments), end
    pos = _skip_space(text, pos + len(WRAPPER_OPEN))
    if _one_of(text, pos, (FUNCTION_OPEN, "{")) == FUNCTION_OPEN:
        name, arguments, pos = _read_function(text, pos, types)
        pos = _skip_space(text, pos)
        _one_of(text, pos, (WRAPPER_CLOSE,))    # raises unless the wrapper closes here
        return _new_call(name, arguments), pos + len(WRAPPER_CLOSE)
    close = text.find(WRAPPER_CLOSE, pos)
    if close < 0:
        raise _NeedMore
    name, arguments = _json_call(text[pos:close])
    return _new_call(name, arguments), close + len(WRAPPER_CLOSE)


# ---- whole text and streaming --------------------------------------------------------------------------------
def _next_opening_tag(text: str, pos: int) -> int:
    """Where the first complete opening tag at or after `pos` starts, or -1."""
    found = [at for at in (text.find(tag, pos) for tag in OPENING_TAGS) if at >= 0]
    return min(found, default=-1)


def _partial_tag_length(text: str, pos: int) -> int:
    """The length of the longest end of text[pos:] that could be the start of an opening tag."""
    for length in range(min(len(text) - pos, max(map(len, OPENING_TAGS)) - 1), 0, -1):
        if any(tag.startswith(text[-length:]) for tag in OPENING_TAGS):
            return length
    return 0


class ToolCallStream:
    """Generated text in, OpenAI chat-completion-chunk `delta`s out: {"content": ...} or {"tool_calls": [...]}.

    Content is sent as soon as it is certain. Held back are only an end that could begin an opening tag, an
    opening tag until its call completes or breaks the grammar, and trailing whitespace (dropped if a call follows;
    whitespace right after a call is dropped too), so the content deltas join to `parse_tool_calls`'s content.
    A call is sent as one delta once complete: index (from 0 over the answer), id, name and all its arguments;
    OpenAI clients add deltas up, so this is a valid stream. Call `finish()` at the end of generation."""

    def __init__(self, tools: list[dict] | None):
        self._types = _parameter_types(tools)
        self._pending = ""          # text not yet sent: a possible tag start, or an open call with the space before
        self._after_call = False    # whether the last thing sent was a call, so leading whitespace is dropped
        self._calls: list[ToolCall] = []

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        """The calls sent so far, in order."""
        return tuple(self._calls)

    def push(self, delta: str) -> list[dict]:
        """The deltas that `delta`, the next piece of generated text, makes certain."""
        self._pending += delta
        return self._advance(at_end=False)

    def finish(self) -> list[dict]:
        """The deltas left at the end of generation: held-back text, and an unfinished call as content."""
        return self._advance(at_end=True)

    def _advance(self, at_end: bool) -> list[dict]:
        text, pos, out = self._pending, 0, []
        while True:
            tag = _next_opening_tag(text, pos)
            if tag < 0:
                end = len(text) if at_end else len(text) - _partial_tag_length(text, pos)
                pos = self._send_content(text, pos, end, out, keep_trailing_space=at_end)
                break
            try:
                call, call_end = _read_call(text, tag, self._types)
            except _Malformed:          # the tag's "<" is plain text; read on after it
                pos = self._send_content(text, pos, tag + 1, out, keep_trailing_space=True)
                continue
            except _NeedMore:
                if at_end:              # generation stopped inside the call: all of it is content
                    pos = self._send_content(text, pos, len(text), out, keep_trailing_space=True)
                else:
                    pos = self._send_content(text, pos, tag, out, keep_trailing_space=False)
                break
            self._send_content(text, pos, tag, out, keep_trailing_space=False)    # the space before a call is dropped
            self._send_call(call, out)
            pos = call_end
        self._pending = text[pos:]
        return out

    def _send_content(self, text: str, start: int, end: int, out: list[dict], keep_trailing_space: bool) -> int:
        """Sends text[start:end] less the whitespace that touches a call; returns where unsent text starts (the
        trailing whitespace is kept unsent unless `keep_trailing_space`, as a call may follow it)."""
        piece = text[start:end]
        if not keep_trailing_space:
            piece = piece.rstrip()
            end = start + len(piece)
        if self._after_call:
            piece = piece.lstrip()
        if piece:
            self._after_call = False
            if out and "content" in out[-1]:
                out[-1]["content"] += piece
            else:
                out.append({"content": piece})
        return end

    def _send_call(self, call: ToolCall, out: list[dict]) -> None:
        out.append({"tool_calls": [{"index": len(self._calls), **call.to_openai()}]})
        self._calls.append(call)
        self._after_call = True


def parse_tool_calls(text: str, tools: list[dict] | None) -> tuple[str, list[ToolCall]]:
    """(content, calls) from a whole generated text; see the module's docstring for the grammar and whitespace."""
    stream = ToolCallStream(tools)
    deltas = stream.push(text) + stream.finish()
    return "".join(delta.get("content", "") for delta in deltas), list(stream.calls)
