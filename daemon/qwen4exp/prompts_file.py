"""`qwen4exp generate --prompts-file F.jsonl`: one request per line, validated with file:line in errors.

A line is {"prompt": "..."} or {"prompt_ids": [1, 2, 3]}, optionally with max_tokens, stop (a string or a
list of strings), stop_token_ids, chat (true: wrap the prompt as a user turn of the chat template) and the
sampling fields of SamplingParams (temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
frequency_penalty, seed).
"""

from __future__ import annotations

import json
from pathlib import Path

from .engine.request import Request
from .engine.sampling import SamplingParams

_REQUEST_KEYS = {"prompt", "prompt_ids", "max_tokens", "stop", "stop_token_ids", "chat"}


class PromptsFileError(ValueError):
    pass


def read_requests(path: str | Path, tokenizer, default_max_tokens: int, eos_ids: tuple[int, ...]) -> list[Request]:
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise PromptsFileError(f"{path}: cannot read: {err}") from None
    requests = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as err:
            raise PromptsFileError(f"{where}: not valid JSON: {err.msg} at column {err.colno}") from None
        if not isinstance(entry, dict):
            raise PromptsFileError(f"{where}: each line must be a JSON object, got {type(entry).__name__}")
        requests.append(_request(entry, where, tokenizer, default_max_tokens, eos_ids))
    if not requests:
        raise PromptsFileError(f"{path}: no requests (expected one JSON object per line)")
    return requests


def _request(entry: dict, where: str, tokenizer, default_max_tokens: int, eos_ids: tuple[int, ...]) -> Request:
    if ("prompt" in entry) == ("prompt_ids" in entry):
        raise PromptsFileError(f"{where}: give exactly one of \"prompt\" (text) or \"prompt_ids\" (a list of ints)")
    chat = entry.get("chat", False)
    if not isinstance(chat, bool):
        raise PromptsFileError(f"{where}: \"chat\" must be true or false, got {chat!r}")
    if "prompt" in entry:
        if not isinstance(entry["prompt"], str):
            raise PromptsFileError(f"{where}: \"prompt\" must be a string")
        text = entry["prompt"]
        # A chat prompt is tokenized as the server tokenizes one: its text stays text, whatever it contains.
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": text}]) if chat else tokenizer.encode(text)
    else:
        ids = entry["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise PromptsFileError(f"{where}: \"prompt_ids\" must be a list of integers")
        prompt_ids = ids
    max_tokens = entry.get("max_tokens", default_max_tokens)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise PromptsFileError(f"{where}: \"max_tokens\" must be a positive integer, got {max_tokens!r}")
    stop = entry.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise PromptsFileError(f"{where}: \"stop\" must be a string or a list of strings")
    stop_ids = entry.get("stop_token_ids", list(eos_ids))
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                 for t in stop_ids):
        raise PromptsFileError(f"{where}: \"stop_token_ids\" must be a list of token ids (integers >= 0), got "
                               f"{stop_ids!r}")
    sampling_fields = {k: v for k, v in entry.items() if k not in _REQUEST_KEYS}
    try:
        sampling = SamplingParams.from_dict(sampling_fields, where=where)
    except ValueError as err:
        raise PromptsFileError(str(err) if where in str(err) else f"{where}: {err}") from None
    return Request(prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=sampling, stop=tuple(stop),
                   stop_token_ids=tuple(stop_ids))
