"""Where a short prompt's chunk spends its time on the host: the GPU time beside the wall time, the host's own
hot spots, and every point where the host waits for the device.

    python bench/short_prompt_host.py [--preset bench --layers 8 | --checkpoint DIR] [--prompts 128,512]
        --out short_prompt_host.txt

For each prompt length (a cold prompt, one token asked, on an engine warmed up as the worker's is):
1. wall ms of the prompt's step against the device's busy ms (CUDA events around the same step): a wall time far
   above the device's is host work the device waits on;
2. the Python functions with the most own time (cProfile, one step);
3. the torch ops with the most own host time (torch profiler, one step);
4. each call that synchronises with the device (torch.cuda.set_sync_debug_mode), with the line that made it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from qwen4exp.engine.engine import Engine
from qwen4exp.engine.engine_config import EngineConfig
from qwen4exp.engine.request import Request

from profile_step import add_model_arguments, bench_model
from speed import prompt_ids as prompt


def one_prompt_step(engine: Engine, ids: list[int]) -> Request:
    """Submit a one-token request and run the step that prefills it; the step after finishes it."""
    request = engine.submit(Request(prompt_ids=ids, max_tokens=1))
    engine.step()
    return request


def timed(engine: Engine, length: int, limit: int, repeats: int) -> dict:
    walls, busy = [], []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        began = time.perf_counter()
        start.record()
        one_prompt_step(engine, prompt(length, limit, 100 + i))
        end.record()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - began) * 1000)
        busy.append(start.elapsed_time(end))
        engine.run_until_idle()
    return {"wall_ms": round(statistics.median(walls), 2), "device_span_ms": round(statistics.median(busy), 2),
            "walls": [round(w, 2) for w in walls]}


def sync_points(engine: Engine, ids: list[int]) -> list[str]:
    """Each synchronising call of one prompt step, as the warning torch raises with its source line."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            one_prompt_step(engine, ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    engine.run_until_idle()
    return [f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}" for w in caught]


def main() -> None:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--prompts", default="128,512")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model = bench_model(args)
    limit = model.config.eos_token_id
    engine = Engine.from_config(model, EngineConfig(slots=args.slots, max_ctx=4 * args.chunk, chunk=args.chunk))
    report = [f"engine warm-up {engine.warm_up():.1f} s"]
    for length in (int(n) for n in args.prompts.split(",")):
        report.append(f"\n==== a cold {length}-token prompt: {timed(engine, length, limit, args.repeats)}")
        profiler = cProfile.Profile()
        profiler.enable()
        one_prompt_step(engine, prompt(length, limit, 1))
        torch.cuda.synchronize()
        profiler.disable()
        engine.run_until_idle()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.rows)
        report.append("== Python functions by own time (cProfile)\n" + text.getvalue())
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            one_prompt_step(engine, prompt(length, limit, 2))
            torch.cuda.synchronize()
        engine.run_until_idle()
        report.append("== torch ops by own host time\n"
                      + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
        points = sync_points(engine, prompt(length, limit, 3))
        report.append(f"== {len(points)} synchronising calls in one step\n" + "\n".join(points))
        print(report[-4][:200], flush=True)
    with open(args.out, "w") as f:
        f.write("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
