"""POST /generate: the native API. Text or token ids in, text, ids, usage and timings out; JSON or SSE."""

from __future__ import annotations

from aiohttp import web

from .app import OPTIONS, TOKENIZER, ensure_serving, model_vocab
from .errors import ApiError, read_json
from .request_fields import SAMPLING_FIELDS, check_known, engine_fields, token_ids
from .runner import SSE, collect, events

routes = web.RouteTableDef()
FIELDS = {"prompt", "prompt_ids", "max_tokens", "stream", "stop", "stop_token_ids", "ignore_eos", *SAMPLING_FIELDS}


def usage(result: dict) -> dict:
    timings = result.get("timings", {})
    return {
        "prompt_tokens": result["prompt_tokens"],
        "completion_tokens": len(result["output_ids"]),
        "cached_prompt_tokens": result.get("cached_tokens", 0),
        "prefill_ms": timings.get("prefill_ms"),
        "decode_tokens_per_s": timings.get("decode_tokens_per_s"),
        "queued_ms": timings.get("queued_ms"),
    }


@routes.post("/generate")
async def generate(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    check_known(body, FIELDS, "/generate")
    tokenizer = request.app[TOKENIZER]
    if ("prompt" in body) == ("prompt_ids" in body):
        raise ApiError(400, "give exactly one of 'prompt' (text) or 'prompt_ids' (a list of token ids)")
    if "prompt" in body:
        if not isinstance(body["prompt"], str) or not body["prompt"]:
            raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
        prompt_ids = tokenizer.encode(body["prompt"])
    else:
        prompt_ids = token_ids(body["prompt_ids"], "prompt_ids", model_vocab(request.app))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    fields = engine_fields(body, prompt_ids, tokenizer.eos_token_ids, "max_tokens",
                           request.app[OPTIONS].default_max_tokens)
    supervisor = await ensure_serving(request.app)
    if not stream:
        result = await collect(supervisor, fields)
        return web.json_response({"text": result["text"], "token_ids": result["output_ids"],
                                  "finish_reason": result["finish_reason"], "usage": usage(result)})
    sse = None
    async for event in events(supervisor, fields):
        if sse is None:
            sse = await SSE(request).open()       # opened on the first event, so a rejection is still a 4xx
        if event[0] == "token":
            await sse.send({"token": event[1], "text": event[2]})
        else:
            result = event[1]
            await sse.send({"finish_reason": result["finish_reason"], "error": result.get("error"),
                            "text": result.get("text"), "usage": usage(result) if "prompt_tokens" in result else None})
    return await sse.close()
