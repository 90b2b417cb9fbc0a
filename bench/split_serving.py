"""Split serving on two devices, the seed's R9700 + Strix Halo layout emulated (issue 22's measured run).

    python bench/split_serving.py --target cuda:0 --target-limit 32GiB --split cuda:1 [--split-limit none] \
        --preset full --quant ud-q4_k_xl [--hot-experts 16] --out results.json

On nvidia-h200-x2: cuda:0 capped at 32 GiB stands in for the R9700 (the target), cuda:1 for the iGPU. The model is
built in place with random weights (the full model at UD-Q4_K_XL without its 104 GiB file), its layers placed as
the engine places them (EngineConfig.choose_placement over the free memory of each device), then:
1. the context fitted over both devices with 4 slots (`max_ctx = "auto"`: the fit of `serve`);
2. 4 short prompts decoded together: generated tok/s (the seed: 78.2 tok/s on its box, adaptive MTP);
3. a 96K-token prompt beside three short ones: its time to first token and the target's least free memory while
   it ran (torch.cuda.mem_get_info sampled from a thread; the seed keeps >= 2.15 GB).
Also, on a machine with one device, `--split cpu` puts layers in host memory beside the GPU (any size works, the
numbers then say what a CPU split costs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import threading
import time
from pathlib import Path

import torch

from qwen4exp.checkpoint.random_weights import random_model
from qwen4exp.config.sizes import parse_optional_size
from qwen4exp.engine import hot_experts
from qwen4exp.engine.engine import Engine
from qwen4exp.engine.engine_config import EngineConfig
from qwen4exp.engine.fit_estimate import model_facts
from qwen4exp.engine.memory import set_device_memory_limit
from qwen4exp.engine.request import Request
from speed import commit     # bench/speed.py: this directory is on the path when run as a script

SHORT = 128          # tokens of a short prompt
LONG = 96 * 1024     # the long prompt beside three short ones


def _prompt(n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (n,), generator=generator).tolist()


def _least_free(device: torch.device, stop: threading.Event, out: list[int]) -> None:
    while not stop.is_set():
        out.append(torch.cuda.mem_get_info(device)[0])
        time.sleep(0.01)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="cuda:0")
    p.add_argument("--target-limit", default="32GiB", help="memory cap of the target ('none': all of it)")
    p.add_argument("--split", default="cuda:1")
    p.add_argument("--split-limit", default="none")
    p.add_argument("--preset", default="full", choices=("bench", "full"))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--quant", default="ud-q4_k_xl")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--chunk", type=int, default=512, help="the seed's profile's chunk")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--hot-experts", type=int, default=0, help="the profile key: each split layer's most routed "
                   "experts also on the target (chosen from a calibration prompt)")
    p.add_argument("--long", type=int, default=LONG)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    target = torch.device(args.target)
    config = EngineConfig(model=None, device=args.target, dtype="bfloat16", slots=args.slots, max_ctx="auto",
                          chunk=args.chunk, device_memory_limit=parse_optional_size(args.target_limit),
                          split=((args.split, parse_optional_size(args.split_limit)),), prefix_cache=True,
                          hot_experts=args.hot_experts)
    set_device_memory_limit(target, config.device_memory_limit)
    set_device_memory_limit(args.split, config.split[0][1])
    facts = model_facts(args.preset, args.quant, "bfloat16", args.layers)
    started = time.perf_counter()
    placement, ple_on_host = config.choose_placement(target, facts)
    model = random_model(args.preset, args.layers, dtype=torch.bfloat16, device=target, quant=args.quant,
                         placement=placement, ple_on_host=ple_on_host)
    config.keep_hot_experts(model)             # as a load does (EngineConfig.load_model), before the fit
    built = time.perf_counter() - started
    choice = config.resolve_context(model, target)
    fit = choice.fit
    result = {
        "date": datetime.date.today().isoformat(),
        "commit": commit(),
        "machine": torch.cuda.get_device_name(target) if target.type == "cuda" else "cpu",
        "devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "args": vars(args), "placement": (model.placement or placement).to_json(), "ple_on_host": ple_on_host,
        "build_seconds": round(built, 1), "context": choice.context, "chunk": fit.chunk,
        "fit_seconds": round(fit.seconds, 1), "plan": fit.plan.to_dict(), "notes": fit.notes,
    }
    config = config.as_loaded(model)
    engine = Engine.from_config(model, config, context=choice.context,
                                prefix_cache=config.new_prefix_cache(model, target))
    engine.warm_up()
    segmented = engine.decoder.segmented
    result["decode_segments"] = None if segmented is None else {"segments": len(segmented.segments),
                                                                 "from_graphs": segmented.graphs}
    result["hot_experts"] = hot_experts.describe(model)

    shorts = [Request(prompt_ids=_prompt(SHORT, seed), max_tokens=args.new_tokens) for seed in range(4)]
    begin = time.perf_counter()
    for request in shorts:
        engine.submit(request)
    engine.run_until_idle()
    seconds = time.perf_counter() - begin
    result["four_short"] = {"prompt_tokens": SHORT, "new_tokens": args.new_tokens,
                            "generated_tok_s": round(sum(len(r.output_ids) for r in shorts) / seconds, 1),
                            "seconds": round(seconds, 3)}

    free: list[int] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_least_free, args=(target, stop, free), daemon=True)
    if target.type == "cuda":
        watcher.start()
    long = Request(prompt_ids=_prompt(args.long, 99), max_tokens=8)
    beside = [Request(prompt_ids=_prompt(SHORT, 100 + i), max_tokens=args.new_tokens) for i in range(3)]
    begin = time.perf_counter()
    for request in (long, *beside):
        engine.submit(request)
    engine.run_until_idle()
    stop.set()
    if watcher.is_alive():
        watcher.join()
    result["long_beside_three"] = {
        "long_tokens": args.long, "long_ttft_s": round(long.first_token_at - long.submitted_at, 3),
        "short_generated": [len(r.output_ids) for r in beside], "errors": [r.error for r in (long, *beside) if r.error],
        "target_least_free_bytes": min(free) if free else None, "seconds": round(time.perf_counter() - begin, 3)}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("context", "placement", "decode_segments", "four_short",
                                             "long_beside_three")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
