"""What docs/API.md and docs/CONFIG.md promise, each over HTTP against a real server and worker (or the real
`qwen4exp serve` process): stop strings and the default end-of-text stop, usage in streams, streamed completions,
max_completion_tokens, park in wait mode, the admin key's fallback, wake_on_request, park_after_idle, /health after
a worker death, a fitted context kept across a restart, resident_limit = "auto", READY and WATCHDOG from serve,
and the capacity a fit reads when no limit is set."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from datagrams import until_quiet
from live_server import ADMIN_KEY, API_KEY, Server

MiB = 1 << 20


def _sse(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    s = Server(tiny_checkpoint)
    yield s
    s.close()


GREEDY = {"prompt": "The mill by the river", "max_tokens": 24, "ignore_eos": True}


def test_a_stop_string_ends_the_text_before_it(server):
    status, full, _ = server.request("POST", "/generate", GREEDY)
    assert status == 200 and full["finish_reason"] == "length"
    text = full["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]            # three characters from the middle of the answer
    assert stop.strip(), text
    status, cut, _ = server.request("POST", "/generate", GREEDY | {"stop": [stop]})
    assert cut["finish_reason"] == "stop" and cut["text"] == text[:text.index(stop)], (stop, text, cut["text"])
    status, completion, _ = server.request("POST", "/v1/completions", {"prompt": GREEDY["prompt"], "max_tokens": 24,
                                                                "ignore_eos": True, "stop": stop})
    choice = completion["choices"][0]
    assert choice["text"] == text[:text.index(stop)] and choice["finish_reason"] == "stop"


def test_stop_token_ids_end_the_answer_at_the_first_listed_id_and_ids_past_the_vocabulary_get_a_400(server):
    status, full, _ = server.request("POST", "/generate", GREEDY)
    ids = full["token_ids"]
    stop_at = ids[len(ids) // 2]
    absent = [t for t in range(512) if t not in ids]           # ids the answer never takes, listed many times over
    status, cut, _ = server.request("POST", "/generate", GREEDY | {"stop_token_ids": absent * 100 + [stop_at]})
    assert status == 200 and cut["finish_reason"] == "stop", cut
    assert cut["token_ids"] == ids[:ids.index(stop_at) + 1], (stop_at, ids, cut["token_ids"])
    status, answer, _ = server.request("POST", "/generate", GREEDY | {"stop_token_ids": [stop_at, 1 << 30]})
    assert status == 400 and answer["error"]["param"] == "stop_token_ids", answer
    assert "'stop_token_ids' has ids outside [0, " in answer["error"]["message"] and "[1073741824]" in \
        answer["error"]["message"], answer


def test_stream_options_include_usage_sends_a_last_usage_chunk(server):
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "ignore_eos": True}
    status, plain, _ = server.request("POST", "/v1/chat/completions", body)
    status, text, _ = server.request("POST", "/v1/chat/completions",
                                     body | {"stream": True, "stream_options": {"include_usage": True}})
    events = _sse(text)
    assert events[-1]["choices"] == [] and events[-1]["usage"] == plain["usage"]
    assert all("usage" not in e for e in events[:-1])
    status, text, _ = server.request("POST", "/v1/chat/completions", body | {"stream": True})
    assert all("usage" not in e for e in _sse(text))


def test_streamed_completions_give_the_text_of_the_json_answer(server):
    body = {"prompt": "Once upon", "max_tokens": 8, "temperature": 0.8, "seed": 7, "ignore_eos": True}
    status, plain, _ = server.request("POST", "/v1/completions", body)
    status, text, response = server.request("POST", "/v1/completions", body | {"stream": True})
    assert response.getheader("Content-Type").startswith("text/event-stream") and text.endswith("data: [DONE]\n\n")
    events = _sse(text)
    assert all(e["object"] == "text_completion" for e in events)
    assert "".join(e["choices"][0]["text"] for e in events) == plain["choices"][0]["text"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_max_completion_tokens_wins_over_max_tokens(server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True, "max_tokens": 9,
            "max_completion_tokens": 3}
    status, answer, _ = server.request("POST", "/v1/chat/completions", body)
    assert status == 200 and answer["usage"]["completion_tokens"] == 3
    status, answer, _ = server.request("POST", "/v1/chat/completions", body | {"max_completion_tokens": 0})
    assert status == 400 and answer["error"]["param"] == "max_completion_tokens"


def test_park_in_wait_mode_lets_the_running_request_finish(server):
    results = {}
    thread = threading.Thread(target=lambda: results.update(r=server.request(
        "POST", "/generate", {"prompt_ids": [9] * 20, "max_tokens": 60, "ignore_eos": True})))
    thread.start()
    _wait(lambda: server.supervisor.in_flight == 1, 10, "the request runs")
    status, parked, _ = server.request("POST", "/park", {"mode": "wait"}, key=ADMIN_KEY)
    thread.join(30)
    assert status == 200 and parked["mode"] == "wait" and parked["context"] == 512
    assert isinstance(parked["bytes_freed"], int) and parked["bytes_freed"] >= 0      # 0 on the CPU: no GPU
    status, body, _ = results["r"]
    assert status == 200 and len(body["token_ids"]) == 60                                # not cut short
    assert server.request("POST", "/unpark", {}, key=ADMIN_KEY)[0] == 200


def test_health_says_error_after_a_worker_death_until_the_new_worker_serves(server):
    server.supervisor.kill_worker()
    seen = []

    def errored():
        status, body, _ = server.request("GET", "/health", key=None)
        seen.append((status, body))
        return body["status"] == "error"
    _wait(errored, 5, "/health reports the death")
    status, body = seen[-1]
    assert status == 503 and "worker exited unexpectedly" in body["error"]
    server.wait_state("ready", timeout=90)
    status, body, _ = server.request("GET", "/health", key=None)
    assert status == 200 and "error" not in body and body["restarts"] >= 1


@pytest.fixture(scope="module")
def lone_key(tiny_checkpoint):
    """An API key and no admin key; parks itself after 1 s idle and wakes on a request."""
    s = Server(tiny_checkpoint, admin_key=None, wake_on_request=True, park_after_idle=1.0)
    yield s
    s.close()


def test_without_an_admin_key_the_api_key_guards_the_admin_endpoints(lone_key):
    assert lone_key.request("POST", "/unpark", {}, key=None)[0] == 401
    assert lone_key.request("POST", "/unpark", {}, key="wrong")[0] == 401
    assert lone_key.request("POST", "/unpark", {}, key=API_KEY)[0] == 200


def test_park_after_idle_parks_and_a_request_wakes_it(lone_key):
    lone_key.wait_state("parked", timeout=10)                       # 1 s without requests
    status, health, _ = lone_key.request("GET", "/health", key=None)
    assert status == 503 and health["status"] == "parked"
    status, body, _ = lone_key.request("POST", "/generate", {"prompt": "awake", "max_tokens": 2})
    assert status == 200 and len(body["token_ids"]) >= 1
    assert lone_key.supervisor.state in ("ready", "parked")        # it may have parked again since


@pytest.fixture(scope="module")
def fitted(tiny_checkpoint):
    s = Server(tiny_checkpoint, engine={"max_ctx": "auto", "device_memory_limit": 256 * MiB,
                                        "prefix_cache_limit": "auto"})
    yield s
    s.close()


def test_auto_context_is_fitted_in_the_worker_and_kept_across_a_restart(fitted):
    props = fitted.request("GET", "/props")[1]
    assert props["context_source"] == 'fitted (max_ctx = "auto")' and props["context_fitted_now"] is True
    plan = props["plan"]
    assert props["context"] == plan["context"] and props["context"] % 4096 == 0
    assert plan["devices"][0]["capacity"] == 256 * MiB
    fitted.supervisor.kill_worker()
    _wait(lambda: fitted.supervisor.restarts >= 1 and fitted.supervisor.state == "ready", 90, "restarted")
    again = fitted.request("GET", "/props")[1]
    assert again["context"] == props["context"] and again["context_fitted_now"] is False   # no new fit
    assert again["plan"] == plan


def test_resident_limit_auto_is_a_quarter_of_the_available_memory(fitted):
    limit = fitted.request("GET", "/props")[1]["prefix_cache"]["resident_limit"]
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    quarter = int(meminfo["MemAvailable"].split()[0]) * 1024 // 4
    # Read at the worker's start; MemAvailable moves meanwhile, as the suite's servers and workers come and go.
    assert abs(limit - quarter) < 0.3 * quarter, (limit, quarter)


def test_the_default_stop_is_the_checkpoints_end_of_text(tiny_checkpoint, tmp_path):
    """A copy of the checkpoint whose generation_config names, as its end of text, the third token the model
    writes greedily: without ignore_eos the answer stops there, with the token not in the text."""
    probe = Server(tiny_checkpoint)
    try:
        ids = probe.request("POST", "/generate", GREEDY)[1]["token_ids"]
    finally:
        probe.close()
    end = ids[2]
    assert end not in ids[:2]
    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, copy)
    config = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps(config | {"eos_token_id": [end]}))
    s = Server(copy)
    try:
        body = {k: v for k, v in GREEDY.items() if k != "ignore_eos"}
        status, answer, _ = s.request("POST", "/generate", body)
        assert answer["finish_reason"] == "stop" and answer["token_ids"] == ids[:3]
        status, answer, _ = s.request("POST", "/generate", GREEDY)
        assert answer["finish_reason"] == "length" and answer["token_ids"] == ids
    finally:
        s.close()


def test_serve_from_a_profile_notifies_systemd_and_stops_on_sigterm(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    profile = tmp_path / "box.toml"
    profile.write_text(f'model = "tiny"\nslots = 1\nmax_ctx = 1024\nchunk = 64\n[server]\nport = {port}\n'
                       f'api_key = "{API_KEY}"\n')
    notify = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(str(notify))
        systemd.settimeout(120)
        env = os.environ | {"NOTIFY_SOCKET": str(notify), "WATCHDOG_USEC": "1000000"}
        env.pop("WATCHDOG_PID", None)
        process = subprocess.Popen([sys.executable, "-m", "qwen4exp", "serve", "--profile", str(profile)], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            messages = []
            while not any(m.startswith(b"READY=1") for m in messages):
                messages.append(systemd.recv(4096))
            assert f"serving on 127.0.0.1:{port}, context 1024".encode() in messages[-1]
            watchdog = systemd.recv(4096)                   # pinged every half of WATCHDOG_USEC
            assert watchdog.startswith(b"WATCHDOG=1")
            import http.client
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", "/generate", body=json.dumps({"prompt": "In", "max_tokens": 2}),
                         headers={"Authorization": f"Bearer {API_KEY}"})
            assert conn.getresponse().status == 200
            conn.close()
            process.send_signal(signal.SIGTERM)
            assert process.wait(60) == 0
            rest = until_quiet(systemd, 1)
            assert any(m.startswith(b"STOPPING=1") for m in rest), rest
        finally:
            if process.poll() is None:
                process.kill()
            process.wait()


def test_a_fit_without_a_limit_reads_mem_available_or_the_cgroups_room(tmp_path, monkeypatch):
    import torch

    from qwen4exp.engine import fit_measure

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    assert fit_measure._meminfo_available(meminfo) == 20000000 * 1024
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert fit_measure._cgroup_room(cgroup) is None                       # no cgroup files: no limit
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("1000\n")
    assert fit_measure._cgroup_room(cgroup) is None                       # "max": no limit
    (cgroup / "memory.max").write_text(f"{8 << 30}\n")
    (cgroup / "memory.current").write_text(f"{1 << 30}\n")
    assert fit_measure._cgroup_room(cgroup) == 7 << 30
    monkeypatch.setattr(fit_measure, "_meminfo_available", lambda: 20 << 30)
    monkeypatch.setattr(fit_measure, "_cgroup_room", lambda: 7 << 30)           # the smaller one wins
    cpu = torch.device("cpu")
    assert fit_measure.usable_capacity(cpu, 5) == ((7 << 30) + 5, "cgroup memory.max - memory.current + weights")
    monkeypatch.setattr(fit_measure, "_cgroup_room", lambda: None)
    assert fit_measure.usable_capacity(cpu, 5) == ((20 << 30) + 5, "MemAvailable + weights")
