"""From validated Settings (config/) to the plain options the server and the engine worker take."""

from __future__ import annotations

from .shared import ServerOptions
from .options import EngineOptions


def engine_options(settings, resolve_model) -> EngineOptions:
    target = settings.target
    cache = settings.prefix_cache
    return EngineOptions(
        model=str(resolve_model(settings.model)),
        device=target.name,
        dtype=settings.dtype,
        slots=settings.slots,
        max_ctx=settings.max_ctx,
        chunk=settings.chunk_tokens,
        restore_spacing=settings.restore_spacing,
        prefix_cache=cache.enabled,
        prefix_cache_limit=cache.resident_limit,
        device_memory_limit=settings.memory_limit_for(target),
        queue_limit=settings.server.queue_limit,
        cuda_graphs=settings.cuda_graphs,
        compile_decode=settings.compile_decode,
    )


def server_options(settings) -> ServerOptions:
    server = settings.server

    def secret(value):
        return value.get_secret_value() if value is not None else None
    name = settings.model if settings.model == "tiny" else settings.model.rstrip("/").rsplit("/", 1)[-1]
    return ServerOptions(model_name=name, api_key=secret(server.api_key), admin_key=secret(server.admin_key),
                         max_body_bytes=server.max_body_bytes, wake_on_request=settings.wake_on_request,
                         park_after_idle=settings.park_after_idle, request_timeout=server.request_timeout,
                         header_timeout=server.header_timeout, body_timeout=server.body_timeout,
                         max_connections=server.max_connections)
