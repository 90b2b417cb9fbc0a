"""From a request body to what the engine runs, in a few processes beside the event loop.

Parsing a body, checking its fields, rendering a chat and tokenizing a prompt can take seconds for a client's
8 MB body; in the event loop's process even a thread would stall /health, since json.loads and the tokenizer's
list of ids hold the GIL for over 100 ms on such bodies. So each body is prepared in a small process pool (no
torch there: the tokenizer and the field rules only), and what comes back is small: the engine's fields, the
prompt's ids as one typed array.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from array import array
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from ..engine.request import MAX_TOP_LOGPROBS
from .chat_prompt import ChatReading, chat_prompt
from .errors import ApiError, parse_json
from .request_fields import SAMPLING_FIELDS, boolean, check_known, engine_fields, optional, plain_text, token_ids

log = logging.getLogger("qwen4exp.server")

GENERATE_FIELDS = {"prompt", "prompt_ids", "max_tokens", "stream", "stop", "stop_token_ids", "ignore_eos",
                   *SAMPLING_FIELDS}
# Fields OpenAI clients send that change nothing here are accepted; the rest is refused by name.
OPENAI_COMMON = {"model", "max_tokens", "stream", "stop", "user", "n", "stream_options", "logprobs", "ignore_eos",
                 "stop_token_ids", *SAMPLING_FIELDS}
COMPLETION_FIELDS = OPENAI_COMMON | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = OPENAI_COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                               "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "reasoning_effort"}
PATHS = {"generate": "/generate", "completion": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class Prepared:
    """A request ready for the engine: its fields (prompt ids as array('q')) and how to answer it."""
    fields: dict
    stream: bool = False
    include_usage: bool = False
    chat: ChatReading | None = None        # how a chat's answer is read (reasoning, tool calls)


# ---- in the pool's processes -----------------------------------------------------------------------
_TOKENIZER = None
_DEFAULT_MAX_TOKENS = 256


def _start(model_dir: str, default_max_tokens: int) -> None:
    global _TOKENIZER, _DEFAULT_MAX_TOKENS
    from ..tokenizer import Tokenizer
    _TOKENIZER, _DEFAULT_MAX_TOKENS = Tokenizer.from_path(model_dir), default_max_tokens
    _TOKENIZER.most_chars_per_token           # read from the vocabulary now, not on a request's path


def prepare_body(endpoint: str, raw: bytes, context: int | None) -> Prepared:
    """`raw` as the engine's request for `endpoint` ("generate", "completion" or "chat"), or ApiError(400) naming
    the field. `context` (when known) refuses a prompt that cannot fit before its ids leave this process."""
    tokenizer = _TOKENIZER
    body = parse_json(raw)
    chat = None
    stream = boolean(body, "stream", False)
    if endpoint == "generate":
        check_known(body, GENERATE_FIELDS, "/generate")
        prompt_ids, key, include_usage = _generate_prompt(body, tokenizer, context), "max_tokens", False
    else:
        check_known(body, CHAT_FIELDS if endpoint == "chat" else COMPLETION_FIELDS, PATHS[endpoint])
        _check_unsupported(body)
        include_usage = _include_usage(body)
        if endpoint == "chat":
            prompt_ids, chat = chat_prompt(body, tokenizer)
            key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        else:
            prompt_ids, key = _completion_prompt(body, tokenizer, context), "max_tokens"
    fields = engine_fields(body, prompt_ids, tokenizer.eos_token_ids, key, _DEFAULT_MAX_TOKENS,
                           tokenizer.vocab_size)
    if endpoint != "generate":
        fields["logprobs"] = _logprobs(body, endpoint)
    n, wanted = len(prompt_ids), fields["max_tokens"]
    if context is not None and n + wanted > context:
        raise ApiError(400, f"prompt of {n} tokens + {key} {wanted} = {n + wanted} exceeds the context of {context} "
                       "tokens", param=key)
    fields["prompt_ids"] = array("q", prompt_ids)
    return Prepared(fields, stream, include_usage, chat)


def _text_prompt(value, tokenizer, context: int | None) -> list[int]:
    """The ids of a text `prompt`. One that is more tokens than the context holds whatever it says is refused
    before it is tokenized: a few megabytes of text would hold a preparing process for seconds. Not for a chat,
    whose template may leave parts of a message out (Qwen's drops an assistant turn's text before its `</think>`)."""
    text = plain_text(value, "prompt")
    most = tokenizer.most_chars_per_token
    if context is not None and most is not None:
        fewest = -(-len(text) // most)
        if fewest >= context:
            raise ApiError(400, f"'prompt' has {len(text)} characters: at least {fewest} tokens (no token stands for "
                           f"more than {most} characters), and the context holds {context} tokens with the answer",
                           param="prompt")
    return tokenizer.encode(text)


def _generate_prompt(body: dict, tokenizer, context: int | None) -> list[int]:
    if ("prompt" in body) == ("prompt_ids" in body):
        raise ApiError(400, "give exactly one of 'prompt' (text) or 'prompt_ids' (a list of token ids)")
    if "prompt" in body:
        return _text_prompt(body["prompt"], tokenizer, context)
    return token_ids(body["prompt_ids"], "prompt_ids", tokenizer.vocab_size)


def _completion_prompt(body: dict, tokenizer, context: int | None) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return token_ids(prompt, "prompt", tokenizer.vocab_size)
    if not isinstance(prompt, str):
        raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids", param="prompt")
    return _text_prompt(prompt, tokenizer, context)


def _check_unsupported(body: dict) -> None:
    for key in ("n", "best_of"):
        value = optional(body, key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value != 1:
            raise ApiError(400, f"only {key} = 1 is supported (one choice a request), got {value!r}", param=key)
    for key in ("echo", "suffix"):
        if body.get(key):
            raise ApiError(400, f"'{key}' is not supported", param=key)
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise ApiError(400, "only response_format {\"type\": \"text\"} is supported", param="response_format")


def _logprobs(body: dict, endpoint: str) -> int | None:
    """How many alternatives each output position reports, None for no log-probabilities. Chat asks with
    `logprobs: true` and `top_logprobs: k`; completions with `logprobs: k`."""
    logprobs = body.get("logprobs")
    if endpoint == "completion":
        if logprobs is None:
            return None
        if not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}] (the alternatives reported "
                           f"for each token), got {logprobs!r}", param="logprobs")
        return logprobs
    if logprobs is not None and not isinstance(logprobs, bool):
        raise ApiError(400, f"'logprobs' must be a boolean, got {logprobs!r}", param="logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}",
                           param="top_logprobs")
        if not logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if logprobs else None


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError(400, f"'stream_options' must be an object, got {type(options).__name__}",
                       param="stream_options")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise ApiError(400, f"unknown field(s) in 'stream_options': {', '.join(unknown)}; accepted: include_usage",
                       param="stream_options")
    include = optional(options, "include_usage", False)
    if not isinstance(include, bool):
        raise ApiError(400, "'stream_options.include_usage' must be a boolean", param="stream_options")
    return include


# ---- in the event loop's process --------------------------------------------------------------------
class Preparer:
    """The pool: `await prepare(endpoint, raw, context)` -> Prepared, or ApiError."""

    def __init__(self, model_dir: str, default_max_tokens: int, workers: int = 2):
        self._args, self._workers = (model_dir, default_max_tokens), workers
        self._pool: ProcessPoolExecutor | None = None

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self._workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_start, initargs=self._args)

    async def start(self) -> None:
        """Start the processes now, so the first request does not wait for them."""
        self._pool = self._new_pool()
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._pool, _ready) for _ in range(self._workers)))

    async def prepare(self, endpoint: str, raw: bytes, context: int | None) -> Prepared:
        loop = asyncio.get_running_loop()
        for attempt in (1, 2):
            if self._pool is None:
                self._pool = self._new_pool()
            pool = self._pool
            try:
                return await loop.run_in_executor(pool, prepare_body, endpoint, raw, context)
            except BrokenProcessPool:
                # A process of the pool died (killed, out of memory): start a new pool, try the body once more.
                log.error("a request-preparation process died; starting new ones")
                if self._pool is pool:
                    self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
        raise ApiError(503, "the request could not be prepared: the preparing processes died twice",
                       "server_error", headers={"Retry-After": "5"})

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _ready() -> bool:
    return _TOKENIZER is not None
