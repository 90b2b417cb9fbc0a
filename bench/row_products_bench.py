"""Time a decode step's matrix products on a GPU: cuBLAS (F.linear) against row_products.py's kernel.

    python bench/row_products_bench.py --out rows.json [--rows 1,4]

For each weight shape a decode step of the bench preset multiplies (LM head, Gated DeltaNet's stacked input
and output projections, QSA's, the MoE's stacked router + shared expert, the hyper-connections' 324 x 10240),
the GPU time per product and the weight bytes it reads per second, for the kernel's own plan and a few other
block shapes. Each timing cycles through enough copies of the weight that none is still in L2 when it is read
again, as in a decode step, where every weight is read once.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from graph_timing import graph_us

from qwen4exp.kernels import row_products

SHAPES = [(248320, 2560), (16480, 2560), (12288, 2560), (2560, 6144), (2560, 2560), (1793, 2560), (1024, 2560),
          (324, 10240), (10240, 320), (2560, 640)]
L2_BYTES = 256 << 20   # well above an H200's 50 MB L2


def candidates(n: int, k: int) -> dict[str, dict]:
    planned = row_products.plan(n, k)
    out = {"plan": planned}
    for name, change in (("block_n 16", {"BLOCK_N": 16}), ("block_n 32", {"BLOCK_N": 32}),
                         ("block_n 64", {"BLOCK_N": 64}), ("block_k 128", {"BLOCK_K": 128}),
                         ("block_k 512", {"BLOCK_K": 512}), ("split x2", {"SPLIT_K": planned["SPLIT_K"] * 2}),
                         ("stages 2", {"num_stages": 2}), ("warps 8", {"num_warps": 8})):
        config = planned | change
        if config != planned and config not in out.values():
            out[name] = config
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default="1,4")
    args = parser.parse_args()
    results = []
    for n, k in SHAPES:
        nbytes = n * k * 2
        copies = max(1, min(64, -(-L2_BYTES // nbytes)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, weights[0]).float()
            entry = {"shape": [n, k], "rows": rows, "MB": round(nbytes / 1e6, 1)}
            us = graph_us(lambda i: F.linear(x, weights[i]), calls=copies, replays=3)
            entry["cublas"] = {"us": round(us, 2), "TB/s": round(nbytes / us / 1e6, 2)}
            for name, config in candidates(n, k).items():
                try:
                    got = row_products.row_products(x, weights[0], config).float()
                    us = graph_us(lambda i, c=config: row_products.row_products(x, weights[i], c), calls=copies,
                                  replays=3)
                    entry[name] = {"us": round(us, 2), "TB/s": round(nbytes / us / 1e6, 2), "config": config,
                                   "max_diff_vs_cublas": (got - want).abs().max().item()}
                except Exception as err:  # noqa: BLE001 - report the shape that failed, keep the others
                    entry[name] = {"error": f"{type(err).__name__}: {err}"[:300], "config": config}
            best = min((v["us"], name) for name, v in entry.items() if isinstance(v, dict) and "us" in v)
            entry["best"] = best[1]
            print(json.dumps(entry), flush=True)
            results.append(entry)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f,
                  indent=1)


if __name__ == "__main__":
    main()
