"""HTTP errors as JSON, shaped like OpenAI's: {"error": {"message", "type", "code", "param"}}, and reading a
request's JSON body."""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

log = logging.getLogger("qwen4exp.server")


class ApiError(Exception):
    """An answer the client gets instead of a result. `extra` adds fields to the error object (e.g. `partial`:
    what a request given up on had generated)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.headers, self.extra = headers or {}, extra or {}

    def __reduce__(self):        # raised in the request-preparing processes, re-raised in the server's
        return ApiError, (self.status, self.message, self.kind, self.param, self.headers, self.extra)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "code": self.status, "param": self.param,
                          **self.extra}}


class EngineUnavailable(ApiError):
    """The engine is not serving (loading, parking, parked, restarting or failed); the message says which. A client
    may send the request again later: 503 with Retry-After."""

    def __init__(self, message: str):
        super().__init__(503, message, "server_error", headers={"Retry-After": "5"})

    def __reduce__(self):
        return EngineUnavailable, (self.message,)


class ClientFaults(logging.Filter):
    """aiohttp logs a request it cannot read (a header line past its limit, a bad Content-Length or chunk, a body
    not in its Content-Encoding) as an ERROR with a traceback, though the client got its 400 and nothing on the
    server is wrong: any client could fill the log with them. Such a record becomes one INFO line naming the fault."""

    def filter(self, record: logging.LogRecord) -> bool:
        fault = record.exc_info[1] if record.exc_info else None
        for _ in range(8):                                   # a body's decoding error arrives wrapped
            if fault is None or isinstance(fault, HttpProcessingError):
                break
            fault = fault.__cause__ or fault.__context__
        else:
            fault = None
        if fault is not None:
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = "a request that could not be read was refused: %s", (str(fault)[:200],)
            record.exc_info = record.exc_text = None
        return True


def http_logger() -> logging.Logger:
    """The logger aiohttp's connection handlers report to, with ClientFaults on it."""
    logger = logging.getLogger("qwen4exp.http")
    if not any(isinstance(f, ClientFaults) for f in logger.filters):
        logger.addFilter(ClientFaults())
    return logger


def error_response(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err)
    except web.HTTPRequestEntityTooLarge as err:
        return error_response(ApiError(413, f"the request body is too large ({err.text})"))
    except web.HTTPException as err:
        if err.status < 400:
            raise
        # What aiohttp's exception carries for the client stays (a 405's Allow, a redirect's Location).
        kept = {k: v for k, v in err.headers.items() if k.lower() not in ("content-type", "content-length")}
        message = err.reason if err.status != 405 else \
            f"{request.method} is not accepted on {request.path}; it takes {err.headers.get('Allow', 'none')}"
        return error_response(ApiError(err.status, message, headers=kept))
    except ConnectionError:
        # The client went away while its request was read or answered: nothing to answer, nothing broken. A
        # response (which cannot be sent) instead of the error keeps aiohttp from logging it as a handler's failure;
        # 499 is the status access logs use for a client that closed its request.
        log.info("the client of %s %s went away", request.method, request.path)
        return web.Response(status=499)
    except Exception:  # noqa: BLE001 - the server keeps serving; the client gets a 500 with no internals
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ApiError(500, "internal error (see the server log)", "server_error"))


def parse_json(raw: bytes) -> dict:
    """A request body as a JSON object, or ApiError(400) saying what is wrong with it and where."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {err.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as err:
        raise ApiError(400, f"the request body is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") \
            from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply to read") from None
    except ValueError as err:      # an integer longer than Python converts (sys.get_int_max_str_digits)
        reason = str(err).split(";")[0]
        raise ApiError(400, f"the request body has a number that cannot be read: {reason}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


async def read_body(request: web.Request, timeout: float | None = None) -> bytes:
    """The body's bytes, read within `timeout` seconds: a client that sends it slower gets 408. aiohttp decodes
    gzip and deflate bodies and hands any other Content-Encoding through as it came, which would then be read as
    a plain body: refused by name instead."""
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ("", "identity", "gzip", "deflate"):
        raise ApiError(415, f"the request body's Content-Encoding {encoding!r} is not one the server reads: gzip, "
                       "deflate or none", headers={"Connection": "close"})
    try:
        return await asyncio.wait_for(request.read(), timeout)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s (server.body_timeout)",
                       headers={"Connection": "close"}) from None
    except RequestPayloadError as err:       # e.g. a Content-Encoding the body is not in
        raise ApiError(400, f"the request body could not be read: {str(err).split('message:')[-1].strip()}",
                       headers={"Connection": "close"}) from None
