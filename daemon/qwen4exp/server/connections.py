"""Connections that hold the server without asking anything: header deadlines and a bound on open connections.

aiohttp waits for a request's headers as long as a client takes to send them, so 50 clients that never finish
their headers would hold 50 connections forever. The guard closes a connection that is not running a request and
has not delivered complete headers within `header_timeout` seconds of opening or of its last answer (an idle
keep-alive connection is closed after that long too). Past `max_connections` open at once, a new connection is
answered 503 with Retry-After and closed at once. The request body has its own deadline (errors.read_body).
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

log = logging.getLogger("qwen4exp.server")

# Sent on a connection past the bound, before it is closed: no request was read, so no handler answers it.
_TOO_MANY = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\n"
             b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s")
_TOO_MANY_BODY = (b'{"error": {"message": "too many open connections; try again", "type": "server_error", '
                  b'"code": 503, "param": null}}')


class _Refused(asyncio.Protocol):
    def connection_made(self, transport) -> None:
        transport.write(_TOO_MANY % (len(_TOO_MANY_BODY), _TOO_MANY_BODY))
        transport.close()


class ConnectionGuard:
    def __init__(self, header_timeout: float, max_connections: int):
        self.header_timeout, self.max_connections = header_timeout, max_connections
        self._busy: dict[object, int] = {}          # connection -> requests it is running
        self._since: dict[object, float] = {}       # connection -> when it last ran none (or opened)
        self._closing: dict[object, float] = {}     # connection -> when the guard closed it
        self.closed_slow = self.refused = 0

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        connection = request.protocol
        self._busy[connection] = self._busy.get(connection, 0) + 1
        try:
            return await handler(request)
        finally:
            self._busy[connection] -= 1
            self._since[connection] = time.monotonic()

    def sweep(self, connections) -> None:
        """Close the connections that ran no request for longer than the header timeout. A close lets the answer
        still buffered for the client go out first; a client that reads none of it for another header timeout
        would hold the connection forever, so its connection is then dropped with the rest unsent."""
        now, alive = time.monotonic(), set(connections)
        for connection in alive:
            closed_at = self._closing.get(connection)
            if closed_at is not None:
                if now - closed_at > self.header_timeout and connection.transport is not None:
                    connection.transport.abort()
                continue
            since = self._since.setdefault(connection, now)
            if not self._busy.get(connection) and now - since > self.header_timeout:
                self.closed_slow += 1
                self._closing[connection] = now
                connection.force_close()
                if connection.transport is not None:
                    connection.transport.close()
        for gone in [c for c in self._since if c not in alive]:
            self._since.pop(gone, None)
            self._closing.pop(gone, None)
            if not self._busy.get(gone):
                self._busy.pop(gone, None)

    async def watch(self, server: web.Server) -> None:
        interval = max(0.05, min(1.0, self.header_timeout / 4))
        while True:
            await asyncio.sleep(interval)
            self.sweep(server.connections)


class GuardedSite(web.BaseSite):
    """A TCP site whose connections the guard watches: the bound at accept time, the deadlines by a sweeper."""

    def __init__(self, runner: web.AppRunner, guard: ConnectionGuard, host: str, port: int):
        super().__init__(runner)
        self._guard, self._host, self._port = guard, host, port
        self._watcher: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    def _protocol(self):
        server = self._runner.server
        if len(server.connections) >= self._guard.max_connections:
            self._guard.refused += 1
            return _Refused()
        return server()

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, self._host, self._port, reuse_address=True)
        self._watcher = asyncio.ensure_future(self._guard.watch(self._runner.server))

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        await super().stop()
