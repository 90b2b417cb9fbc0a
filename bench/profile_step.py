"""Where a decode step and a prompt chunk spend their time on a GPU.

    python bench/profile_step.py [--checkpoint DIR | --preset bench|full [--layers N] [--quant ud-q4_k_xl]]
        [--slots 4] [--prompt 4096] [--long 16384] [--chunks-only] --out profile.txt

1. decode ms per step (1 and `--slots` busy) for each decode mode: the CUDA graph, the eager step, and the
   graph of the torch.compile'd step (`--compile`);
2. the torch profiler's top ops for eager decode steps (each op's own time and the launch gaps show), then
   for one prompt chunk at position 0;
3. with `--long N`: each chunk's wall time for an N-token prompt (chunks of `--prompt`), and the profile of
   its last chunk, where attention sees the longest prefix.
`--chunks-only` skips 1 and the decode profile (a prompt chunk's profile on the full model without building
three engines).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from qwen4exp.checkpoint.random_weights import random_model
from qwen4exp.engine.engine import Engine
from qwen4exp.engine.engine_config import EngineConfig
from qwen4exp.engine.loading import load_model
from qwen4exp.engine.request import Request


def bench_model(args):
    """The checkpoint's model in bfloat16 on the GPU, else the preset's (`--layers` layers of it) with random
    weights built there, the quantized ones as random blocks with `--quant`."""
    if args.checkpoint:
        return load_model(args.checkpoint, dtype="bfloat16", device="cuda", progress=False,
                          ple_on_host=args.ple == "host")
    return random_model(args.preset, args.layers, torch.bfloat16, "cuda", quant=args.quant,
                        ple_on_host=args.ple == "host")


def add_model_arguments(parser) -> None:
    """--checkpoint, or --preset, --layers, --quant and --ple: the choice `bench_model` takes (shared by the GPU benches
    built on it)."""
    parser.add_argument("--checkpoint", help="a checkpoint directory; else random weights on the GPU")
    parser.add_argument("--preset", default="bench", choices=("bench", "full"), help="without --checkpoint")
    parser.add_argument("--layers", type=int, default=None,
                        help="without --checkpoint: the preset's first N layers (the bench preset has 8)")
    parser.add_argument("--quant", default=None, help="without --checkpoint: a GGUF mix whose quantized weights are "
                        "random blocks (ud-q4_k_xl, q8_0, ...)")
    parser.add_argument("--ple", choices=("device", "host"), default="device",
                        help="the PLE table on the device or in host memory (as the full model's is served on one "
                        "GPU)")


def submit_busy(engine: Engine, busy: int, prompt: int, tokens: int, limit: int, seed: int) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    requests = [engine.submit(Request(prompt_ids=torch.randint(0, limit, (prompt,), generator=g).tolist(),
                                      max_tokens=tokens)) for _ in range(busy)]
    while any(not r.output_ids for r in requests):
        engine.step()
    return requests


def decode_ms(engine: Engine, busy: int, prompt: int, steps: int, limit: int) -> float:
    requests = submit_busy(engine, busy, prompt, steps + 8, limit, seed=busy)
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - started) / steps * 1000
    engine.run_until_idle()
    assert all(r.error is None for r in requests), [r.error for r in requests]
    return elapsed


def profile_eager_decode(engine: Engine, slots: int, prompt: int, steps: int, rows: int, limit: int) -> list[str]:
    """The profile of 10 eager decode steps with one busy slot at a context of `prompt` tokens."""
    requests = submit_busy(engine, 1, prompt, 4 * steps, limit, seed=0)
    for _ in range(3):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
    for r in requests:
        engine.cancel(r.id)
    engine.run_until_idle()
    return [f"== 10 eager decode steps, 1 busy of {slots} slots, context {prompt}",
            prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)]


def profile_long_prompt(engine: Engine, length: int, chunk: int, rows: int, limit: int) -> list[str]:
    """Each chunk's wall time (synchronised) for one `length`-token prompt, then its last chunk's profile."""
    g = torch.Generator().manual_seed(11)
    request = engine.submit(Request(prompt_ids=torch.randint(0, limit, (length,), generator=g).tolist(),
                                    max_tokens=1))
    chunks = -(-length // chunk)
    times = []
    for _ in range(chunks - 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(round((time.perf_counter() - started) * 1000, 2))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(round((time.perf_counter() - started) * 1000, 2))
    engine.run_until_idle()
    assert request.output_ids and request.error is None, request.error
    print(f"{length}-token prompt, chunk ms: {times}", flush=True)
    return [(f"== a {length}-token prompt in chunks of {chunk}: wall ms per chunk {times} (last one under the "
             "profiler)"), f"== its last chunk (positions {(chunks - 1) * chunk}..{length - 1})",
            prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)]


def main() -> None:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--long", type=int, default=0, help="also time and profile the chunks of this prompt")
    parser.add_argument("--compile", action="store_true", help="also time the torch.compile'd decode step")
    parser.add_argument("--chunks-only", action="store_true",
                        help="skip the decode timings (1) and the eager decode profile (2): the prompt chunks alone")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model = bench_model(args)
    limit = model.config.eos_token_id
    context = max(args.prompt, args.long) + 4 * args.steps + 64
    report, timings = [], {}
    modes = {} if args.chunks_only else {"graph": {}, "eager": {"cuda_graphs": False}}
    if args.compile and not args.chunks_only:
        modes["compiled graph"] = {"compile_decode": True}
    for mode, options in modes.items():
        engine = None
        try:
            started = time.perf_counter()
            engine = Engine.from_config(model, EngineConfig(slots=args.slots, max_ctx=context, chunk=args.prompt,
                                                            **options))
            ready = time.perf_counter() - started
            timings[mode] = {"start_s": round(ready, 2)} | {
                f"{busy}_busy_ms": round(decode_ms(engine, busy, 64, args.steps, limit), 3)
                for busy in (1, args.slots)}
        except Exception as err:  # noqa: BLE001 - report the mode that failed, keep the others
            timings[mode] = {"error": f"{type(err).__name__}: {err}"[:2000]}
        print(mode, timings[mode], flush=True)
        del engine
    if timings:
        report.append(json.dumps(timings, indent=1))

    engine = Engine.from_config(model, EngineConfig(slots=args.slots, max_ctx=context, chunk=args.prompt,
                                                    cuda_graphs=False))
    if not args.chunks_only:
        report += profile_eager_decode(engine, args.slots, args.prompt, args.steps, args.rows, limit)
        print("\n".join(report[-2:]), flush=True)
    g = torch.Generator().manual_seed(7)
    warm = engine.submit(Request(prompt_ids=torch.randint(0, limit, (args.prompt,), generator=g).tolist(),
                                 max_tokens=1))
    engine.run_until_idle()                       # a chunk of this length ran once before the profiled one
    assert warm.output_ids
    fresh = engine.submit(Request(prompt_ids=torch.randint(0, limit, (args.prompt,), generator=g).tolist(),
                                  max_tokens=1))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    report.append(f"== one {args.prompt}-token prompt chunk at position 0")
    report.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))
    print("\n".join(report[-2:]), flush=True)
    engine.run_until_idle()
    assert fresh.output_ids
    if args.long:
        report += profile_long_prompt(engine, args.long, args.prompt, args.rows, limit)
        print("\n".join(report[-3:]), flush=True)
    open(args.out, "w").write("\n".join(report))


if __name__ == "__main__":
    main()
