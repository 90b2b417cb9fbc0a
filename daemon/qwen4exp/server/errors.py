"""HTTP errors as JSON, shaped like OpenAI's: {"error": {"message", "type", "code", "param"}}."""

from __future__ import annotations

import json
import logging

from aiohttp import web

log = logging.getLogger("qwen4exp.server")


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers or {}


def error_response(status: int, message: str, kind: str, param: str | None = None,
                   headers: dict | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status, "param": param}}
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err.status, err.message, err.kind, err.param, err.headers)
    except web.HTTPRequestEntityTooLarge as err:
        return error_response(413, f"the request body is too large ({err.text})", "invalid_request_error")
    except web.HTTPException as err:
        if err.status < 400:
            raise
        return error_response(err.status, err.reason, "invalid_request_error")
    except Exception:  # noqa: BLE001 - the server keeps serving; the client gets a 500 with no internals
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, "internal error (see the server log)", "server_error")


async def read_json(request: web.Request) -> dict:
    raw = await request.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {err.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as err:
        raise ApiError(400, f"the request body is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") \
            from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body
