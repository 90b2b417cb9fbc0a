"""GET /metrics: vLLM's metrics under the `qwen4exp:` prefix (names, buckets, the model_name label, what each counts),
beside the daemon's own `qwen4exp_*` lines; one unit test of the rules, two against a live server (tiny model)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from live_server import Server
from qwen4exp.server.messages import Result
from qwen4exp.server.metrics import CONTENT_TYPE, RequestMetrics

MODEL = "tiny-metrics"
CONTEXT = 512

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), written out again here: they are facts to check against.
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0, 160.0, 640.0, 2560.0]
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
VLLM_REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0]
VLLM_TOKENS_512 = [1, 2, 5, 10, 20, 50, 100, 200, 500]          # build_1_2_5_buckets(max_model_len=512)
BUCKETS = {
    "time_to_first_token_seconds": VLLM_TTFT,
    "inter_token_latency_seconds": VLLM_ITL,
    "time_per_output_token_seconds": VLLM_ITL,
    "request_time_per_output_token_seconds": VLLM_ITL,
    "e2e_request_latency_seconds": VLLM_REQUEST_LATENCY,
    "request_queue_time_seconds": VLLM_REQUEST_LATENCY,
    "request_inference_time_seconds": VLLM_REQUEST_LATENCY,
    "request_prefill_time_seconds": VLLM_REQUEST_LATENCY,
    "request_decode_time_seconds": VLLM_REQUEST_LATENCY,
    "request_prompt_tokens": VLLM_TOKENS_512,
    "request_generation_tokens": VLLM_TOKENS_512,
    "request_max_num_generation_tokens": VLLM_TOKENS_512,
    "request_params_max_tokens": VLLM_TOKENS_512,
}

# The series vLLM's example Grafana dashboard (examples/observability/prometheus_grafana/grafana.json, before under
# examples/online_serving/) queries, each as `<series>{model_name="$model_name"}`; its older version queried
# time_per_output_token_seconds where it now queries inter_token_latency_seconds.
VLLM_DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:request_time_per_output_token_seconds_bucket", "vllm:request_time_per_output_token_seconds_sum",
    "vllm:request_time_per_output_token_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]

# What /metrics said before prometheus-client, still there (names; values stay integers: test_server reads them).
DAEMON_METRICS = {
    "qwen4exp_up", "qwen4exp_parked", "qwen4exp_engine_restarts_total", "qwen4exp_requests_in_flight",
    "qwen4exp_context_tokens", "qwen4exp_requests_total", "qwen4exp_generated_tokens_total",
    "qwen4exp_prompt_tokens_total", "qwen4exp_cached_prompt_tokens_total", "qwen4exp_connections_closed_slow_total",
    "qwen4exp_connections_refused_total", "qwen4exp_worker_resident_bytes", "qwen4exp_slots", "qwen4exp_busy_slots",
    "qwen4exp_queue_length", "qwen4exp_prefix_cache_bytes", "qwen4exp_prefix_cache_entries",
    "qwen4exp_prefix_cache_hits_total", "qwen4exp_prefix_cache_misses_total", "qwen4exp_prefix_cache_evictions_total",
    "qwen4exp_prefix_cache_restored_tokens_total", "qwen4exp_prompt_forwards_total", "qwen4exp_prompt_chunks_total",
    "qwen4exp_decode_steps_total", "qwen4exp_decode_steps_beside_prompts_total",
}
GPU_ONLY = {"qwen4exp_gpu_allocated_bytes"}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of an exposition: (name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text_or_samples, name: str, **labels) -> float:
    got = samples(text_or_samples) if isinstance(text_or_samples, str) else text_or_samples
    return got.get((name, tuple(sorted(({"model_name": MODEL} | labels).items()))), 0.0)


def bucket_bounds(text: str, name: str) -> list[float]:
    return [float(s.labels["le"]) for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name + "_bucket" and s.labels["le"] != "+Inf"]


def test_request_metrics_follow_vllm_rules():
    """Exact sums from chosen times: TTFT and inter-token latency per token; latencies, success and token-count
    histograms for requests that finished (stop, length) only; prefix-cache queries for requests that took a slot;
    engine gauges from the worker's stats at scrape time."""
    m = RequestMetrics(MODEL, prefix_cache=True)
    m.set_context(CONTEXT)
    a = SimpleNamespace(submitted_at=10.0, last_token_at=None, prompt_tokens=7, max_tokens=3)
    for now in (10.5, 10.6, 10.8):
        m.token(a, now)
    m.finished(a, Result("length", None, "", [1, 2, 3], 7, 4, {"queued_ms": 100.0, "prefill_ms": 400.0,
                                                               "decode_ms": 300.0}), now=11.0)
    one = SimpleNamespace(submitted_at=30.0, last_token_at=None, prompt_tokens=2, max_tokens=8)
    m.token(one, 30.25)
    m.finished(one, Result("stop", None, "", [0], 2, 0, {"queued_ms": 0.0, "prefill_ms": 250.0,
                                                         "decode_ms": None}), now=30.5)
    cancelled = SimpleNamespace(submitted_at=20.0, last_token_at=None, prompt_tokens=5, max_tokens=9)
    m.token(cancelled, 20.2)
    m.finished(cancelled, Result("cancelled", None, "", [9], 5, 0, {"queued_ms": 50.0, "prefill_ms": 150.0,
                                                                     "decode_ms": None}), now=20.5)
    queued = SimpleNamespace(submitted_at=40.0, last_token_at=None, prompt_tokens=6, max_tokens=9)
    m.finished(queued, Result("cancelled", None, "", [], 6, 0, {"queued_ms": None}), now=41.0)
    failed = SimpleNamespace(submitted_at=50.0, last_token_at=None, prompt_tokens=4, max_tokens=9)
    m.finished(failed, Result("error", "boom", "", [], 4, 0, {"queued_ms": 1.0, "prefill_ms": None}), now=50.1)

    text = m.render({"busy_slots": 1, "queued": 2, "slots": 2, "context": CONTEXT, "used_positions": 256})
    got = samples(text)
    p = "qwen4exp:"
    assert value(got, p + "time_to_first_token_seconds_count") == 3                # a, one, cancelled
    assert value(got, p + "time_to_first_token_seconds_sum") == pytest.approx(0.5 + 0.25 + 0.2)
    assert value(got, p + "inter_token_latency_seconds_count") == 2
    assert value(got, p + "inter_token_latency_seconds_sum") == pytest.approx(0.1 + 0.2)
    for suffix in ("_count", "_sum", "_bucket"):     # the deprecated name carries the same observations
        itl = {k[1]: v for k, v in got.items() if k[0] == p + "inter_token_latency_seconds" + suffix}
        assert itl == {k[1]: v for k, v in got.items() if k[0] == p + "time_per_output_token_seconds" + suffix}
    expected_sums = {"e2e_request_latency_seconds": 1.0 + 0.5, "request_queue_time_seconds": 0.1,
                     "request_prefill_time_seconds": 0.4 + 0.25, "request_decode_time_seconds": 0.3,
                     "request_inference_time_seconds": 0.7 + 0.25, "request_time_per_output_token_seconds": 0.15,
                     "request_prompt_tokens": 9, "request_generation_tokens": 4,
                     "request_max_num_generation_tokens": 4, "request_params_max_tokens": 11}
    for name, total in expected_sums.items():
        assert value(got, p + name + "_count") == 2, name
        assert value(got, p + name + "_sum") == pytest.approx(total), name
    assert value(got, p + "request_success_total", finished_reason="length") == 1
    assert value(got, p + "request_success_total", finished_reason="stop") == 1
    assert {k for k in got if k[0] == p + "request_success_total"} == {
        (p + "request_success_total", (("finished_reason", r), ("model_name", MODEL))) for r in ("stop", "length")}
    assert value(got, p + "prompt_tokens_total") == 7 + 2 + 5                       # at each first token
    assert value(got, p + "generation_tokens_total") == 5
    assert value(got, p + "prefix_cache_queries_total") == 7 + 2 + 5 + 4            # every request that took a slot
    assert value(got, p + "prefix_cache_hits_total") == 4
    assert value(got, p + "num_requests_running") == 1 and value(got, p + "num_requests_waiting") == 2
    assert value(got, p + "kv_cache_usage_perc") == pytest.approx(256 / (2 * CONTEXT))

    # Without used positions in the stats there is no context usage to report; parked: nothing runs or waits;
    # no stats (loading, restarting): no engine gauges at all.
    assert p + "kv_cache_usage_perc" not in {k[0] for k in samples(m.render({"busy_slots": 0, "queued": 0}))}
    parked = samples(m.render({"parked": True}))
    assert value(parked, p + "num_requests_running") == 0 and (p + "num_requests_running",
                                                               (("model_name", MODEL),)) in parked
    assert p + "num_requests_running" not in {k[0] for k in samples(m.render({}))}
    # Two apps in one process, each with its own registry: no duplicate names.
    assert samples(RequestMetrics("other").render({}))


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    s = Server(tiny_checkpoint, context=CONTEXT, model_name=MODEL)
    yield s
    s.close()


