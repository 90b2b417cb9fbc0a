"""Running one request through the supervisor: events in order, cancellation when the client goes away."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from aiohttp import web

from .errors import ApiError
from .supervisor import EngineUnavailable, Supervisor


def _reject(message: str) -> ApiError:
    if "queue is full" in message:
        return ApiError(429, message, "rate_limit_error", headers={"Retry-After": "1"})
    if "parked" in message or "worker" in message:
        return ApiError(503, message, "server_error", headers={"Retry-After": "5"})
    return ApiError(400, message)


async def events(supervisor: Supervisor, fields: dict) -> AsyncIterator[tuple]:
    """Yields ("token", id, text) events, then ends with the ("finish", result) event. A rejection before the
    first token raises ApiError; a lost worker mid-stream ends with a finish of reason "error"."""
    try:
        stream = supervisor.submit(fields)
    except EngineUnavailable as err:
        raise ApiError(503, str(err), "server_error", headers={"Retry-After": "5"}) from None
    finished = False
    try:
        started = False
        while True:
            event = await stream.queue.get()
            if event[0] == "rejected":
                finished = True
                if not started:
                    raise _reject(event[1])
                yield ("finish", {"finish_reason": "error", "error": event[1]})
                return
            if event[0] == "finish":
                finished = True
                yield event
                return
            started = True
            yield event
    finally:
        if not finished:          # the client went away (or the handler was cancelled): free the slot
            supervisor.cancel(stream)


async def collect(supervisor: Supervisor, fields: dict) -> dict:
    result = None
    async for event in events(supervisor, fields):
        if event[0] == "finish":
            result = event[1]
    if result.get("finish_reason") == "error" and result.get("error"):
        raise ApiError(500, f"the request failed in the engine: {result['error']}", "server_error")
    return result


class SSE:
    """A text/event-stream response: `await send(obj)` writes one `data:` event."""

    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})

    async def open(self) -> "SSE":
        await self.response.prepare(self.request)
        return self

    async def send(self, payload) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        await self.response.write(f"data: {data}\n\n".encode())

    async def close(self) -> web.StreamResponse:
        await self.response.write_eof()
        return self.response

