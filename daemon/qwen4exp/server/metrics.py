"""GET /metrics: the Prometheus text exposition, rendered by prometheus-client from one registry per app.

Two sets of names:
  - `qwen4exp:*` are vLLM's serving metrics under our prefix: vLLM's names with `vllm:` replaced by `qwen4exp:`,
    its types, meanings and bucket boundaries, and its label `model_name` (the served model name), so a dashboard
    written for vLLM works after that one rename (docs/API.md, "GET /metrics"). The supervisor observes them on the
    event loop as the worker's messages arrive (RequestMetrics: one `observe` and one `inc` per token); the
    engine's state (running and waiting requests) is read from the worker's stats at scrape time (EngineStats).
  - `qwen4exp_*` are the daemon's own, unlabelled, written as plain text lines with integer values (scripts
    and tests read them as such; a prometheus-client collector would print 12.0).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, exposition, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from .messages import EngineState

PREFIX = "qwen4exp:"
LABEL = "model_name"

# The Prometheus text format 0.0.4 that generate_latest writes (prometheus-client >= 0.22 names it
# CONTENT_TYPE_PLAIN_0_0_4; before, CONTENT_TYPE_LATEST was that type).
CONTENT_TYPE = getattr(exposition, "CONTENT_TYPE_PLAIN_0_0_4", exposition.CONTENT_TYPE_LATEST)

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so the quantiles its dashboards compute mean the same here.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
# Inter-token latency, its deprecated name time_per_output_token_seconds, and the per-request mean TPOT.
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
# End-to-end, queue, inference, prefill and decode time of a request.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
# A request that ended in one of these counts in request_success_total and in the per-request histograms; one
# cancelled (client gone, park in "abort" mode) or failed in the engine does not, as vLLM counts aborted requests.
SUCCESS_REASONS = ("stop", "length")


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's build_1_2_5_buckets, for token counts up to the context)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return out
            out.append(mantissa * scale)
        scale *= 10


class EngineStats:
    """The gauges that come from the worker's stats, read at scrape time (`stats` is set around one render)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: dict | None = None

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, documentation, labels=[LABEL])
        family.add_metric([self.model_name], value)
        return family

    def collect(self):
        stats = self.stats or {}
        if "busy_slots" in stats:
            running, waiting = stats["busy_slots"], stats["queued"]
        elif stats.get("parked"):
            running = waiting = 0             # a parked engine holds no request
        else:
            return                            # loading, restarting or failed: no engine to report on
        yield self._gauge("num_requests_running", "Requests in the engine's slots (prefilling or decoding).",
                          running)
        yield self._gauge("num_requests_waiting", "Requests queued for a free slot.", waiting)
        used, slots, context = stats.get("used_positions"), stats.get("slots"), stats.get("context")
        if used is not None and slots and context:
            yield self._gauge("kv_cache_usage_perc", "Positions the slots' requests hold, over slots x context "
                              "(1 means every slot full).", used / (slots * context))


class Renamed:
    """A metric's samples under a second name: vLLM's deprecated time_per_output_token_seconds, which older
    dashboards read, from the inter-token latency histogram at no cost per observation."""

    def __init__(self, metric, name: str, documentation: str):
        self.metric, self.name, self.documentation = metric, name, documentation

    def collect(self):
        for family in self.metric.collect():
            renamed = Metric(self.name, self.documentation, family.type)
            for sample in family.samples:
                renamed.add_sample(self.name + sample.name[len(family.name):], sample.labels, sample.value,
                                   sample.timestamp, sample.exemplar)
            yield renamed


