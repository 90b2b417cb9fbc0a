"""The daemon's HTTP API against a real server on loopback, with the tiny model in a real worker process."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from live_server import ADMIN_KEY, API_KEY, Server

CONTEXT = 512


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    s = Server(tiny_checkpoint)
    yield s
    s.close()


def test_health_props_and_llama_server_fields(server):
    status, body, _ = server.request("GET", "/health", key=None)
    assert status == 200 and body["status"] == "ready"
    status, props, _ = server.request("GET", "/props", key=None)
    assert props["context"] == CONTEXT and props["total_slots"] == 2
    assert props["default_generation_settings"]["n_ctx"] == CONTEXT
    assert props["prefix_cache"]["tier"] == "host"
    assert props["decode_beside_prompts"] is False and props["batch_prompts"] is False      # the tiny profile's


def test_generate_json_and_usage(server):
    status, body, _ = server.request("POST", "/generate", {"prompt_ids": list(range(1, 80)), "max_tokens": 6,
                                                           "ignore_eos": True})
    assert status == 200, body
    assert len(body["token_ids"]) == 6 and body["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 79 and body["usage"]["completion_tokens"] == 6
    # The same prompt again restores its prefix from the snapshot cache and gives the same answer.
    status, again, _ = server.request("POST", "/generate", {"prompt_ids": list(range(1, 80)), "max_tokens": 6,
                                                            "ignore_eos": True})
    assert again["token_ids"] == body["token_ids"] and again["usage"]["cached_prompt_tokens"] == 64


def test_generate_streams_server_sent_events(server):
    status, text, response = server.request("POST", "/generate", {"prompt": "The mill", "max_tokens": 5,
                                                                  "stream": True, "ignore_eos": True})
    assert status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    tokens = [e["token"] for e in events if "token" in e]
    assert len(tokens) == 5 and events[-1]["finish_reason"] == "length"
    assert events[-1]["text"] == "".join(e["text"] for e in events if "token" in e)


def test_openai_client_completions_and_chat(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=API_KEY)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    completion = client.completions.create(model="tiny", prompt="Once upon", max_tokens=4, temperature=0)
    assert completion.choices[0].finish_reason in ("length", "stop") and completion.usage.completion_tokens <= 4
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=4, temperature=0.7, seed=1)
    assert chat.choices[0].message.role == "assistant" and chat.usage.prompt_tokens > 0
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0.7, seed=1,
        stream=True) if c.choices]
    assert "".join(pieces) == chat.choices[0].message.content      # seeded: streamed == not streamed
    with pytest.raises(openai.BadRequestError, match="only n = 1"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, n=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="wrong").models.list()


@pytest.mark.parametrize("raw, message", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
    (json.dumps({"prompt": 5}).encode(), "'prompt' must be a non-empty string"),
    (json.dumps({"prompt": "a", "max_tokens": "9"}).encode(), "'max_tokens' must be an integer"),
    (json.dumps({"prompt": "a", "temprature": 1}).encode(), "unknown field(s) for /generate: temprature"),
    (json.dumps({"prompt": "a", "top_p": 3}).encode(), "top_p"),
    (json.dumps({"prompt_ids": [1, 99999999]}).encode(), "outside [0,"),
    (json.dumps({"prompt_ids": [1] * 500, "max_tokens": 100}).encode(), "exceeds the context of 512 tokens"),
    # refused by its length in characters, before it is tokenized
    (json.dumps({"prompt": "a" * 200000}).encode(), "'prompt' has 200000 characters: at least"),
])
def test_bad_requests_get_clear_400s_and_the_server_keeps_serving(server, raw, message):
    status, body, _ = server.request("POST", "/generate", raw=raw)
    assert status == 400 and message in body["error"]["message"], body
    status, ok, _ = server.request("POST", "/generate", {"prompt": "still here", "max_tokens": 2})
    assert status == 200


def test_a_method_a_path_does_not_take_is_a_405_saying_which_it_takes(server):
    status, body, response = server.request("PUT", "/generate", {"prompt": "a"})
    assert status == 405 and "POST" in response.getheader("Allow"), (status, body)
    assert body["error"]["message"].startswith("PUT is not accepted on /generate; it takes ") and \
        "POST" in body["error"]["message"], body
    assert server.request("POST", "/generate", {"prompt": "still here", "max_tokens": 2})[0] == 200


def test_oversize_body_is_413(server):
    status, body, _ = server.request("POST", "/generate", raw=b'{"prompt": "' + b"a" * (2 << 20) + b'"}')
    assert status == 413 and "too large" in body["error"]["message"] and "1048576" in body["error"]["message"]


def test_keys_are_required(server):
    assert server.request("POST", "/generate", {"prompt": "a"}, key=None)[0] == 401
    assert server.request("POST", "/park", {}, key=API_KEY)[0] == 401          # the api key is not an admin key


def test_disconnect_mid_stream_cancels_the_request(server):
    sock = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps({"prompt_ids": [3] * 40, "max_tokens": 400, "stream": True, "ignore_eos": True}).encode()
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    received, deadline = b"", time.time() + 30
    while b"data:" not in received and time.time() < deadline:    # headers and the first event may arrive apart
        received += sock.recv(4096)
    assert b"data:" in received
    sock.close()
    deadline = time.time() + 30
    while time.time() < deadline and server.supervisor.in_flight:
        time.sleep(0.05)
    assert server.supervisor.in_flight == 0
    status, props, _ = server.request("GET", "/props")
    assert props["busy_slots"] == 0


def _long_request_in_background(server, token: int, max_tokens: int):
    """Start a long /generate on another thread; its (status, body, response) lands in results["r"]."""
    results = {}

    def send():
        results["r"] = server.request("POST", "/generate", {"prompt_ids": [token] * 30, "max_tokens": max_tokens,
                                                            "ignore_eos": True})
    thread = threading.Thread(target=send)
    thread.start()
    time.sleep(0.5)
    return thread, results


def test_park_during_generation_then_unpark(server):
    snapshot_prompt = list(range(1, 80))
    assert server.request("POST", "/generate", {"prompt_ids": snapshot_prompt, "max_tokens": 2})[0] == 200
    thread, results = _long_request_in_background(server, token=5, max_tokens=300)
    try:
        _park_then_unpark(server, thread, results, snapshot_prompt)
    finally:                                   # a failure here must not leave the module's server parked
        server.request("POST", "/unpark", {}, key=ADMIN_KEY)


def _park_then_unpark(server, thread, results, snapshot_prompt):
    status, parked, _ = server.request("POST", "/park", {"mode": "abort"}, key=ADMIN_KEY)
    assert status == 200 and parked["parked"] and parked["context"] == CONTEXT
    thread.join(30)
    status, body, response = results["r"]          # work the server gave up on: 503, send it again later
    assert status == 503 and response.getheader("Retry-After") and "cancelled" in body["error"]["message"], body
    assert body["error"]["type"] == "server_error" and body["error"]["code"] == 503
    assert server.request("GET", "/health", key=None)[0] == 503
    status, body, response = server.request("POST", "/generate", {"prompt": "a", "max_tokens": 2})
    assert status == 503 and response.getheader("Retry-After")
    assert server.request("POST", "/park", {}, key=ADMIN_KEY)[1]["already"]          # idempotent
    status, unparked, _ = server.request("POST", "/unpark", {}, key=ADMIN_KEY)
    assert status == 200 and unparked["context"] == CONTEXT
    # The prefix snapshots survived the park: 64 of the 79 tokens (two chunks of 32) come back.
    status, body, _ = server.request("POST", "/generate", {"prompt_ids": snapshot_prompt, "max_tokens": 2})
    assert status == 200 and body["usage"]["cached_prompt_tokens"] == 64


@pytest.mark.parametrize("level, weights_from", [("offload", "host memory"), ("release", "checkpoint")])
def test_a_park_that_keeps_the_weights_in_host_memory_unparks_without_the_checkpoint(server, level, weights_from):
    """Level "offload" keeps the weights in (pinned) host memory and unpark takes them from there, not from the
    checkpoint; "release" reads the checkpoint again. Either way the answers after are those before."""
    ask = {"prompt_ids": list(range(3, 40)), "max_tokens": 6, "ignore_eos": True}
    before = server.request("POST", "/generate", ask)[1]["token_ids"]
    try:
        status, parked, _ = server.request("POST", "/park", {"level": level}, key=ADMIN_KEY)
        assert status == 200 and parked["level"] == level and parked["context"] == CONTEXT
        assert parked["device_bytes_in_use"] is None and parked["host_bytes_kept"] == 0     # the CPU: nothing moved
    finally:
        status, unparked, _ = server.request("POST", "/unpark", {}, key=ADMIN_KEY)
    assert status == 200 and unparked["weights_from"] == weights_from
    assert server.request("POST", "/generate", ask)[1]["token_ids"] == before
    status, body, _ = server.request("POST", "/park", {"level": "evict"}, key=ADMIN_KEY)
    assert status == 400 and body["error"]["param"] == "level" and "'level' must be" in body["error"]["message"]


def test_killed_worker_fails_in_flight_and_comes_back(server):
    thread, results = _long_request_in_background(server, token=6, max_tokens=400)
    server.supervisor.kill_worker()
    thread.join(30)
    status, body, response = results["r"]
    assert status == 503 and response.getheader("Retry-After") and "worker exited" in body["error"]["message"]
    server.wait_state("ready", timeout=90)
    assert server.supervisor.restarts >= 1 and server.supervisor.fitted_context == CONTEXT
    assert server.request("POST", "/generate", {"prompt": "back", "max_tokens": 2})[0] == 200


def test_metrics_and_openapi(server):
    status, text, _ = server.request("GET", "/metrics", key=None)
    assert status == 200 and "qwen4exp_up 1" in text and "qwen4exp_prefix_cache_hits_total" in text
    generated = [line for line in text.splitlines() if line.startswith("qwen4exp_generated_tokens_total ")]
    assert generated and int(generated[0].split()[1]) > 0
    assert "qwen4exp_worker_resident_bytes" in text
    status, doc, _ = server.request("GET", "/openapi.json", key=None)
    assert doc["openapi"].startswith("3.") and "/v1/chat/completions" in doc["paths"]


def test_past_the_queue_bound_requests_get_429_with_retry_after(server):
    """2 slots + a queue of 4: of 9 long requests sent at once, those past the bound get 429 (how many depends on
    when the engine admits the first ones into slots)."""
    results = []

    def send():
        results.append(server.request("POST", "/generate", {"prompt_ids": [8] * 20, "max_tokens": 60,
                                                            "ignore_eos": True}))
    threads = [threading.Thread(target=send) for _ in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    statuses = sorted(r[0] for r in results)
    assert len(statuses) == 9 and statuses.count(200) >= 4 and 429 in statuses and set(statuses) <= {200, 429}, statuses
    refused = next(r for r in results if r[0] == 429)
    assert refused[2].getheader("Retry-After") and "queue is full" in refused[1]["error"]["message"]


def test_concurrent_stats_calls_all_get_answers(server):
    """/props and /metrics ask the worker for stats; many at once must each get their own answer."""
    results = []
    threads = [threading.Thread(target=lambda: results.append(server.request("GET", "/metrics", key=None)[0]))
               for _ in range(6)]
    started = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [200] * 6 and time.time() - started < 8      # no caller waits out the 10 s timeout


def test_a_drafting_server_answers_the_same_and_reports_its_drafts(tiny_checkpoint, server):
    """mtp = 2 in the profile: /generate and the OpenAI usage report the drafts, /props and /metrics count them,
    and the answer is the plain server's."""
    drafting = Server(tiny_checkpoint, engine={"mtp": 2})
    try:
        ask = {"prompt_ids": list(range(3, 60)), "max_tokens": 12, "ignore_eos": True}
        status, body, _ = drafting.request("POST", "/generate", ask)
        assert status == 200, body
        _, plain, _ = server.request("POST", "/generate", ask)
        assert body["token_ids"] == plain["token_ids"]
        mtp = body["usage"]["mtp"]
        assert mtp["drafted"] > 0 and 0 <= mtp["accepted"] <= mtp["drafted"] and plain["usage"]["mtp"]["drafted"] == 0
        status, completion, _ = drafting.request("POST", "/v1/completions", {"model": "tiny", "prompt": "The mill",
                                                                            "max_tokens": 5, "temperature": 0})
        assert status == 200 and completion["usage"]["mtp"]["drafted"] > 0
        _, props, _ = drafting.request("GET", "/props", key=None)
        assert props["mtp"] == {"profile": 2, "drafts": 2}
        _, text, _ = drafting.request("GET", "/metrics", key=None)
        drafted = [line for line in text.splitlines() if line.startswith("qwen4exp_mtp_drafted_tokens_total ")]
        assert drafted and int(drafted[0].split()[1]) >= mtp["drafted"]
        assert 'qwen4exp_mtp_accepted_at_total{position="2"}' in text
    finally:
        drafting.close()


