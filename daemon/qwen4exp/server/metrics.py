"""GET /metrics: Prometheus text exposition."""

from __future__ import annotations

from .messages import EngineState


def _line(name: str, value, help_text: str, kind: str = "gauge") -> str:
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n{name} {value}\n"


def render_metrics(supervisor, stats: dict, guard) -> str:
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