class RequestMetrics:
    """vLLM's request metrics for one app, observed by the supervisor on the event loop: `token` at each of a
    request's Tokens, `finished` at its Finished. A request's state lives on its Stream (submitted_at,
    last_token_at, prompt_tokens, max_tokens)."""

    def __init__(self, model_name: str, prefix_cache: bool = False):
        self.model_name = model_name
        self.prefix_cache = prefix_cache
        self.registry = CollectorRegistry()
        self.engine_stats = EngineStats(model_name)
        self.registry.register(self.engine_stats)

        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of requests that reached their first "
                                           "token (prefilled or restored from the prefix cache).")
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = self._counter("prefix_cache_queries", "Prefix cache queries, in prompt tokens "
                                                  "looked up (counted when the request ends).")
        self.prefix_cache_hits = self._counter("prefix_cache_hits", "Prefix cache hits, in prompt tokens restored "
                                               "instead of prefilled (counted when the request ends).")
        success = Counter(PREFIX + "request_success", "Requests finished, by finish reason (stop or length).",
                          [LABEL, "finished_reason"], registry=self.registry)
        self.success = {reason: success.labels(model_name, reason) for reason in SUCCESS_REASONS}

        self.ttft = self._histogram("time_to_first_token_seconds", "Time from a request's submission to the engine "
                                    "to its first token, in seconds.", TTFT_BUCKETS)
        itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive tokens of a request, in "
                        "seconds.", [LABEL], buckets=ITL_BUCKETS, registry=self.registry)
        self.itl = itl.labels(model_name)
        self.registry.register(Renamed(itl, PREFIX + "time_per_output_token_seconds", "Deprecated name of "
                                       "inter_token_latency_seconds (the same observations)."))
        self.tpot = self._histogram("request_time_per_output_token_seconds", "A request's decode time over its "
                                    "tokens after the first, in seconds (0 for one token).", ITL_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Time from a request's submission to the engine "
                                   "to its end, in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue = self._histogram("request_queue_time_seconds", "Time a request waited for a slot, in seconds.",
                                     REQUEST_LATENCY_BUCKETS)
        self.inference = self._histogram("request_inference_time_seconds", "Time from a request taking a slot to "
                                         "its last token (prefill + decode), in seconds.", REQUEST_LATENCY_BUCKETS)
        self.prefill = self._histogram("request_prefill_time_seconds", "Time from a request taking a slot to its "
                                       "first token, in seconds.", REQUEST_LATENCY_BUCKETS)
        self.decode = self._histogram("request_decode_time_seconds", "Time from a request's first token to its "
                                      "last, in seconds.", REQUEST_LATENCY_BUCKETS)
        self.token_counts: tuple[Histogram, ...] | None = None     # their buckets need the context: set_context

    def _counter(self, name: str, documentation: str):
        return Counter(PREFIX + name, documentation, [LABEL], registry=self.registry).labels(self.model_name)

    def _histogram(self, name: str, documentation: str, buckets):
        return Histogram(PREFIX + name, documentation, [LABEL], buckets=buckets,
                         registry=self.registry).labels(self.model_name)

    def set_context(self, context: int) -> None:
        """The token-count histograms, with buckets 1-2-5 up to the context (the first worker's; later ones keep
        it)."""
        if self.token_counts is not None:
            return
        buckets = buckets_1_2_5(context)
        self.token_counts = (
            self._histogram("request_prompt_tokens", "Prompt tokens of a request.", buckets),
            self._histogram("request_generation_tokens", "Tokens a request generated.", buckets),
            self._histogram("request_max_num_generation_tokens", "Most tokens generated by a request's sequences "
                            "(one sequence a request here).", buckets),
            self._histogram("request_params_max_tokens", "A request's max_tokens.", buckets),
        )

    # ---- observations (the supervisor's event loop) ------------------------------------------------
    def token(self, stream, now: float) -> None:
        last = stream.last_token_at
        if last is None:
            self.ttft.observe(now - stream.submitted_at)
            self.prompt_tokens.inc(stream.prompt_tokens)
        else:
            self.itl.observe(now - last)
        stream.last_token_at = now
        self.generation_tokens.inc()

    def finished(self, stream, result, now: float) -> None:
        timings = result.timings or {}
        if self.prefix_cache and timings.get("queued_ms") is not None:    # it took a slot: its prompt was looked up
            self.prefix_cache_queries.inc(result.prompt_tokens)
            self.prefix_cache_hits.inc(result.cached_tokens)
        success = self.success.get(result.finish_reason)
        if success is None:
            return
        success.inc()
        generated = len(result.output_ids)
        prefill, decode = _seconds(timings.get("prefill_ms")), _seconds(timings.get("decode_ms"))
        self.e2e.observe(now - stream.submitted_at)
        self.queue.observe(_seconds(timings.get("queued_ms")))
        self.prefill.observe(prefill)
        self.decode.observe(decode)
        self.inference.observe(prefill + decode)
        self.tpot.observe(decode / (generated - 1) if generated > 1 else 0.0)
        if self.token_counts is not None:
            prompt, generation, most, max_tokens = self.token_counts
            prompt.observe(result.prompt_tokens)
            generation.observe(generated)
            most.observe(generated)
            if stream.max_tokens:
                max_tokens.observe(stream.max_tokens)

    def render(self, stats: dict) -> str:
        """The registry's exposition, with the engine gauges read from `stats` (call on the event loop)."""
        self.engine_stats.stats = stats
        try:
            return generate_latest(self.registry).decode()
        finally:
            self.engine_stats.stats = None


def _seconds(ms: float | None) -> float:
    """A duration the worker sent in ms (None: the phase did not happen, as decode for a one-token answer)."""
    return 0.0 if ms is None else ms / 1000


def render_metrics(supervisor, stats: dict, guard) -> str:
    """The whole /metrics body: the `qwen4exp:` metrics, then the daemon's `qwen4exp_` ones."""
    return supervisor.metrics.render(stats) + _daemon_metrics(supervisor, stats, guard)


def _line(name: str, value, help_text: str, kind: str = "gauge") -> str:
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n{name} {value}\n"


