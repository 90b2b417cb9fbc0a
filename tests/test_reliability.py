"""The daemon under hostile clients and faults (issue 16): clients that leave, requests that run too long, a worker
that dies while parked, large bodies, bodies that used to make 500s, connections that never finish their headers.
A real server on loopback with the tiny model in a real worker process."""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time

import pytest

from live_server import ADMIN_KEY, API_KEY, Server

CONTEXT = 4096            # room for LONG to outlast the 2 s request timeout on any CPU


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    s = Server(tiny_checkpoint, context=CONTEXT, request_timeout=2.0, header_timeout=1.0, body_timeout=1.0,
               max_body_bytes=8 << 20, max_connections=40)
    yield s
    s.close()


def _raw_post(server, path: str, body: dict, key: str = API_KEY) -> socket.socket:
    """A POST sent on a plain socket, so the test can drop the connection whenever it likes."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer {key}"
                 f"\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _wait(condition, timeout: float, what: str) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)
    return time.monotonic() - started


def _stats(server) -> dict:
    return server.request("GET", "/props")[1]


def _sse(text: str) -> list:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


LONG = {"prompt_ids": [7] * 20, "max_tokens": 4000, "ignore_eos": True}


def test_a_json_client_that_leaves_frees_its_slot_within_a_step(server):
    sock = _raw_post(server, "/generate", LONG)
    _wait(lambda: _stats(server)["busy_slots"] == 1, 10, "the request took a slot")
    sock.close()
    # 480 tokens would take seconds; the cancel lands at the next engine step.
    _wait(lambda: server.supervisor.in_flight == 0 and _stats(server)["busy_slots"] == 0, 5.0, "the slot is free")


def test_a_stream_dropped_while_queued_leaves_the_queue(server):
    holders = [_raw_post(server, "/generate", LONG) for _ in range(2)]          # both slots busy
    _wait(lambda: _stats(server)["busy_slots"] == 2, 10, "both slots busy")
    queued = _raw_post(server, "/generate", LONG | {"stream": True})
    _wait(lambda: _stats(server)["queued"] == 1, 5, "the stream is queued")
    queued.close()
    _wait(lambda: _stats(server)["queued"] == 0, 5.0, "the dropped stream left the queue")
    assert _stats(server)["busy_slots"] == 2                                     # the others run on
    for sock in holders:
        sock.close()
    _wait(lambda: server.supervisor.in_flight == 0, 2, "all cancelled")


def test_request_timeout_answers_408_with_what_was_generated_and_frees_the_slot(server):
    started = time.monotonic()
    status, body, response = server.request("POST", "/generate", LONG)
    assert 2.0 <= time.monotonic() - started < 4.0
    assert status == 408 and response.getheader("x-should-retry") == "false", body
    error = body["error"]
    assert error["type"] == "timeout_error" and error["code"] == 408 and "server.request_timeout" in error["message"]
    partial = error["partial"]
    assert 0 < partial["completion_tokens"] == len(partial["token_ids"]) < 480
    assert f"{partial['completion_tokens']} tokens were generated" in error["message"]
    _wait(lambda: server.supervisor.in_flight == 0 and _stats(server)["busy_slots"] == 0, 5.0, "slot freed")


def test_a_request_that_never_gets_a_token_times_out_and_is_cancelled():
    """The deadline counts from submission: a request still queued when it passes is cancelled in the engine."""
    import asyncio

    from qwen4exp.server.errors import ApiError
    from qwen4exp.server.runner import collect
    from qwen4exp.server.supervisor import Stream

    class Queued:                     # a supervisor whose engine never starts the request
        cancelled = []

        def submit(self, fields):
            return Stream("r1")

        def cancel(self, stream):
            self.cancelled.append(stream.id)

    supervisor = Queued()
    with pytest.raises(ApiError) as caught:          # (the outer 5 s: a deadline that never fires fails, not hangs)
        asyncio.run(asyncio.wait_for(collect(supervisor, {}, timeout=0.2), 5))
    assert caught.value.status == 408 and "waiting for its first token" in caught.value.message
    assert caught.value.extra["partial"]["completion_tokens"] == 0 and supervisor.cancelled == ["r1"]


def test_streams_past_the_timeout_end_with_an_error_event_and_a_known_finish_reason(server):
    status, text, _ = server.request("POST", "/v1/completions", {"prompt": "In", "max_tokens": 480,
                                                                 "ignore_eos": True, "stream": True})
    events = _sse(text)
    assert status == 200 and events[-1] == "[DONE]"
    error, last = json.loads(events[-3]), json.loads(events[-2])
    assert error["error"]["type"] == "timeout_error" and error["error"]["code"] == 408
    assert last["choices"][0]["finish_reason"] == "length"           # a reason OpenAI clients parse
    status, text, _ = server.request("POST", "/generate", LONG | {"stream": True})
    last = json.loads(_sse(text)[-1])
    assert last["finish_reason"] == "error" and last["error"]["type"] == "timeout_error"
    assert last["text"] == "".join(json.loads(e)["text"] for e in _sse(text)[:-1])


def test_openai_client_raises_on_a_stream_the_server_gave_up_on(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.APIError, match="timed out"):
        for _ in client.completions.create(model="tiny", prompt="In", max_tokens=480, stream=True,
                                           extra_body={"ignore_eos": True}):
            pass
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model="tiny", prompt="In", max_tokens=480, extra_body={"ignore_eos": True})
    assert caught.value.status_code == 408


def test_a_park_in_abort_mode_is_a_503_for_json_and_an_error_event_for_streams(server):
    results = {}

    def send(name, body, path="/generate"):
        results[name] = server.request("POST", path, body)
    threads = [threading.Thread(target=send, args=("json", LONG)),
               threading.Thread(target=send, args=("stream", {"prompt": "In", "max_tokens": 480, "stream": True,
                                                             "ignore_eos": True}, "/v1/completions"))]
    for t in threads:
        t.start()
    _wait(lambda: server.supervisor.in_flight == 2 and _stats(server)["busy_slots"] == 2, 10, "both running")
    time.sleep(0.2)
    try:
        assert server.request("POST", "/park", {"mode": "abort"}, key=ADMIN_KEY)[0] == 200
        for t in threads:
            t.join(10)
    finally:
        assert server.request("POST", "/unpark", {}, key=ADMIN_KEY)[0] == 200
    status, body, response = results["json"]
    assert status == 503 and response.getheader("Retry-After") and body["error"]["type"] == "server_error"
    events = _sse(results["stream"][1])
    assert json.loads(events[-3])["error"]["code"] == 503 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


def test_a_worker_that_dies_while_parked_stays_parked_until_unpark(server):
    assert server.request("POST", "/park", {}, key=ADMIN_KEY)[0] == 200
    try:
        _killed_while_parked(server)
    finally:
        server.request("POST", "/unpark", {}, key=ADMIN_KEY)


def _killed_while_parked(server):
    server.supervisor.kill_worker()
    time.sleep(2.5)                                  # past the restart delay: nothing may take the GPU back
    status, health, _ = server.request("GET", "/health", key=None)
    assert status == 503 and health["status"] == "parked"
    assert server.request("POST", "/generate", {"prompt": "a", "max_tokens": 2})[0] == 503
    status, body, _ = server.request("POST", "/unpark", {}, key=ADMIN_KEY)
    assert status == 200 and body["context"] == CONTEXT, body
    assert server.request("POST", "/generate", {"prompt": "back", "max_tokens": 2})[0] == 200


def test_health_answers_while_large_bodies_are_prepared(server):
    """A 7.8 MB prompt and a 100k-message chat are parsed, rendered and tokenized off the event loop."""
    bodies = [("/generate", {"prompt": "In the beginning God created " * 270000, "max_tokens": 1}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 100000,
                                        "max_tokens": 1})] * 2
    results = []
    threads = [threading.Thread(target=lambda p=p, b=b: results.append(server.request("POST", p, b)))
               for p, b in bodies]
    for t in threads:
        t.start()
    slowest = 0.0
    while any(t.is_alive() for t in threads):
        started = time.monotonic()
        assert server.request("GET", "/health", key=None)[0] == 200
        slowest = max(slowest, time.monotonic() - started)
        time.sleep(0.02)
    refusals = sorted(r[1]["error"]["message"].split(":")[0] if r[0] == 400 else str(r[0]) for r in results)
    assert refusals == ["'prompt' has 7830000 characters"] * 2 + ["prompt of 800005 tokens + max_tokens 1 = 800006 "
                        "exceeds the context of 4096 tokens"] * 2, refusals     # the text refused by its length
    assert slowest < 1.0, f"/health took {slowest:.2f} s while bodies were prepared"


_ASKED = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
_CALLED = {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                               "function": {"name": "f", "arguments": "{}"}}]}


def _called(**function) -> dict:
    """An assistant turn that called f, its function fields replaced by `function`."""
    call = _CALLED["tool_calls"][0]
    return _CALLED | {"tool_calls": [call | {"function": call["function"] | function}]}


def _tool(**function) -> dict:
    return {"type": "function", "function": {"name": "f"} | function}


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "stream_options": "yes"},
     "stream_options", "'stream_options' must be an object"),
    ("/generate", {"prompt": "a\ud800b"}, "prompt", "lone surrogate (U+D800) at character 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x\udfff"}]}, "messages",
     "'messages[0].content' has a lone surrogate"),
    ("/generate", {"prompt": "a", "stop": ["\ud800"]}, "stop", "lone surrogate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs",
     "'top_logprobs' needs 'logprobs': true"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "a"}]}, "messages",
     "messages[0].role must be one of"),
    ("/v1/chat/completions", {"messages": [{"role": ["user"], "content": "a"}]}, "messages",
     "messages[0].role must be one of"),
    # What the chat template renders: a call's arguments (a string or an object), a tool's schema, template
    # variables. Too deep for the renderer, past the integers Python reads, or not valid Unicode.
    ("/v1/chat/completions", {"messages": [_called(arguments='{"a":' * 3000 + "1" + "}" * 3000)]},
     "messages", "messages[0].tool_calls[0].function.arguments is nested too deeply to read"),
    ("/v1/chat/completions", {"messages": [_called(arguments='{"a": ' + "9" * 5000 + "}")]}, "messages",
     "messages[0].tool_calls[0].function.arguments has a number that cannot be read"),
    ("/v1/chat/completions", {"messages": [_called(arguments={"x": "\ud800"})]}, "messages",
     "'messages[0].tool_calls[0].function.arguments.x' has a lone surrogate"),
    ("/v1/chat/completions", {"messages": [_called(name="f\udc00")]}, "messages",
     "'messages[0].tool_calls[0].function.name' has a lone surrogate"),
    ("/v1/chat/completions", _ASKED | {"tools": [_tool(description="\ud800")]}, "tools",
     "'tools[0].function.description' has a lone surrogate"),
    ("/v1/chat/completions", _ASKED | {"tools": [_tool(parameters={"properties": {"\udc00": {}}})]}, "tools",
     "'tools[0].function.parameters.properties (a key)' has a lone surrogate"),
    ("/v1/chat/completions", _ASKED | {"tools": [_tool(parameters=_nested(900))]}, "tools",
     "is nested more than 64 levels deep"),
    ("/v1/chat/completions", _ASKED | {"chat_template_kwargs": {"x": _nested(900)}}, "chat_template_kwargs",
     "is nested more than 64 levels deep"),
    ("/v1/chat/completions", _ASKED | {"chat_template_kwargs": {"self": 1}}, "chat_template_kwargs",
     "key 'self' is not a template variable's name"),
    # An integer past float's range, in a float field; and a sampling field's error names its field.
    ("/generate", {"prompt": "a", "temperature": 10 ** 400}, "temperature", "got an integer of 1329 bits"),
    ("/v1/completions", {"prompt": "a", "top_p": 2}, "top_p", "top_p must be a number in (0, 1], got 2.0"),
    ("/generate", {"prompt": "a", "stop": ["x" * 300]}, "stop", "'stop[0]' has 300 characters; at most 256"),
    ("/v1/chat/completions", _ASKED | {"n": True}, "n", "only n = 1 is supported"),
    ("/park", {"level": {}}, "level", "'level' must be \"release\" or \"offload\", got {}"),
    ("/park", {"mdoe": "abort"}, "mdoe", "unknown field(s) for /park: mdoe"),
])
def test_bodies_that_made_500s_get_400s_naming_the_field(server, path, body, param, message):
    raw = json.dumps(body).encode()          # json.dumps writes lone surrogates as \ud800 escapes
    status, answer, _ = server.request("POST", path, raw=raw, key=ADMIN_KEY if path == "/park" else API_KEY)
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"
    assert message in answer["error"]["message"], answer
    assert server.supervisor.state == "ready"


def test_null_is_the_default_for_every_optional_field(server):
    """OpenAI's schema makes its optional fields nullable; clients send null for what they leave unset."""
    plain = server.request("POST", "/v1/chat/completions", _ASKED)
    nulls = {"n": None, "stream": None, "ignore_eos": None, "parallel_tool_calls": None,
             "temperature": None, "stop": None, "chat_template_kwargs": None}
    nulled = server.request("POST", "/v1/chat/completions", _ASKED | nulls)
    assert plain[0] == nulled[0] == 200, nulled[1]
    assert nulled[1]["choices"][0]["message"] == plain[1]["choices"][0]["message"]


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_body_not_in_its_content_encoding_gets_a_400(server, encoding):
    status, answer, _ = server.request("POST", "/generate", {"prompt": "a", "max_tokens": 1},
                                       headers={"Content-Encoding": encoding})
    assert status == 400 and answer["error"]["message"] == \
        f"the request body could not be read: Can not decode content-encoding: {encoding}", answer
    assert server.request("POST", "/generate", {"prompt": "a", "max_tokens": 1})[0] == 200


