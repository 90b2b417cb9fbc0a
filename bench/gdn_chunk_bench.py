"""Time a prompt chunk's gated delta rule on a GPU: the token loop (kernels/delta_rule.chunk_tokens, the decode
step's arithmetic over each token in turn, one launch) against fla's chunked form with the gate kernels before it
(what a chunk longer than TOKEN_LOOP_MAX runs), at the shipped model's head shapes in bfloat16.

    python bench/gdn_chunk_bench.py --out gdn_chunk.json [--tokens 1,16,64,128,256,512,1024]

For each length: the device time of one call (CUDA events around a batch of calls, median of batches) and its
host time (the wall time to issue one call, the device left to run behind), in microseconds. A short prompt chunk
is bound by its host time (docs/PERFORMANCE.md), so the token loop pays where its device time stays under what
it saves on the host; TOKEN_LOOP_MAX is chosen from this table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from qwen4exp.engine.model import delta_rule
from qwen4exp.kernels import delta_rule as delta_rule_kernels

K_HEADS, V_HEADS, DK, DV = 16, 48, 128, 128


def inputs(tokens: int, gen: torch.Generator) -> dict:
    conv_out = torch.randn(tokens, 2 * K_HEADS * DK + V_HEADS * DV, generator=gen, device="cuda").bfloat16()
    q, k, v = torch.split(conv_out, [K_HEADS * DK, K_HEADS * DK, V_HEADS * DV], dim=-1)
    gate_rows = torch.randn(tokens, 2 * V_HEADS, generator=gen, device="cuda").bfloat16()
    return {"q": q.unflatten(-1, (K_HEADS, DK)), "k": k.unflatten(-1, (K_HEADS, DK)),
            "v": v.unflatten(-1, (V_HEADS, DV)), "a": gate_rows[:, :V_HEADS], "b": gate_rows[:, V_HEADS:],
            "a_log": torch.randn(V_HEADS, generator=gen, device="cuda").bfloat16(),
            "dt_bias": torch.rand(V_HEADS, generator=gen, device="cuda").bfloat16(),
            "state": torch.randn(V_HEADS, DK, DV, generator=gen, device="cuda") * 0.1}


def token_loop(x: dict) -> torch.Tensor:
    return delta_rule_kernels.chunk_tokens(x["q"], x["k"], x["v"], x["a"], x["b"], x["a_log"], x["dt_bias"],
                                           x["state"])


def fla_form(x: dict) -> torch.Tensor:
    g, beta = delta_rule.gates(x["a"], x["b"], x["a_log"], x["dt_bias"])
    return delta_rule_kernels.fla_chunk(x["q"], x["k"], x["v"], g, beta, x["state"])


def timed(form, x: dict, batches: int = 7, calls: int = 20) -> dict:
    for _ in range(3):
        form(x)
    torch.cuda.synchronize()
    device_us, host_us = [], []
    for _ in range(batches):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(calls):
            form(x)
        end.record()
        torch.cuda.synchronize()
        device_us.append(begin.elapsed_time(end) * 1000 / calls)
    for _ in range(batches * calls):
        torch.cuda.synchronize()
        issued = time.perf_counter()
        form(x)
        host_us.append((time.perf_counter() - issued) * 1e6)
    torch.cuda.synchronize()
    return {"device_us": round(statistics.median(device_us), 1), "host_us": round(statistics.median(host_us), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,16,64,128,256,512,1024")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    with torch.inference_mode():
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = inputs(tokens, gen)
            row = {"tokens": tokens, "token_loop": timed(token_loop, x)}
            if delta_rule_kernels.fla_available():
                row["fla"] = timed(fla_form, x)
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"bench": "gdn_chunk", "token_loop_max": delta_rule_kernels.TOKEN_LOOP_MAX,
              "device": torch.cuda.get_device_name(), "heads": [K_HEADS, V_HEADS, DK, DV], "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