def _daemon_metrics(supervisor, stats: dict, guard) -> str:
    state = supervisor.state
    out = [
        _line("qwen4exp_up", int(state is EngineState.READY), "1 when the engine serves requests"),
        _line("qwen4exp_parked", int(state is EngineState.PARKED), "1 while the engine is parked (GPU given back)"),
        _line("qwen4exp_engine_restarts_total", supervisor.restarts, "engine worker restarts", "counter"),
        _line("qwen4exp_requests_in_flight", supervisor.in_flight, "requests sent to the engine, not finished"),
        _line("qwen4exp_context_tokens", supervisor.fitted_context or 0, "the context each slot serves"),
    ]
    c = supervisor.counters
    out += [
        _line("qwen4exp_requests_total", c["requests"], "requests finished by the engine", "counter"),
        _line("qwen4exp_generated_tokens_total", c["generated_tokens"],
              "tokens generated (rate() of this is the aggregate tokens/s)", "counter"),
        _line("qwen4exp_prompt_tokens_total", c["prompt_tokens"], "prompt tokens of finished requests", "counter"),
        _line("qwen4exp_cached_prompt_tokens_total", c["cached_prompt_tokens"],
              "prompt tokens restored from prefix snapshots instead of prefilled", "counter"),
    ]
    out += [
        _line("qwen4exp_connections_closed_slow_total", guard.closed_slow,
              "connections closed for not sending their headers within server.header_timeout", "counter"),
        _line("qwen4exp_connections_refused_total", guard.refused,
              "connections refused past server.max_connections", "counter"),
    ]
    memory = stats.get("memory") or {}
    if "rss_bytes" in memory:
        out.append(_line("qwen4exp_worker_resident_bytes", memory["rss_bytes"], "engine worker resident memory"))
    gpus = memory.get("gpu_bytes") or {}
    if gpus:
        out.append("# HELP qwen4exp_gpu_allocated_bytes GPU memory allocated by the engine\n"
                   "# TYPE qwen4exp_gpu_allocated_bytes gauge\n")
        out += [f'qwen4exp_gpu_allocated_bytes{{gpu="{gpu}"}} {used}\n' for gpu, used in gpus.items()]
    if stats.get("slots") is not None:
        out.append(_line("qwen4exp_slots", stats["slots"], "engine slots"))
        out.append(_line("qwen4exp_busy_slots", stats["busy_slots"], "slots serving a request"))
        out.append(_line("qwen4exp_queue_length", stats["queued"], "requests waiting for a slot"))
    loop = stats.get("loop")
    if loop:    # the running engine's own counts: they start again from 0 after a park or a worker restart
        out += [
            _line("qwen4exp_prompt_forwards_total", loop["prompt_forwards"], "forwards of prompt chunks (one chunk, "
                  "or with batch_prompts several slots' chunks together)", "counter"),
            _line("qwen4exp_prompt_chunks_total", loop["prompt_chunks"], "prompt chunks run", "counter"),
            _line("qwen4exp_decode_steps_total", loop["decode_steps"], "decode steps", "counter"),
            _line("qwen4exp_decode_steps_beside_prompts_total", loop["decode_steps_beside_prompts"],
                  "decode steps run between a prompt forward's layers (decode_beside_prompts)", "counter"),
        ]
    mtp = stats.get("mtp")
    if mtp and mtp["drafts"]:     # speculative decoding's counts (engine/speculative.py), as the loop's
        out += [
            _line("qwen4exp_mtp_verify_steps_total", mtp["verify_steps"], "decode steps run as verify steps",
                  "counter"),
            _line("qwen4exp_mtp_drafted_tokens_total", mtp["drafted"], "tokens the MTP head drafted", "counter"),
            _line("qwen4exp_mtp_accepted_tokens_total", mtp["accepted"],
                  "drafted tokens the model then produced", "counter"),
            "# HELP qwen4exp_mtp_accepted_at_total verify steps whose draft at this position was accepted\n"
            "# TYPE qwen4exp_mtp_accepted_at_total counter\n",
            *(f'qwen4exp_mtp_accepted_at_total{{position="{i + 1}"}} {n}\n'
              for i, n in enumerate(mtp["accepted_at"])),
        ]
    cache = stats.get("prefix_cache")
    if cache:
        store = cache["store"]
        out += [
            _line("qwen4exp_prefix_cache_bytes", store["bytes"], "bytes of prefix snapshots resident"),
            _line("qwen4exp_prefix_cache_entries", store["entries"], "prefix snapshots resident"),
            _line("qwen4exp_prefix_cache_hits_total", store["hits"], "prompt lookups that restored a prefix",
                  "counter"),
            _line("qwen4exp_prefix_cache_misses_total", store["misses"], "prompt lookups with no stored prefix",
                  "counter"),
            _line("qwen4exp_prefix_cache_evictions_total", cache["evictions"], "snapshots evicted by the limit",
                  "counter"),
            _line("qwen4exp_prefix_cache_restored_tokens_total", cache["restored_tokens"],
                  "prompt tokens restored instead of prefilled", "counter"),
        ]
    return "".join(out)
