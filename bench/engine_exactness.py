"""The engine on a GPU: alone == together for four concurrent requests, and decode throughput.

    python bench/engine_exactness.py --checkpoint DIR [--write --layers 8] --out engine.json

The seed's scenario: 4 slots, two ~6K-token prompts beside two short ones, started at different steps.
Each request's greedy ids together must equal its ids alone (bit for bit). Then decode throughput: tokens
per second with one busy slot and with four.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from qwen4exp.engine.engine import Engine
from qwen4exp.engine.engine_config import EngineConfig
from qwen4exp.engine.request import Request


def prompts(limit: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, limit, (n,), generator=g).tolist() for n in (6000, 5800, 40, 300)]


def run(engine: Engine, specs, starts) -> tuple[list[Request], int]:
    requests, step = [], 0
    while len(requests) < len(specs) or not engine.idle:
        while len(requests) < len(specs) and starts[len(requests)] <= step:
            requests.append(engine.submit(Request(**specs[len(requests)])))
        engine.step()
        step += 1
    return requests, step


def decode_rate(engine: Engine, busy: int, tokens: int, limit: int) -> float:
    """Aggregate decode tokens/s with `busy` slots generating (prefill excluded)."""
    g = torch.Generator().manual_seed(1)
    requests = [engine.submit(Request(prompt_ids=torch.randint(0, limit, (64,), generator=g).tolist(),
                                      max_tokens=tokens)) for _ in range(busy)]
    while any(not r.output_ids for r in requests):
        engine.step()
    torch.cuda.synchronize()
    start_tokens = sum(len(r.output_ids) for r in requests)
    started = time.perf_counter()
    engine.run_until_idle()
    torch.cuda.synchronize()
    return (sum(len(r.output_ids) for r in requests) - start_tokens) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.write:
        from qwen4exp.checkpoint.writer import write_random_checkpoint
        write_random_checkpoint(args.checkpoint, preset="bench", layers=args.layers, seed=0, dtype=torch.bfloat16,
                                device="cuda", progress=False)
    config = EngineConfig(model=args.checkpoint, device="cuda", dtype="bfloat16", slots=4, max_ctx=8192,
                          chunk=args.chunk)
    _, model = config.load_model()
    limit = model.config.eos_token_id
    specs = [{"prompt_ids": p, "max_tokens": args.new_tokens} for p in prompts(limit)]
    engine = Engine.from_config(model, config)
    alone = []
    for spec in specs:
        started = time.perf_counter()
        (request,), _ = run(engine, [spec], [0])
        alone.append({"ids": request.output_ids, "seconds": time.perf_counter() - started})
    started = time.perf_counter()
    together, steps = run(engine, specs, [0, 3, 5, 9])
    result["together_seconds"] = time.perf_counter() - started
    result["requests"] = [{"prompt_tokens": len(s["prompt_ids"]), "identical": r.output_ids == a["ids"],
                           "alone_seconds": a["seconds"], "timings_together": r.timings()}
                          for s, r, a in zip(specs, together, alone)]
    result["identical"] = sum(r["identical"] for r in result["requests"])
    print(json.dumps(result))
    result["decode_tokens_per_s"] = {str(b): decode_rate(engine, b, 48, limit) for b in (1, 4)}
    result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    json.dump(result, open(args.out, "w"), indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
