"""Time a decode step's matrix products on a GPU: cuBLAS (F.linear) against row_products.py's kernel, or with
`--qtype`, block_products.py's kernel over weights kept as GGML blocks against both on their dense twin.

    python bench/row_products_bench.py --out rows.json [--rows 1,4] [--qtype Q8_0] [--grid] [--projections]

For each weight shape a decode step of the bench preset multiplies (LM head, Gated DeltaNet's stacked input
and output projections, QSA's, the MoE's stacked router + shared expert, the hyper-connections' 324 x 10240),
the GPU time per product and the weight bytes it reads per second, for the kernel's own plan and a few other
block shapes (with `--grid`, every combination of GRID's block shapes instead; with `--projections`, only the
2048-65536-row weights, `row_products.narrow_tile_plan`'s). Each timing cycles through enough copies of the
weight that none is still in L2 when it is read again, as in a decode step, where every weight is read once. With
`--qtype`, TB/s counts the blocks' bytes for the block kernel and the twin's bfloat16 bytes for the others.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from graph_timing import graph_us

from qwen4exp.checkpoint.gguf_blocks import fill_random_blocks
from qwen4exp.kernels import block_products, row_products
from qwen4exp.kernels.quant_tiles import LAYOUTS, dequantize_rows

SHAPES = [(248320, 2560), (16480, 2560), (12288, 2560), (2560, 6144), (2560, 2560), (1793, 2560), (1024, 2560),
          (324, 10240), (10240, 320), (2560, 640)]
L2_BYTES = 256 << 20   # well above an H200's 50 MB L2
GRID = {"BLOCK_N": (16, 32, 64), "BLOCK_K": (128, 256), "SPLIT_K": (1, 2, 4, 8), "num_warps": (2, 4, 8),
        "num_stages": (3, 4)}


def grid_candidates(planned: dict) -> dict[str, dict]:
    out = {"plan": planned}
    for values in itertools.product(*GRID.values()):
        config = dict(zip(GRID, values))
        if config not in out.values():
            out[" ".join(f"{key.lower()} {value}" for key, value in config.items())] = config
    return out


def candidates(planned: dict) -> dict[str, dict]:
    out = {"plan": planned}
    for name, change in (("block_n 16", {"BLOCK_N": 16}), ("block_n 32", {"BLOCK_N": 32}),
                         ("block_n 64", {"BLOCK_N": 64}), ("block_n 128", {"BLOCK_N": 128}),
                         ("block_k 128", {"BLOCK_K": 128}), ("block_k 256", {"BLOCK_K": 256}),
                         ("block_k 512", {"BLOCK_K": 512}),
                         ("split x2", {"SPLIT_K": planned["SPLIT_K"] * 2}),
                         ("split x4", {"SPLIT_K": planned["SPLIT_K"] * 4}), ("stages 2", {"num_stages": 2}),
                         ("stages 1", {"num_stages": 1}),
                         ("warps 8", {"num_warps": 8}), ("warps 2", {"num_warps": 2})):
        config = planned | change
        if config != planned and config not in out.values():
            out[name] = config
    return out


def dense_entry(n: int, k: int, rows: int, grid: bool) -> dict:
    """cuBLAS and the dense kernel's candidates on a bfloat16 weight."""
    nbytes = n * k * 2
    copies = max(1, min(64, -(-L2_BYTES // nbytes)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x, weights[0]).float()
    entry = {"shape": [n, k], "rows": rows, "MB": round(nbytes / 1e6, 1)}
    us = graph_us(lambda i: F.linear(x, weights[i]), calls=copies, replays=3)
    entry["cublas"] = {"us": round(us, 2), "TB/s": round(nbytes / us / 1e6, 2)}
    for name, config in (grid_candidates if grid else candidates)(row_products.plan(n, k)).items():
        entry[name] = timed(lambda i, c=config: row_products.row_products(x, weights[i], c), copies, nbytes,
                            config, want)
    return entry


def blocks_entry(n: int, k: int, rows: int, qtype: str) -> dict:
    """The block kernel's candidates on `qtype` blocks, beside cuBLAS and the dense kernel's plan on the twin."""
    values, size = LAYOUTS[qtype]
    nbytes = n * (k // values) * size
    copies = max(1, min(64, -(-L2_BYTES // nbytes)))
    stacks = []
    for i in range(copies):
        blocks = torch.empty(n, k // values * size, dtype=torch.uint8, device="cuda")
        fill_random_blocks(blocks, qtype, 0.02, seed=i)
        stacks.append(blocks)
    twin = dequantize_rows(stacks[0], qtype).to(torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x, twin).float()
    entry = {"shape": [n, k], "rows": rows, "qtype": qtype, "MB": round(nbytes / 1e6, 1)}
    twin_copies = max(1, min(64, -(-L2_BYTES // (n * k * 2))))
    twins = [twin.clone() for _ in range(twin_copies)]
    entry["cublas (twin)"] = timed(lambda i: F.linear(x, twins[i]), twin_copies, n * k * 2, None, want)
    entry["dense plan (twin)"] = timed(lambda i: row_products.row_products(x, twins[i]), twin_copies, n * k * 2,
                                       None, want)
    for name, config in candidates(block_products.plan(n, k)).items():
        entry[name] = timed(lambda i, c=config: block_products.block_row_products(x, stacks[i], qtype, dict(c)),
                            copies, nbytes, config, want)
    return entry


def timed(product, copies: int, nbytes: int, config: dict | None, want: torch.Tensor) -> dict:
    try:
        got = product(0).float()
        us = graph_us(product, calls=copies, replays=3)
        return {"us": round(us, 2), "TB/s": round(nbytes / us / 1e6, 2), "config": config,
                "max_diff": (got - want).abs().max().item()}
    except Exception as err:  # noqa: BLE001 - report the shape that failed, keep the others
        return {"error": f"{type(err).__name__}: {err}"[:300], "config": config}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--qtype", choices=sorted(LAYOUTS), help="time the block kernel over this block type")
    parser.add_argument("--grid", action="store_true", help="every combination of GRID's block shapes (dense)")
    parser.add_argument("--projections", action="store_true", help="only the 2048-65536-row weights")
    args = parser.parse_args()
    results = []
    for n, k in SHAPES:
        if args.projections and not row_products.is_projection(n):
            continue
        for rows in (int(r) for r in args.rows.split(",")):
            entry = blocks_entry(n, k, rows, args.qtype) if args.qtype else dense_entry(n, k, rows, args.grid)
            timings = sorted((v["us"], name) for name, v in entry.items() if isinstance(v, dict) and "us" in v)
            entry["best"] = timings[0][1]
            print(json.dumps({key: entry[key] for key in ("shape", "rows", "MB", "best")} | {
                name: entry[name]["us"] for _, name in timings[:6]} | {"cublas": entry.get("cublas")}), flush=True)
            results.append(entry)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "qtype": args.qtype,
                   "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
