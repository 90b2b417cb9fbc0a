"""A chat request's prompt, and how its answer will be read: the messages (tool calls and tool results among
them), `tools` and `tool_choice`, the template's variables (`chat_template_kwargs`, `reasoning_effort`).

The chat template renders the tools and the history, as Qwen's own templates do. `tool_choice` "none" leaves the
tools out of the prompt (the model cannot call what it was not shown) and no call is read from the answer;
"required" or a named function writes the start of a call at the head of the answer, so the model can only go on
with one (closing an open reasoning block first: the model does not reason before a forced call).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from jinja2.exceptions import TemplateError

from .errors import ApiError
from .reasoning import prompt_opens_thinking
from .request_fields import boolean, plain_json, plain_text
from .tool_calls import check_tool_choice, check_tools, forced_call_prefix, tool_call_format

MESSAGE_KEYS = {"role", "content", "name", "tool_call_id", "tool_calls", "reasoning_content", "reasoning"}
# OpenAI's `developer` role is the system message of newer models; templates know `system`.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
SET_BY_THE_SERVER = {"messages", "tools", "add_generation_prompt"}
# Jinja's own name for the template; a variable of that name would also clash with the tokenizer's method.
TEMPLATE_RESERVED = {"self"}
PROMPT_TAIL_TOKENS = 64          # enough to hold the generation prompt, where an open <think> would be


@dataclass(frozen=True)
class ChatReading:
    """How the answer is read: whether it starts inside a reasoning block, the tools whose calls are parsed out of
    it (None: none are), the start of a call the server wrote for the model (`forced`, read as the answer's head)
    and whether more than one call is returned."""
    thinking: bool = False
    tools: list[dict] | None = None
    forced: str = ""
    parallel_calls: bool = True


def chat_prompt(body: dict, tokenizer) -> tuple[list[int], ChatReading]:
    """The prompt's token ids and the reading of its answer, or ApiError(400) naming the field."""
    messages = _messages(body)
    try:
        tools = plain_json(check_tools(body["tools"]), "tools") if body.get("tools") is not None else []
    except ValueError as err:
        raise ApiError(400, str(err), param="tools") from None
    try:
        mode, name = check_tool_choice(body.get("tool_choice"), tools or None)
    except ValueError as err:
        raise ApiError(400, str(err), param="tool_choice") from None
    parallel = boolean(body, "parallel_tool_calls", True)
    variables = _template_variables(body)
    if tools and mode != "none":
        variables["tools"] = tools
    try:
        ids = tokenizer.encode_chat(messages, True, **variables)
    except TemplateError as err:       # a template's raise_exception, or variables it cannot render
        raise ApiError(400, f"the model's chat template refused this chat: {err}", param="messages") from None
    thinking = prompt_opens_thinking(tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:]))
    forced = ""
    if mode in ("required", "named"):
        forced = forced_call_prefix(tool_call_format(tokenizer.chat_template), name)
        ids += tokenizer.encode_plain(("\n</think>\n\n" if thinking else "") + forced)
        thinking = False
    return ids, ChatReading(thinking, tools if tools and mode != "none" else None, forced, parallel)


def _template_variables(body: dict) -> dict:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise ApiError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    taken = sorted(SET_BY_THE_SERVER & set(kwargs))
    if taken:
        raise ApiError(400, f"'chat_template_kwargs' cannot set {', '.join(taken)}: the request's own fields do",
                       param="chat_template_kwargs")
    for name in kwargs:
        if not name.isidentifier() or name in TEMPLATE_RESERVED:
            raise ApiError(400, f"'chat_template_kwargs' key {name!r} is not a template variable's name (letters, "
                           "digits and _, not starting with a digit; not 'self')", param="chat_template_kwargs")
    variables = dict(plain_json(kwargs, "chat_template_kwargs"))
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise ApiError(400, f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                           param="reasoning_effort")
        variables["reasoning_effort"] = effort
    return variables


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message(m, where: str) -> dict:
    if not isinstance(m, dict):
        raise ApiError(400, f"{where} must be an object", param="messages")
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param="messages")
    unknown = sorted(set(m) - MESSAGE_KEYS)
    if unknown:
        raise ApiError(400, f"{where} has unknown key(s) {', '.join(unknown)}; accepted: "
                       f"{', '.join(sorted(MESSAGE_KEYS))}", param="messages")
    calls = m.get("tool_calls")
    out = {"role": ROLES[role], "content": _content(m.get("content"), role, where, has_calls=bool(calls))}
    if calls is not None:
        if role != "assistant":
            raise ApiError(400, f"{where}.tool_calls: only an assistant message makes calls", param="messages")
        out["tool_calls"] = _calls(calls, f"{where}.tool_calls")
    # vLLM's `reasoning_content` and the newer `reasoning` name one thing; null is unset, as everywhere.
    given = {key: plain_text(m[key], f"{where}.{key}", empty_ok=True)
             for key in ("reasoning_content", "reasoning") if m.get(key) is not None}
    if given:
        if role != "assistant":
            raise ApiError(400, f"{where}: only an assistant message has reasoning", param="messages")
        if len(set(given.values())) > 1:
            raise ApiError(400, f"{where} has both reasoning_content and reasoning, and they differ: give one",
                           param="messages")
        out["reasoning_content"] = next(iter(given.values()))
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            out[key] = plain_text(m[key], f"{where}.{key}", empty_ok=True)
    return out


def _calls(calls, where: str) -> list[dict]:
    """An assistant turn's calls, with their arguments as objects: templates write them out key by key."""
    if not isinstance(calls, list):
        raise ApiError(400, f"{where} must be a list", param="messages")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise ApiError(400, f"{at} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                           "\"arguments\"}}}}", param="messages")
        name = plain_text(function.get("name"), f"{at}.function.name")
        call_id = call.get("id")
        if call_id is not None:
            plain_text(call_id, f"{at}.id", empty_ok=True)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(plain_text(arguments, f"{at}.function.arguments", empty_ok=True)) \
                    if arguments.strip() else {}
            except json.JSONDecodeError as err:
                raise ApiError(400, f"{at}.function.arguments is not valid JSON: {err}", param="messages") from None
            except RecursionError:
                raise ApiError(400, f"{at}.function.arguments is nested too deeply to read", param="messages") \
                    from None
            except ValueError as err:     # an integer longer than Python converts
                raise ApiError(400, f"{at}.function.arguments has a number that cannot be read: "
                               f"{str(err).split(';')[0]}", param="messages") from None
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise ApiError(400, f"{at}.function.arguments must be a JSON object", param="messages")
        plain_json(arguments, f"{at}.function.arguments")
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return out


def _content(content, role: str, where: str, has_calls: bool = False) -> str:
    """A message's text: a string, or OpenAI's list of parts (text parts only); null for an assistant turn."""
    if content is None and (role == "assistant" or has_calls):
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}.content[{j}] must be a text part {{\"type\": \"text\", \"text\": "
                               "\"...\"}} (this model reads text only)", param="messages")
            parts.append(plain_text(part["text"], f"{where}.content[{j}].text", empty_ok=True))
        return "".join(parts)
    if not isinstance(content, str):
        raise ApiError(400, f"{where}.content must be a string or a list of text parts", param="messages")
    return plain_text(content, f"{where}.content", empty_ok=True)