@pytest.mark.parametrize("form", ["fp8", "gguf"])
def test_a_quantized_checkpoint_serves_through_the_daemon_as_generate_answers(tmp_path, form):
    """What an operator points a profile at, Qwen's FP8 layout or a UD-Q4_K_XL GGUF (its tokenizer inside the
    file), served by the daemon's worker process: /generate gives the tokens `generate` gives on the same file, and
    a chat turn is answered."""
    from qwen4exp.cli import main
    from qwen4exp.engine.generate import generate
    from qwen4exp.engine.loading import load_model

    path = tmp_path / ("tiny.gguf" if form == "gguf" else "tiny-fp8")
    quant = ["--quant", "ud-q4_k_xl"] if form == "gguf" else ["--dtype", "float32"]
    assert main(["init-checkpoint", "--preset", "tiny", "--format", form, *quant, "--seed", "2", "--out",
                 str(path)]) == 0
    prompt = [(11 * i) % 900 + 3 for i in range(45)]
    want = generate(load_model(str(path), dtype="float32", device="cpu", progress=False), prompt, 10).output_ids
    served = Server(path)
    try:
        status, body, _ = served.request("POST", "/generate", {"prompt_ids": prompt, "max_tokens": 10,
                                                               "ignore_eos": True})
        assert status == 200 and body["token_ids"] == want, body
        status, chat, _ = served.request("POST", "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0})
        assert status == 200 and chat["usage"]["completion_tokens"] > 0, chat
    finally:
        served.close()
