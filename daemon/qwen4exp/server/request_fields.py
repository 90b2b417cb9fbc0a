"""Turning a JSON body into the engine's request fields, with errors that name the field."""

from __future__ import annotations

import re

from ..engine.sampling_params import SamplingParams
from ..engine.stops import MAX_STOP_CHARS, MAX_STOP_STRINGS
from .errors import ApiError

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed")
MAX_PROMPT_TOKENS_IN_BODY = 1 << 20
# The chat template renders tools' schemas, calls' arguments and template variables by recursion (as does the
# tokenizer's pass over them): deeper values are refused, far below Python's recursion limit.
MAX_JSON_DEPTH = 64


def field_of(key: str) -> str:
    """The body's top-level field a path such as messages[2].tool_calls[0].function.name lies in."""
    return re.split(r"[.\[]", key, maxsplit=1)[0]


def optional(body: dict, key: str, default):
    """body[key], or `default` where it is absent or null (OpenAI's schema makes optional fields nullable)."""
    value = body.get(key)
    return default if value is None else value


def boolean(body: dict, key: str, default: bool) -> bool:
    value = optional(body, key, default)
    if not isinstance(value, bool):
        raise ApiError(400, f"'{key}' must be a boolean, got {type(value).__name__}", param=key)
    return value


def _int(body: dict, key: str, default=None, low: int = 0, high: int | None = None):
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise ApiError(400, f"'{key}' must be an integer, got {type(value).__name__}", param=key)
    if value < low or (high is not None and value > high):
        raise ApiError(400, f"'{key}' must be in [{low}, {high if high is not None else 'inf'}], got {value}",
                       param=key)
    return value


def plain_text(value, key: str, empty_ok: bool = False) -> str:
    """A string a client wrote, checked to be valid Unicode: JSON's \\ud800 escapes can name a lone surrogate,
    which no tokenizer (and no UTF-8 answer) can carry."""
    if not isinstance(value, str) or not (value or empty_ok):
        raise ApiError(400, f"'{key}' must be a {'' if empty_ok else 'non-empty '}string", param=field_of(key))
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ApiError(400, f"'{key}' has a lone surrogate (U+{ord(value[err.start]):04X}) at character {err.start}: "
                       "not valid Unicode", param=field_of(key)) from None
    return value


def plain_json(value, key: str, depth: int = 0):
    """A JSON value a client wrote that the chat template renders (a tool's schema, a call's arguments, a template
    variable), checked: every string in it, keys too, valid Unicode, and nested at most MAX_JSON_DEPTH deep."""
    if depth > MAX_JSON_DEPTH:
        raise ApiError(400, f"'{key}' is nested more than {MAX_JSON_DEPTH} levels deep", param=field_of(key))
    if isinstance(value, str):
        return plain_text(value, key, empty_ok=True)
    if isinstance(value, dict):
        for name, item in value.items():
            plain_text(name, f"{key} (a key)", empty_ok=True)
            plain_json(item, f"{key}.{name}", depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            plain_json(item, f"{key}[{i}]", depth + 1)
    return value


def stop_strings(body: dict, key: str = "stop") -> list[str]:
    value = body.get(key)
    if value is None:
        return []
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ApiError(400, f"'{key}' must be a string or a list of strings", param=key)
    if len(value) > MAX_STOP_STRINGS:
        raise ApiError(400, f"'{key}' has {len(value)} entries; at most {MAX_STOP_STRINGS}", param=key)
    for i, s in enumerate(value):
        if not s:
            raise ApiError(400, f"'{key}' must not contain an empty string", param=key)
        if len(s) > MAX_STOP_CHARS:
            raise ApiError(400, f"'{key}[{i}]' has {len(s)} characters; at most {MAX_STOP_CHARS}", param=key)
    return [plain_text(s, key) for s in value]


def token_ids(value, key: str, vocab: int) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value):
        raise ApiError(400, f"'{key}' must be a non-empty list of integers", param=key)
    if len(value) > MAX_PROMPT_TOKENS_IN_BODY:
        raise ApiError(400, f"'{key}' has {len(value)} tokens; at most {MAX_PROMPT_TOKENS_IN_BODY}", param=key)
    bad = [t for t in value if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"'{key}' has ids outside [0, {vocab}): {bad[:5]}", param=key)
    return value


def engine_fields(body: dict, prompt_ids: list[int], default_stop_ids: list[int], max_tokens_key: str,
                  default_max_tokens: int, vocab: int) -> dict:
    """The fields the worker's engine takes, from a validated body. Stop ids are checked against the vocabulary
    (an id past it can never be produced) and sent once each."""
    sampling_raw = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    for key, value in sampling_raw.items():       # one at a time, so the error names its field
        try:
            SamplingParams.from_dict({key: value})
        except ValueError as err:
            raise ApiError(400, str(err), param=key) from None
    ignore_eos = boolean(body, "ignore_eos", False)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:                          # ignore_eos drops the default stop, not the ids a client lists
        stop_ids = [] if ignore_eos else list(default_stop_ids)
    else:
        stop_ids = sorted(set(token_ids(stop_ids, "stop_token_ids", vocab)))
    return {
        "prompt_ids": prompt_ids,
        "max_tokens": _int(body, max_tokens_key, default_max_tokens, low=1),
        "sampling": sampling_raw,
        "stop": stop_strings(body),
        "stop_token_ids": stop_ids,
    }


def check_known(body: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, f"unknown field(s) for {where}: {', '.join(unknown)}; accepted: "
                       f"{', '.join(sorted(allowed))}", param=unknown[0])
