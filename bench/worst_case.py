"""Issue 5's worst case, on any device: fit the context under a memory cap, then run it full.

    python bench/worst_case.py (--checkpoint DIR | --random-weights --layers 4) --device cuda --dtype bfloat16 \
        --memory-limit-gib 32 --out worst.json

1. `max_ctx = "auto"` with 4 slots under the cap (the fit measures and verifies on this device);
2. the budget model's verdict at the fitted context + 4096 (it must miss: the fit is tight);
3. one slot filled to the fitted context with one long prompt beside three short requests;
4. then all four slots long at once;
recording the least free device memory seen (CUDA: under the cap, from the allocator) and that nothing failed.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from qwen4exp.engine.engine import Engine
from qwen4exp.engine.engine_config import EngineConfig
from qwen4exp.engine.memory import release_cached_blocks, set_device_memory_limit
from qwen4exp.engine.request import Request


def least_free(device: torch.device, limit: int) -> int | None:
    if device.type != "cuda":
        return None
    return limit - torch.cuda.max_memory_allocated(device)


def run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    started = time.perf_counter()
    requests = [engine.submit(Request(prompt_ids=p, max_tokens=max_tokens)) for p in prompts]
    engine.run_until_idle()
    return {"seconds": round(time.perf_counter() - started, 2),
            "prompt_tokens": [len(p) for p in prompts],
            "finish": [r.finish_reason.value for r in requests],
            "errors": [r.error for r in requests if r.error]}


def main() -> None:
    parser = argparse.ArgumentParser()
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint")
    source.add_argument("--random-weights", action="store_true", help="bench preset weights built in place")
    parser.add_argument("--preset", default="bench", help="with --random-weights")
    parser.add_argument("--layers", type=int, default=4, help="with --random-weights")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--memory-limit-gib", type=float, required=True, help="the cap in GiB, e.g. 32")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    limit = int(args.memory_limit_gib * 2**30)
    config = EngineConfig(model=args.checkpoint, device=args.device, dtype=args.dtype, slots=args.slots,
                          max_ctx="auto", chunk=args.chunk, device_memory_limit=limit)
    if args.checkpoint:
        device, model = config.load_model()
    else:
        from qwen4exp.checkpoint.random_weights import random_model
        # Drawn in float32 first: build, then cap (a load from disk stays under the cap throughout).
        device = config.torch_device()
        model = random_model(args.preset, args.layers, getattr(torch, args.dtype), device)
        set_device_memory_limit(device, limit)
        release_cached_blocks(device)
    fit = config.resolve_context(model, device).fit      # the fit `serve` runs for these settings
    context = fit.context
    over = fit.planner.evaluate(context + 4096)
    result = {"device": str(device), "memory_limit": limit, "slots": args.slots, "fitted_context": context,
              "fit_seconds": round(fit.seconds, 2), "plan": fit.plan.table(),
              "plus_4096_fits": all(p.fits for p in over),
              "plus_4096_shortfall": max((p.shortfall for p in over if not p.fits), default=0)}
    engine = Engine.from_config(model, config, context=context)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    limit_id = model.config.eos_token_id
    g = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, limit_id, (n,), generator=g).tolist()
    long_len = context - args.max_tokens
    result["one_long_three_short"] = run(engine, [prompt(long_len)] + [prompt(64) for _ in range(3)], args.max_tokens)
    result["all_long"] = run(engine, [prompt(long_len) for _ in range(args.slots)], args.max_tokens)
    result["least_free_bytes"] = least_free(device, limit)
    result["no_failures"] = not (result["one_long_three_short"]["errors"] or result["all_long"]["errors"])
    json.dump(result, open(args.out, "w"), indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "plan"}))
    print(result["plan"])


if __name__ == "__main__":
    main()
