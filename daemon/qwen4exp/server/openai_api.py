"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions (streaming and not)."""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from .app import OPTIONS, TOKENIZER, ensure_serving, model_vocab
from .errors import ApiError, read_json
from .request_fields import SAMPLING_FIELDS, check_known, engine_fields, token_ids
from .runner import SSE, collect, events

routes = web.RouteTableDef()
# Fields OpenAI clients send that change nothing here are accepted; the rest is refused by name.
COMMON = {"model", "max_tokens", "stream", "stop", "user", "n", "stream_options", "logprobs", "ignore_eos",
          "stop_token_ids", *SAMPLING_FIELDS}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format"}


def _check_unsupported(body: dict) -> None:
    if body.get("n", 1) != 1:
        raise ApiError(400, "only n = 1 is supported", param="n")
    if body.get("logprobs") not in (None, False, 0):
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    for key in ("echo", "suffix"):
        if body.get(key):
            raise ApiError(400, f"'{key}' is not supported", param=key)
    if body.get("best_of", 1) not in (None, 1):
        raise ApiError(400, "only best_of = 1 is supported", param="best_of")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise ApiError(400, "only response_format {\"type\": \"text\"} is supported", param="response_format")


def _usage(result: dict) -> dict:
    return {"prompt_tokens": result["prompt_tokens"], "completion_tokens": len(result["output_ids"]),
            "total_tokens": result["prompt_tokens"] + len(result["output_ids"]),
            "prompt_tokens_details": {"cached_tokens": result.get("cached_tokens", 0)}}


def _finish(reason: str) -> str:
    return {"stop": "stop", "length": "length"}.get(reason, reason)


async def _serve(request, body, prompt_ids, kind: str, max_tokens_key: str) -> web.StreamResponse:
    app = request.app
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    fields = engine_fields(body, prompt_ids, app[TOKENIZER].eos_token_ids, max_tokens_key,
                           app[OPTIONS].default_max_tokens)
    supervisor = await ensure_serving(app)
    ident = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created, model = int(time.time()), app[OPTIONS].model_name
    obj = "chat.completion" if kind == "chat" else "text_completion"

    def choice(text: str, reason: str | None, streaming: bool) -> dict:
        if kind == "chat":
            key = "delta" if streaming else "message"
            return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": reason}
        return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}

    if not stream:
        result = await collect(supervisor, fields)
        return web.json_response({"id": ident, "object": obj, "created": created, "model": model,
                                  "choices": [choice(result["text"], _finish(result["finish_reason"]), False)],
                                  "usage": _usage(result)})
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    chunk_obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    sse, streamed = None, []
    async for event in events(supervisor, fields):
        if sse is None:
            sse = await SSE(request).open()
        base = {"id": ident, "object": chunk_obj, "created": created, "model": model}
        if event[0] == "token":
            if event[2]:
                streamed.append(event[2])
                await sse.send(base | {"choices": [choice(event[2], None, True)]})
            continue
        result = event[1]
        if result.get("finish_reason") == "error":
            await sse.send({"error": {"message": result.get("error"), "type": "server_error", "code": 500}})
            break
        # Bytes held back until the end (an incomplete character) arrive with the last chunk.
        tail = result["text"][len("".join(streamed)):]
        await sse.send(base | {"choices": [choice(tail, _finish(result["finish_reason"]), True)]})
        if include_usage:
            await sse.send(base | {"choices": [], "usage": _usage(result)})
    await sse.send("[DONE]")
    return await sse.close()


@routes.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [
        {"id": request.app[OPTIONS].model_name, "object": "model", "created": 0, "owned_by": "qwen4exp"}]})


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    check_known(body, COMPLETION_FIELDS, "/v1/completions")
    _check_unsupported(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        prompt_ids = request.app[TOKENIZER].encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompt_ids = token_ids(prompt, "prompt", model_vocab(request.app))
    else:
        raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids", param="prompt")
    return await _serve(request, body, prompt_ids, "text", "max_tokens")


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    check_known(body, CHAT_FIELDS, "/v1/chat/completions")
    _check_unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ApiError(400, f"messages[{i}] must be an object with string 'role' and 'content'", param="messages")
        clean.append({"role": m["role"], "content": m["content"]})
    tokenizer = request.app[TOKENIZER]
    try:
        text = tokenizer.apply_chat_template(clean, add_generation_prompt=True)
    except ValueError as err:
        raise ApiError(400, f"messages: {err}", param="messages") from None
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return await _serve(request, body, tokenizer.encode(text), "chat", key)
