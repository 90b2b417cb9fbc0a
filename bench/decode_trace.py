"""Where a replayed decode step spends its GPU time, kernel by kernel.

    python bench/decode_trace.py --out trace.json [--checkpoint DIR | --preset bench|full --layers N --quant MIX]
        [--slots 4] [--context 8192]

For 1 and `--slots` busy slots (64-token prompts): the engine's wall time per decode step (50 steps), then the
torch profiler over 20 steps, which sees each kernel inside the replayed CUDA graph (the eager profile of
bench/profile_step.py sees host launches too, so a graph's own gaps and kernel count do not show there). The
JSON holds, per busy count, the wall ms per step, the kernels' GPU us per step, the kernels per step and the 70
largest kernels by GPU time (us per step, calls per step, name).
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch
from profile_step import add_model_arguments, bench_model, submit_busy
from torch.profiler import ProfilerActivity, profile

from qwen4exp.engine.engine import Engine
from qwen4exp.engine.engine_config import EngineConfig


def trace(engine: Engine, busy: int, steps: int, limit: int) -> dict:
    requests = submit_busy(engine, busy, 64, 200, limit, seed=busy)
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(50):
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - started) / 50 * 1000
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:110]][0] += 1
            kernels[event.name[:110]][1] += event.device_time
    for r in requests:
        engine.cancel(r.id)
    engine.run_until_idle()
    ranked = sorted(((us / steps, calls / steps, name) for name, (calls, us) in kernels.items()), reverse=True)
    return {"wall_ms_per_step": round(wall_ms, 3),
            "kernel_us_per_step": round(sum(us for us, _, _ in ranked), 1),
            "kernels_per_step": sum(calls for _, calls, _ in ranked),
            "top": [[round(us, 1), round(calls, 1), name] for us, calls, name in ranked[:70]]}


def main() -> None:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=20, help="profiled steps")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model = bench_model(args)
    engine = Engine.from_config(model, EngineConfig(slots=args.slots, max_ctx=args.context, chunk=4096))
    report = {}
    for busy in sorted({1, args.slots}):
        report[f"{busy}_busy"] = trace(engine, busy, args.steps, model.config.eos_token_id)
        print(busy, {k: v for k, v in report[f"{busy}_busy"].items() if k != "top"}, flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
