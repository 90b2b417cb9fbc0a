"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions (streaming and not).

A request the server gave up on after its stream began gets an error event (`{"error": {...}}`, which the openai
client raises as APIError), then a last chunk with finish_reason "length" (a reason every client parses: the
answer was cut short), then [DONE]."""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from .shared import OPTIONS, ensure_serving, prepared_request, request_timeout
from .chat_answer import ChatAnswer
from .messages import Result, Token
from .openai_logprobs import CompletionLogprobs, chat_entries
from .runner import collect, events, stream_response

routes = web.RouteTableDef()


def _usage(result: Result) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.output_ids),
            "total_tokens": result.prompt_tokens + len(result.output_ids),
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
            "mtp": result.mtp}


async def _serve(request: web.Request, kind: str) -> web.StreamResponse:
    app = request.app
    prepared = await prepared_request(request, kind)
    supervisor = await ensure_serving(app)
    timeout = request_timeout(app)
    ident = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created, model = int(time.time()), app[OPTIONS].model_name
    answer = ChatAnswer(prepared.chat) if kind == "chat" else None
    wants_logprobs = prepared.fields.get("logprobs") is not None
    completion_logprobs = CompletionLogprobs()

    def logprobs(positions) -> dict | None:
        if not wants_logprobs:
            return None
        return {"content": chat_entries(positions)} if kind == "chat" else completion_logprobs.render(positions)

    def choice(body: dict, reason: str | None, positions=()) -> dict:
        """A choice of an answer or a chunk: a chat's message or delta (`body`), a completion's text."""
        key = "text" if kind == "completion" else "message" if not prepared.stream else "delta"
        value = body["content"] if kind == "completion" else {"role": "assistant"} | body
        return {"index": 0, key: value, "logprobs": logprobs(positions), "finish_reason": reason}

    if not prepared.stream:
        result = await collect(supervisor, prepared.fields, timeout)
        if answer is None:
            body, reason = {"content": result.text}, result.finish_reason
        else:
            body, reason = answer.message(result.text), answer.finish_reason(result.finish_reason)
        return web.json_response({"id": ident, "object": "chat.completion" if answer else "text_completion",
                                  "created": created, "model": model,
                                  "choices": [choice(body, reason, result.logprobs)], "usage": _usage(result)})
    base = {"id": ident, "object": "chat.completion.chunk" if answer else "text_completion", "created": created,
            "model": model}
    sent = 0                                   # characters streamed so far
    pending = []                               # log-probabilities of tokens whose text has not been sent

    def chunks(deltas: list[dict], reason: str | None = None) -> list[dict]:
        """One chunk a delta; the log-probabilities not sent yet go with the first; the finish reason with the
        last (a chat's in a chunk of its own)."""
        nonlocal pending
        if answer is not None and reason is not None:
            deltas = [*deltas, {}]
        out = []
        for i, delta in enumerate(deltas):
            positions, pending = pending, []
            out.append(base | {"choices": [choice(delta, reason if i == len(deltas) - 1 else None, positions)]})
        return out

    def render(event: Token | Result):
        nonlocal sent
        if isinstance(event, Token):
            if event.logprobs is not None:
                pending.append(event.logprobs)
            if not event.text:
                return []
            sent += len(event.text)
            return chunks(answer.push(event.text) if answer else [{"content": event.text}])
        # Bytes held back until the end (an incomplete character) arrive with the last chunk.
        tail = event.text[sent:]
        if answer is None:
            last = chunks([{"content": tail}], event.finish_reason)
        else:
            deltas = (answer.push(tail) if tail else []) + answer.finish()
            last = chunks(deltas, answer.finish_reason(event.finish_reason))
        return last + ([base | {"choices": [], "usage": _usage(event)}] if prepared.include_usage else [])

    def fail(err):
        return [err.body(), base | {"choices": [choice({"content": ""}, "length")]}]

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
