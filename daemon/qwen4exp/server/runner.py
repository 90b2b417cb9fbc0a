"""Running one request through the supervisor: events in order, a deadline, cancellation when the client goes
away, and one rule for work the server gave up on.

Every way a request can end without its answer is an ApiError the client sees, carrying what was generated:
  - the engine was parked in "abort" mode, or stopped, or its worker died: 503 + Retry-After (send it again);
  - `server.request_timeout` passed: 408 (the limit is the operator's; sending it again would time out again);
  - the engine failed on the request: 500.
A JSON answer carries it as its error; a stream that already began ends with an error event (see SSE users).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web

from .errors import ApiError, EngineUnavailable
from .messages import Finished, RejectReason, Rejected, Result, Token
from .supervisor import Lost, Supervisor

log = logging.getLogger("qwen4exp.server")
RETRY_AFTER = {"Retry-After": "5"}


@dataclass
class Progress:
    """What a request got so far, for the answer that reports why it ended early (the text is joined only then,
    not once per token)."""
    token_ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)

    def partial(self) -> dict:
        return {"text": "".join(self.pieces), "token_ids": self.token_ids, "completion_tokens": len(self.token_ids)}


def _rejected(rejected: Rejected) -> ApiError:
    """The worker refused the request before it started."""
    if rejected.reason is RejectReason.QUEUE_FULL:
        return ApiError(429, rejected.message, "rate_limit_error", headers={"Retry-After": "1"})
    if rejected.reason is RejectReason.PARKED:
        return EngineUnavailable(rejected.message)
    return ApiError(400, rejected.message)


def _given_up(status: int, message: str, progress: Progress, headers: dict | None = None) -> ApiError:
    got = f"; {len(progress.token_ids)} tokens were generated before it ended" if progress.token_ids else ""
    return ApiError(status, message + got, "server_error" if status >= 500 else "timeout_error", headers=headers,
                    extra={"partial": progress.partial()})


async def events(supervisor: Supervisor, fields: dict, timeout: float | None) -> AsyncIterator[Token | Result]:
    """Yields a Token per generated token, then the Result. A request that cannot end with its answer raises
    ApiError (see the module's docstring), before or after its first token."""
    started = time.monotonic()
    stream = supervisor.submit(fields)           # EngineUnavailable (503) if the engine is not serving
    progress, finished = Progress(), False
    try:
        while True:
            remaining = None if timeout is None else timeout - (time.monotonic() - started)
            try:
                if remaining is not None and remaining <= 0:
                    raise TimeoutError
                event = await asyncio.wait_for(stream.queue.get(), remaining)
            except TimeoutError:
                phase = "decoding" if progress.token_ids else "waiting for its first token"
                raise _given_up(408, f"the request timed out after {timeout:g} s (server.request_timeout) while "
                                f"{phase}", progress, {"x-should-retry": "false"}) from None
            if isinstance(event, Token):
                progress.token_ids.append(event.token)
                progress.pieces.append(event.text)
                yield event
                continue
            finished = True
            if isinstance(event, Rejected):
                raise _rejected(event)
            if isinstance(event, Lost):
                raise _given_up(503, event.message, progress, RETRY_AFTER)
            assert isinstance(event, Finished), event
            result = event.result
            reason = result.finish_reason
            if reason == "cancelled":
                raise _given_up(503, "the request was cancelled before it finished (the engine was parked in "
                                "'abort' mode or stopped); send it again", progress, RETRY_AFTER)
            if reason == "error":
                raise _given_up(500, f"the request failed in the engine: {result.error}", progress)
            yield result
            return
    finally:
        if not finished:          # the client went away, the deadline passed, or the handler was cancelled
            supervisor.cancel(stream)


async def collect(supervisor: Supervisor, fields: dict, timeout: float | None) -> Result:
    """The request's Result; raises ApiError as events() does."""
    async with contextlib.aclosing(events(supervisor, fields, timeout)) as stream:
        async for event in stream:
            if isinstance(event, Result):
                return event
    raise AssertionError("events() ends with a Result or raises")


async def stream_response(request: web.Request, stream: AsyncIterator[Token | Result], render, fail,
                          closing: tuple = ()) -> web.StreamResponse:
    """Serve `stream`'s events as SSE: `render(event)` and `fail(err)` give the payloads to send for an event and
    for a request given up on after the stream began; `closing` is sent after either. The response opens on the
    first event, so a request refused before it still gets a plain JSON error with its status. A client that goes
    away is an ordinary end: one INFO line, its request cancelled."""
    sse = SSE(request)
    async with contextlib.aclosing(stream):
        try:
            try:
                async for event in stream:
                    if not sse.response.prepared:
                        await sse.open()
                    for payload in render(event):
                        await sse.send(payload)
            except ApiError as err:
                if not sse.response.prepared:
                    raise
                for payload in fail(err):
                    await sse.send(payload)
            for payload in closing:
                await sse.send(payload)
        except ConnectionError:
            log.info("the client of %s %s went away mid-stream; its request is cancelled", request.method,
                     request.path)
            return sse.response
    return await sse.close()


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