@pytest.mark.parametrize("encoding", ["x-bogus", "gzip, gzip"])
def test_a_content_encoding_the_server_does_not_read_gets_a_415_naming_it(server, encoding):
    status, answer, _ = server.request("POST", "/generate", {"prompt": "a", "max_tokens": 1},
                                       headers={"Content-Encoding": encoding})
    assert status == 415 and answer["error"]["message"] == f"the request body's Content-Encoding {encoding!r} is " \
        "not one the server reads: gzip, deflate or none", answer
    assert server.request("POST", "/generate", {"prompt": "a", "max_tokens": 1})[0] == 200


@pytest.mark.parametrize("raw, message", [
    (b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", "nested too deeply"),
    (b'{"max_tokens": ' + b"9" * 50000 + b"}", "a number that cannot be read"),
])
def test_hostile_json_gets_a_400(server, raw, message):
    status, answer, _ = server.request("POST", "/generate", raw=raw)
    assert status == 400 and message in answer["error"]["message"], answer


def test_developer_and_tool_messages_are_served(server):
    messages = [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": "What is 6*7?"},
                {"role": "assistant", "content": None}, {"role": "tool", "content": "42", "tool_call_id": "c1"},
                {"role": "user", "content": [{"type": "text", "text": "So?"}]}]
    status, body, _ = server.request("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 3})
    assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop"), body


def test_authorization_scheme_is_case_insensitive_and_odd_headers_get_401(server):
    assert server.request("POST", "/generate", {"prompt": "a", "max_tokens": 1},
                          key=None, headers={"Authorization": f"bearer {API_KEY}"})[0] == 200
    status, body, _ = server.request("POST", "/generate", {"prompt": "a", "max_tokens": 1}, key=None,
                                     headers={"Authorization": "Bearer clé-été".encode().decode("latin-1")})
    assert status == 401 and body["error"]["type"] == "authentication_error"


def test_props_shows_the_model_path_to_the_admin_key_only(server):
    assert "model_path" not in server.request("GET", "/props", key=None)[1]
    assert "model_path" not in server.request("GET", "/props", key=API_KEY)[1]
    assert server.request("GET", "/props", key=ADMIN_KEY)[1]["model_path"].endswith("ckpt")


def test_connections_that_never_finish_their_headers_are_closed(server):
    slow = []
    for _ in range(20):
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")                # and never the rest
        slow.append(sock)
    assert server.request("POST", "/generate", {"prompt": "a", "max_tokens": 1})[0] == 200   # others are served
    for sock in slow:
        sock.settimeout(5)
        assert sock.recv(1024) == b""              # closed by the server after the 1 s header timeout
        sock.close()
    metrics = server.request("GET", "/metrics", key=None)[1]
    assert int(re.search(r"^qwen4exp_connections_closed_slow_total (\d+)", metrics, re.M).group(1)) >= 20


class _Transport:
    def __init__(self):
        self.closed = self.aborted = 0

    def close(self):              # a graceful close waits for the buffered answer to go out: it stays open
        self.closed += 1

    def abort(self):
        self.aborted += 1


class _Connection:
    def __init__(self):
        self.transport = _Transport()

    def force_close(self):
        pass


def test_a_client_that_reads_nothing_is_dropped_after_a_second_deadline_and_counted_once():
    """A streaming client that stops reading keeps its answer buffered, so a graceful close never completes: the
    guard drops the connection one header timeout after closing it, and counts it once, not at every sweep."""
    from qwen4exp.server.connections import ConnectionGuard

    guard, stuck = ConnectionGuard(header_timeout=0.05, max_connections=8), _Connection()
    for _ in range(3):
        guard.sweep([stuck])
        time.sleep(0.03)
    assert stuck.transport.closed == 1 and stuck.transport.aborted == 0 and guard.closed_slow == 1
    time.sleep(0.06)
    guard.sweep([stuck])
    assert stuck.transport.aborted == 1 and guard.closed_slow == 1
    guard.sweep([])                        # gone: forgotten
    assert not guard._closing and not guard._since


def test_a_body_that_never_arrives_gets_408(server):
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                 "Content-Length: 100\r\n\r\n{\"prompt\"".encode())
    sock.settimeout(5)
    answer = sock.recv(4096)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"server.body_timeout" in answer


def test_past_max_connections_new_ones_get_503_and_are_closed(server):
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(40)]
    _wait(lambda: len(server.runner.server.connections) >= 40, 5, "all 40 held connections accepted")
    extra = socket.create_connection(("127.0.0.1", server.port))
    extra.settimeout(5)
    answer = extra.recv(4096)
    assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer and b"too many open connections" in answer
    for sock in held + [extra]:
        sock.close()
    _wait(lambda: server.request("GET", "/health", key=None)[0] == 200, 5, "serving again")
    metrics = server.request("GET", "/metrics", key=None)[1]
    assert int(re.search(r"^qwen4exp_connections_refused_total (\d+)", metrics, re.M).group(1)) >= 1


