"""POST /generate: the native API. Text or token ids in, text, ids, usage and timings out; JSON or SSE.

A request the server gave up on after its stream began ends with an event whose finish_reason is "error" and
whose `error` is the error object a JSON answer would have had (with `partial`: what was generated)."""

from __future__ import annotations

from aiohttp import web

from .shared import ensure_serving, prepared_request, request_timeout
from .messages import Result, Token
from .runner import collect, events, stream_response

routes = web.RouteTableDef()


def usage(result: Result) -> dict:
    timings = result.timings
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(result.output_ids),
        "cached_prompt_tokens": result.cached_tokens,
        "prefill_ms": timings.get("prefill_ms"),
        "decode_tokens_per_s": timings.get("decode_tokens_per_s"),
        "queued_ms": timings.get("queued_ms"),
        "mtp": result.mtp,
    }


@routes.post("/generate")
async def generate(request: web.Request) -> web.StreamResponse:
    prepared = await prepared_request(request, "generate")
    supervisor = await ensure_serving(request.app)
    timeout = request_timeout(request.app)
    if not prepared.stream:
        result = await collect(supervisor, prepared.fields, timeout)
        return web.json_response({"text": result.text, "token_ids": result.output_ids,
                                  "finish_reason": result.finish_reason, "usage": usage(result)})

    def render(event: Token | Result):
        if isinstance(event, Token):
            return [{"token": event.token, "text": event.text}]
        return [{"finish_reason": event.finish_reason, "error": None, "text": event.text, "usage": usage(event)}]

    def fail(err):
        return [{"finish_reason": "error", "error": err.body()["error"], "text": err.extra["partial"]["text"],
                 "usage": None}]

    return await stream_response(request, events(supervisor, prepared.fields, timeout), render, fail)
