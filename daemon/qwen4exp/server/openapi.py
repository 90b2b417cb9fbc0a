"""GET /openapi.json: the API described for clients and for fuzzing."""

from __future__ import annotations

from aiohttp import web

_SAMPLING = {
    "temperature": {"type": "number", "minimum": 0}, "top_k": {"type": "integer", "minimum": 0},
    "top_p": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1}, "min_p": {"type": "number", "minimum": 0},
    "repetition_penalty": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2}, "seed": {"type": "integer"},
    "max_tokens": {"type": "integer", "minimum": 1}, "stream": {"type": "boolean"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 16}]},
    "ignore_eos": {"type": "boolean"},
}
_ERROR = {"description": "an error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _post(summary: str, schema: dict, admin: bool = False) -> dict:
    return {"post": {
        "summary": summary,
        "security": [{"admin": []}] if admin else [{"bearer": []}],
        "requestBody": {"required": not admin, "content": {"application/json": {"schema": schema}}},
        "responses": {"200": {"description": "the result (JSON, or text/event-stream when stream is true)"},
                      "400": _ERROR, "401": _ERROR, "408": _ERROR, "413": _ERROR, "429": _ERROR,
                      "503": _ERROR}}}


def _get(summary: str) -> dict:
    return {"get": {"summary": summary, "responses": {"200": {"description": "ok"}, "503": _ERROR}}}


def document() -> dict:
    generate = {"type": "object", "additionalProperties": False, "properties": {
        "prompt": {"type": "string", "minLength": 1},
        "prompt_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}}, **_SAMPLING}}
    completion = {"type": "object", "required": ["prompt"], "properties": {
        "model": {"type": "string"}, "prompt": {"type": "string", "minLength": 1},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 20}, **_SAMPLING}}
    tool = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}, "description": {"type": "string"},
            "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}}}
    call = {"type": "object", "required": ["id", "type", "function"], "properties": {
        "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name", "arguments"], "properties": {
            "name": {"type": "string"}, "arguments": {"type": "string"}}}}}
    chat = {"type": "object", "required": ["messages"], "properties": {
        "model": {"type": "string"}, "max_completion_tokens": {"type": "integer", "minimum": 1},
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"], "properties": {
                "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
                "content": {"type": "string", "nullable": True}, "tool_calls": {"type": "array", "items": call},
                "tool_call_id": {"type": "string"}, "reasoning_content": {"type": "string"}}}},
        "tools": {"type": "array", "items": tool},
        "tool_choice": {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {
            "type": "object", "required": ["type", "function"], "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]},
        "parallel_tool_calls": {"type": "boolean"}, "chat_template_kwargs": {"type": "object"},
        "reasoning_effort": {"type": "string", "enum": ["none", "minimal", "low", "medium", "high"]},
        "logprobs": {"type": "boolean"}, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        **_SAMPLING}}
    park = {"type": "object", "properties": {"mode": {"type": "string", "enum": ["wait", "abort"]},
                                             "level": {"type": "string", "enum": ["release", "offload"]}}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "qwen4exp", "version": "0.1.0",
                 "description": "Serve Qwen3.8-Flash-Next (qwen4_exp): native, OpenAI-compatible and admin API."},
        "paths": {
            "/generate": _post("Generate from text or token ids", generate),
            "/v1/completions": _post("OpenAI-compatible completion", completion),
            "/v1/chat/completions": _post("OpenAI-compatible chat completion", chat),
            "/v1/models": _get("The served model"),
            "/park": _post("Free the GPU, keep the fitted context and the prefix snapshots", park, admin=True),
            "/unpark": _post("Serve again at the same context", {"type": "object"}, admin=True),
            "/props": _get("Model, fitted context, slots, chunk, snapshots, park state"),
            "/health": _get("loading | ready | parked | error (200 only when ready)"),
            "/metrics": _get("Prometheus metrics"),
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "admin": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Error": {"type": "object", "properties": {"error": {"type": "object", "properties": {
                "message": {"type": "string"}, "type": {"type": "string"}, "code": {"type": "integer"}}}}}},
        },
    }


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(document())
