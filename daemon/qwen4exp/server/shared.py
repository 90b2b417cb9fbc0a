"""What the app's handlers share: the server's options, the application's keys, and the steps every inference
endpoint takes (read and prepare the body, wake a parked engine, the request deadline)."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from ..engine.engine_config import EngineConfig
from .connections import ConnectionGuard
from .errors import EngineUnavailable, read_body
from .messages import EngineState
from .prepare import Prepared, Preparer
from .supervisor import Supervisor


@dataclass(frozen=True)
class ServerOptions:
    model_name: str = "qwen4exp"
    api_key: str | None = None
    admin_key: str | None = None
    max_body_bytes: int = 8 << 20
    wake_on_request: bool = False
    park_after_idle: float | None = None      # seconds without requests before an automatic park
    park_level: str = "release"               # what a park keeps: "release" nothing, "offload" the weights
    default_max_tokens: int = 256
    request_timeout: float | None = 600.0     # queue + prefill + decode of one request
    header_timeout: float = 10.0              # a connection's request headers, and its idle time between requests
    body_timeout: float = 60.0                # a request's body, once its headers arrived
    max_connections: int = 1024               # open at once; past it, new connections get 503 and are closed

    @classmethod
    def from_settings(cls, settings) -> "ServerOptions":
        """The HTTP side of a profile (config.Settings): the name clients see, keys, limits and timeouts."""
        server = settings.server

        def secret(value):
            return value.get_secret_value() if value is not None else None
        name = settings.model if settings.model == "tiny" else settings.model.rstrip("/").rsplit("/", 1)[-1]
        return cls(model_name=name, api_key=secret(server.api_key), admin_key=secret(server.admin_key),
                   max_body_bytes=server.max_body_bytes, wake_on_request=settings.wake_on_request,
                   park_after_idle=settings.park_after_idle, park_level=settings.park_level,
                   request_timeout=server.request_timeout,
                   header_timeout=server.header_timeout, body_timeout=server.body_timeout,
                   max_connections=server.max_connections)


SUPERVISOR = web.AppKey("supervisor", Supervisor)
PREPARER = web.AppKey("preparer", Preparer)
GUARD = web.AppKey("guard", ConnectionGuard)
OPTIONS = web.AppKey("options", ServerOptions)
ENGINE_CONFIG = web.AppKey("engine_config", EngineConfig)
STARTED = web.AppKey("started", float)


def request_timeout(app: web.Application) -> float | None:
    return app[OPTIONS].request_timeout


async def prepared_request(request: web.Request, endpoint: str) -> Prepared:
    """The request's body read (within server.body_timeout) and prepared for the engine off the event loop."""
    raw = await read_body(request, request.app[OPTIONS].body_timeout)
    return await request.app[PREPARER].prepare(endpoint, raw, request.app[SUPERVISOR].fitted_context)


async def ensure_serving(app: web.Application) -> Supervisor:
    """The supervisor, after waking a parked engine when the profile says so (its submit answers 503 while the
    engine is not serving, saying why)."""
    supervisor = app[SUPERVISOR]
    if supervisor.state is EngineState.PARKED and app[OPTIONS].wake_on_request:
        try:
            await supervisor.unpark()
        except EngineUnavailable:
            pass                          # the state says why; submit reports it
    return supervisor
