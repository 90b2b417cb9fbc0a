"""Turning a JSON body into the engine's request fields, with errors that name the field."""

from __future__ import annotations

from ..engine.sampling_params import SamplingParams
from .errors import ApiError

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed")
MAX_PROMPT_TOKENS_IN_BODY = 1 << 20


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
        raise ApiError(400, f"'{key}' must be a {'' if empty_ok else 'non-empty '}string", param=key.split("[")[0])
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ApiError(400, f"'{key}' has a lone surrogate (U+{ord(value[err.start]):04X}) at character {err.start}: "
                       "not valid Unicode", param=key.split("[")[0]) from None
    return value


def string_list(body: dict, key: str, limit: int = 16) -> list[str]:
    value = body.get(key)
    if value is None:
        return []
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ApiError(400, f"'{key}' must be a string or a list of strings", param=key)
    if len(value) > limit:
        raise ApiError(400, f"'{key}' has {len(value)} entries; at most {limit}", param=key)
    if any(not s for s in value):
        raise ApiError(400, f"'{key}' must not contain an empty string", param=key)
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
                  default_max_tokens: int) -> dict:
    """The fields the worker's engine takes, from a validated body."""
    sampling_raw = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    try:
        SamplingParams.from_dict(sampling_raw)
    except ValueError as err:
        raise ApiError(400, str(err)) from None
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, "'ignore_eos' must be a boolean", param="ignore_eos")
    stop_ids = body.get("stop_token_ids")
    stop_ids = [] if ignore_eos else list(default_stop_ids) if stop_ids is None else token_ids(
        stop_ids, "stop_token_ids", 1 << 31)
    return {
        "prompt_ids": prompt_ids,
        "max_tokens": _int(body, max_tokens_key, default_max_tokens, low=1),
        "sampling": sampling_raw,
        "stop": string_list(body, "stop"),
        "stop_token_ids": stop_ids,
    }


def check_known(body: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, f"unknown field(s) for {where}: {', '.join(unknown)}; accepted: "
                       f"{', '.join(sorted(allowed))}", param=unknown[0])
