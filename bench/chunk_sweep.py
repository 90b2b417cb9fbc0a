"""What the prompt chunk costs and buys on a GPU: the fit's chunk workspace and a long prompt's prefill time.

    python bench/chunk_sweep.py --out chunks.json [--checkpoint DIR | --preset bench|full --layers N --quant MIX]
        [--position 65536] [--rows 256,512,1024,2048,4096] [--prompt 16384] [--chunks 1024,2048,4096]

1. For each --rows: the workspace `max_ctx = "auto"` budgets for a chunk of that many rows, measured as the fit
   measures it (engine/fit_measure.measure_workspace: the chunk run at --position of a one-slot state, its
   peak above that state);
2. the bytes of one slot's state per position (fit_measure.measure_state at 4096 and 8192 positions);
3. for each --chunks: a --prompt-token prompt's time to its first token in an engine of 4 slots with that
   chunk (after one chunk-sized prompt, so every kernel is compiled first).

Each chunk reads every expert's weights once, so below a few thousand rows a chunk costs about the same time
whatever its size: the chunk decides the prefill rate, the workspace decides how much context it takes.
"""

from __future__ import annotations

import argparse
import json

import torch
from profile_step import add_model_arguments, bench_model
from qwen4exp.engine.engine import Engine
from qwen4exp.engine.engine_config import EngineConfig
from qwen4exp.engine.fit_measure import measure_state, measure_workspace
from speed import first_token, prompt_ids, release


def sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main() -> None:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    parser.add_argument("--position", type=int, default=65536, help="where the workspace is measured")
    parser.add_argument("--rows", type=sizes, default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--prompt", type=int, default=16384)
    parser.add_argument("--chunks", type=sizes, default=[1024, 2048, 4096])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    model = bench_model(args)
    limit = model.config.eos_token_id
    report: dict = {"position": args.position, "prompt": args.prompt}
    report["workspace_mib"] = {rows: round(measure_workspace(model, device, args.position, rows) / 2**20, 1)
                               for rows in args.rows}
    print("workspace MiB", report["workspace_mib"], flush=True)
    report["slot_state_bytes"] = {capacity: measure_state(model, device, capacity) for capacity in (4096, 8192)}
    report["prefill_s"] = {}
    for chunk in args.chunks:
        engine = Engine.from_config(model, EngineConfig(slots=4, max_ctx=args.prompt + chunk, chunk=chunk))
        first_token(engine, prompt_ids(chunk + 1, limit, 2), 1, device)
        engine.run_until_idle()
        _, seconds = first_token(engine, prompt_ids(args.prompt, limit, 500 + chunk), 1, device)
        engine.run_until_idle()
        report["prefill_s"][chunk] = round(seconds, 4)
        print(f"chunk {chunk}: {args.prompt}-token prompt in {seconds:.3f} s", flush=True)
        del engine
        release(device)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
