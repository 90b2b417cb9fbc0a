"""Time the fused hyper-connection kernels against the torch forms at the shipped sizes on a GPU.

    python bench/hyper_kernels_bench.py --out hyper.json

For each row count (a decode step's 1 and 4 rows, a 4096-token prompt chunk): a whole hyper-connection
(injection, norm, both projections, mixing) on the Triton ops and on the torch ops, then `mix_streams` alone under
a few block shapes, so the defaults in kernels/hyper.py can be chosen from measurements.
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch

from graph_timing import graph_us

from qwen4exp.engine.model.hyper import GatedResidual
from qwen4exp.engine.model.ops import TORCH_OPS
from qwen4exp.engine.model.triton_ops import TRITON_OPS
from qwen4exp.kernels import hyper as hyper_kernels

FEW = hyper_kernels.MIX_FEW
CANDIDATES = {
    "few": [FEW,
            {**FEW, "SPLIT_STREAMS": False, "BLOCK_H": 32, "BLOCK_K": 512, "NUM_STAGES": 1},   # the former default
            {**FEW, "SPLIT_STREAMS": False, "BLOCK_H": 32},
            {**FEW, "SPLIT_STREAMS": False, "BLOCK_H": 32, "BLOCK_K": 128},
            {**FEW, "BLOCK_H": 32, "BLOCK_K": 512, "NUM_STAGES": 1},
            {**FEW, "BLOCK_H": 16, "BLOCK_K": 512, "NUM_STAGES": 1},
            {**FEW, "BLOCK_H": 32},
            {**FEW, "BLOCK_H": 32, "BLOCK_K": 128},
            {**FEW, "BLOCK_H": 32, "num_warps": 2},
            {**FEW, "BLOCK_H": 16}],
    "many": [hyper_kernels.MIX_MANY,
             {**hyper_kernels.MIX_MANY, "BLOCK_T": 128, "num_warps": 8},
             {**hyper_kernels.MIX_MANY, "BLOCK_H": 128},
             {**hyper_kernels.MIX_MANY, "ACT_READY": False},
             {**hyper_kernels.MIX_MANY, "NUM_STAGES": 1}],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default="1,4,4096")
    args = parser.parse_args()
    hidden, hc, rank = 2560, 4, 320
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = GatedResidual(hidden, hc, rank, 1e-6).cuda().bfloat16().requires_grad_(False)
    for p in res.parameters():
        p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * 0.05)
    report = {"device": torch.cuda.get_device_name(), "sizes": {"hidden": hidden, "hc": hc, "rank": rank}, "rows": {}}
    for rows in (int(r) for r in args.rows.split(",")):
        streams = torch.randn(rows, hc * hidden, generator=gen, device="cuda").bfloat16()
        out = torch.randn(rows, hidden, generator=gen, device="cuda").bfloat16()
        gates = (2 * torch.rand(rows, hc, generator=gen, device="cuda")).bfloat16()
        # What a hyper-connection reads of a step: its backend, and whether the rows are a decode step's.
        fused_step = SimpleNamespace(ops=TRITON_OPS, decode=rows <= hyper_kernels.FEW_ROWS)
        torch_step = SimpleNamespace(ops=TORCH_OPS, decode=rows <= hyper_kernels.FEW_ROWS)
        with torch.inference_mode():
            fused = graph_us(lambda _: res(streams, fused_step, inject=(out, gates)))
            _, normed = hyper_kernels.norm_rows(streams, res.hc_norm.weight, res.hc_norm.eps, hidden)
            down = res.input_mix_weight_down(normed)
            logits = res.block_inject_weight(normed)
            # A decode step reads each layer's up-projection once: cycle through copies that outgrow L2 (50 MB
            # on an H200), or the timing is of a weight the cache still holds.
            ups = [res.input_mix_weight_up.weight.clone() for _ in range(40)]
            configs = {}
            for config in CANDIDATES["few" if rows <= hyper_kernels.FEW_ROWS else "many"]:
                try:
                    us = graph_us(lambda i, c=config: hyper_kernels.mix_streams(down, ups[i % len(ups)], normed, hc,
                                                                              logits, c), calls=len(ups))
                except Exception as err:  # noqa: BLE001 - a shape the compiler rejects is a result too
                    us = f"failed: {type(err).__name__}: {str(err)[:200]}"
                configs[json.dumps(config, sort_keys=True)] = us
        with torch.inference_mode():
            eager = graph_us(lambda _: res(streams, torch_step, inject=(out, gates)), calls=5)
        flops = 2 * rows * rank * hc * hidden
        report["rows"][rows] = {"update_and_mix_fused_us": round(fused, 2), "update_and_mix_torch_us": round(eager, 2),
                                "up_projection_gflop": flops / 1e9, "mix_streams_us_by_config": configs}
        print(rows, json.dumps(report["rows"][rows], indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
