"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions (streaming and not).

A request the server gave up on after its stream began gets an error event (`{"error": {...}}`, which the openai
client raises as APIError), then a last chunk with finish_reason "length" (a reason every client parses: the
answer was cut short), then [DONE]."""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from .shared import OPTIONS, ensure_serving, prepared_request, request_timeout
from .messages import Result, Token
from .runner import collect, events, stream_response

routes = web.RouteTableDef()


def _usage(result: Result) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.output_ids),
            "total_tokens": result.prompt_tokens + len(result.output_ids),
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


async def _serve(request: web.Request, kind: str) -> web.StreamResponse:
    app = request.app
    prepared = await prepared_request(request, kind)
    supervisor = await ensure_serving(app)
    timeout = request_timeout(app)
    ident = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created, model = int(time.time()), app[OPTIONS].model_name
    obj = "chat.completion" if kind == "chat" else "text_completion"

    def choice(text: str, reason: str | None, streaming: bool) -> dict:
        if kind == "chat":
            key = "delta" if streaming else "message"
            return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": reason}
        return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}

    if not prepared.stream:
        result = await collect(supervisor, prepared.fields, timeout)
        return web.json_response({"id": ident, "object": obj, "created": created, "model": model,
                                  "choices": [choice(result.text, result.finish_reason, False)],
                                  "usage": _usage(result)})
    base = {"id": ident, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created, "model": model}
    sent = 0                                   # characters streamed so far

    def render(event: Token | Result):
        nonlocal sent
        if isinstance(event, Token):
            if not event.text:
                return []
            sent += len(event.text)
            return [base | {"choices": [choice(event.text, None, True)]}]
        # Bytes held back until the end (an incomplete character) arrive with the last chunk.
        tail = event.text[sent:]
        last = [base | {"choices": [choice(tail, event.finish_reason, True)]}]
        return last + ([base | {"choices": [], "usage": _usage(event)}] if prepared.include_usage else [])

    def fail(err):
        return [err.body(), base | {"choices": [choice("", "length", True)]}]

    return await stream_response(request, events(supervisor, prepared.fields, timeout), render, fail,
                                 closing=("[DONE]",))


@routes.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [
        {"id": request.app[OPTIONS].model_name, "object": "model", "created": 0, "owned_by": "qwen4exp"}]})


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completion")


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")