def scrape(server) -> str:
    status, text, response = server.request("GET", "/metrics", key=None)
    assert status == 200 and response.getheader("Content-Type") == CONTENT_TYPE
    return text


def test_live_requests_are_counted_as_vllm_counts_them(server):
    before = samples(scrape(server))
    usages, reasons = [], []
    for _ in range(2):                           # the second restores 64 of its 79 prompt tokens from the cache
        status, body, _ = server.request("POST", "/generate", {"prompt_ids": list(range(1, 80)), "max_tokens": 6,
                                                               "ignore_eos": True})
        assert status == 200, body
        usages.append(body["usage"])
        reasons.append(body["finish_reason"])
    status, text, _ = server.request("POST", "/generate", {"prompt": "The mill", "max_tokens": 5, "stream": True,
                                                           "ignore_eos": True})
    last = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")][-1]
    usages.append(last["usage"])
    reasons.append(last["finish_reason"])
    status, body, _ = server.request("POST", "/v1/completions", {"model": MODEL, "prompt": "Once upon",
                                                                 "max_tokens": 4, "temperature": 0})
    assert status == 200, body
    usages.append({"prompt_tokens": body["usage"]["prompt_tokens"],
                   "completion_tokens": body["usage"]["completion_tokens"],
                   "cached_prompt_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"]})
    reasons.append(body["choices"][0]["finish_reason"])
    after = samples(scrape(server))

    def delta(name, **labels):
        return value(after, "qwen4exp:" + name, **labels) - value(before, "qwen4exp:" + name, **labels)

    finished = len(usages)
    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert usages[1]["cached_prompt_tokens"] == 64
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert delta(name + "_count") == finished, name
    assert delta("inter_token_latency_seconds_count") == generated - finished
    assert delta("time_per_output_token_seconds_count") == generated - finished
    assert delta("prompt_tokens_total") == prompt and delta("request_prompt_tokens_sum") == prompt
    assert delta("generation_tokens_total") == generated and delta("request_generation_tokens_sum") == generated
    for reason in ("stop", "length"):
        assert delta("request_success_total", finished_reason=reason) == reasons.count(reason)
    assert delta("prefix_cache_queries_total") == prompt
    assert delta("prefix_cache_hits_total") == sum(u["cached_prompt_tokens"] for u in usages)
    # Every latency is positive and TTFT is at least the queue and prefill time the engine measured.
    assert 0 < delta("e2e_request_latency_seconds_sum") and 0 < delta("request_prefill_time_seconds_sum")
    assert delta("time_to_first_token_seconds_sum") >= delta("request_prefill_time_seconds_sum")
    assert value(after, "qwen4exp:num_requests_running") == 0 == value(after, "qwen4exp:num_requests_waiting")
    # The engine loop's own counts: one request at a time, its prompt's chunks (on the chunk grid, from its cached
    # prefix) each in a forward of its own, and a decode step for each token after the first (a request that
    # stops on a stop token ran one more).
    loop = {name: after[(f"qwen4exp_{name}_total", ())] - before[(f"qwen4exp_{name}_total", ())]
            for name in ("prompt_forwards", "prompt_chunks", "decode_steps", "decode_steps_beside_prompts")}
    chunk = server.request("GET", "/props")[1]["chunk"]
    chunks = sum(-(-u["prompt_tokens"] // chunk) - u["cached_prompt_tokens"] // chunk for u in usages)
    assert loop["prompt_forwards"] == loop["prompt_chunks"] == chunks
    assert generated - finished <= loop["decode_steps"] <= generated and loop["decode_steps_beside_prompts"] == 0


def test_names_labels_buckets_and_vllm_dashboard(server):
    text = scrape(server)
    families = list(text_string_to_metric_families(text))
    ours = [f for f in families if f.name.startswith("qwen4exp:")]
    assert ours and all(s.labels.get("model_name") == MODEL for f in ours for s in f.samples)
    daemon = {f.name + ("_total" if f.type == "counter" else "") for f in families
              if not f.name.startswith("qwen4exp:")}
    assert DAEMON_METRICS <= daemon <= DAEMON_METRICS | GPU_ONLY      # nothing else, no unprefixed newcomer
    for name, expected in BUCKETS.items():
        assert bucket_bounds(text, "qwen4exp:" + name) == expected, name

    # vLLM's dashboard with `vllm:` replaced by `qwen4exp:` finds every series it queries for our model name, and
    # its model picker (label_values({__name__=~"vllm:.*"}, model_name)) finds the name.
    exposed = {(s.name, s.labels.get("model_name")) for f in ours for s in f.samples}
    stats = server.run(server.supervisor.stats())
    missing = set() if "used_positions" in stats else {"qwen4exp:kv_cache_usage_perc"}   # the worker does not say
    wanted = {series.replace("vllm:", "qwen4exp:", 1) for series in VLLM_DASHBOARD_SERIES}
    assert {series for series in wanted if (series, MODEL) not in exposed} == missing
    assert {s.labels["model_name"] for f in ours for s in f.samples} == {MODEL}