def test_a_client_leaving_mid_stream_is_one_info_line(server, caplog):
    caplog.set_level(logging.INFO, logger="qwen4exp")
    sock = _raw_post(server, "/generate", LONG | {"stream": True})
    received = b""
    while received.count(b"data:") < 2:
        received += sock.recv(4096)
    sock.close()
    _wait(lambda: server.supervisor.in_flight == 0, 2, "cancelled")
    time.sleep(0.3)
    server_records = [r for r in caplog.records if r.name.startswith("qwen4exp.server") or r.name.startswith("aiohttp")]
    assert not [r for r in server_records if r.levelno >= logging.WARNING], \
        [(r.name, r.getMessage()) for r in server_records]


@pytest.mark.parametrize("raw", [
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 9000 + b"\r\nConnection: close\r\n\r\n",
    b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\nConnection: close\r\n\r\n{}",
    b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\nzz\r\n",
    (f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\nContent-Encoding: gzip\r\n"
     "Content-Length: 31\r\nConnection: close\r\n\r\n" + '{"prompt": "In", "max_tokens": 2}'[:31]).encode(),
], ids=["header-too-long", "bad-length", "bad-chunk", "not-gzip"])
def test_a_malformed_request_is_a_400_and_one_info_line_not_a_traceback(server, caplog, raw):
    caplog.set_level(logging.INFO)
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(raw)
    sock.settimeout(5)
    answer = sock.recv(4096)
    sock.close()
    assert answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n")[0], answer[:200]
    time.sleep(0.3)
    server_records = [r for r in caplog.records if r.name.startswith(("qwen4exp", "aiohttp"))]
    assert not [r for r in server_records if r.levelno >= logging.WARNING or r.exc_info], \
        [(r.name, r.levelname, r.getMessage()) for r in server_records]
    assert server.request("POST", "/generate", {"prompt": "a", "max_tokens": 1})[0] == 200


def test_a_client_leaving_mid_body_is_one_info_line(server, caplog):
    caplog.set_level(logging.INFO)
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                 "Content-Length: 1000\r\n\r\n{\"prompt\": \"a".encode())
    time.sleep(0.2)
    sock.close()
    _wait(lambda: any("went away" in r.getMessage() for r in caplog.records), 3, "the INFO line")
    time.sleep(0.3)
    server_records = [r for r in caplog.records if r.name.startswith("qwen4exp.server") or r.name.startswith("aiohttp")]
    assert not [r for r in server_records if r.levelno >= logging.WARNING], \
        [(r.name, r.getMessage()) for r in server_records]
    assert server.request("POST", "/generate", {"prompt": "a", "max_tokens": 1})[0] == 200
