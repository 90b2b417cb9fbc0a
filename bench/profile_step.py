"""Where a decode step and a prompt chunk spend their time on a GPU (torch profiler, top kernels).

    python bench/profile_step.py --checkpoint DIR [--slots 4] [--busy 1] [--prompt 4096] --out profile.txt
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from qwen4exp.engine.engine import Engine
from qwen4exp.engine.loading import load_model
from qwen4exp.engine.request import Request


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--busy", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model = load_model(args.checkpoint, dtype="bfloat16", device="cuda", progress=False)
    engine = Engine(model, slots=args.slots, context=args.prompt + 4096, chunk=args.prompt)
    g = torch.Generator().manual_seed(0)
    limit = model.config.eos_token_id
    requests = [engine.submit(Request(prompt_ids=torch.randint(0, limit, (args.prompt,), generator=g).tolist(),
                                      max_tokens=4 * args.steps + 8)) for i in range(args.busy)]
    while any(not r.output_ids for r in requests):
        engine.step()
    for _ in range(3):
        engine.step()
    report = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    report.append(f"== {args.steps} decode steps, {args.busy} busy of {args.slots} slots, context {args.prompt}")
    report.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))
    for r in requests:
        engine.cancel(r.id)
    engine.run_until_idle()
    fresh = engine.submit(Request(prompt_ids=torch.randint(0, limit, (args.prompt,), generator=g).tolist(),
                                  max_tokens=1))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    report.append(f"== one {args.prompt}-token prompt chunk at position 0")
    report.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))
    engine.run_until_idle()
    assert fresh.output_ids
    text = "\n".join(report)
    open(args.out, "w").write(text)
    print(text)


if __name__ == "__main__":
    main()
