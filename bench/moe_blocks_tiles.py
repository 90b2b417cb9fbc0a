"""A prompt chunk's routed gate/up product over a Q4_K expert stack at the full model's shapes (512 experts,
2560 -> 2 x 640, top-10), the two ways kernels/moe_blocks.py can run it: the stack dequantized whole
(quant_tiles.dequantize_stack) and then moe.py's dense grouped GEMM, or the grouped GEMM over the blocks, each
weight tile dequantized in registers (`_grouped_gate_up_blocks_kernel`), at a few row blocks and block shapes.
Medians from triton.testing.do_bench (L2 flushed), ms; which way a chunk takes is moe_blocks.DENSE_FROM.

    python bench/moe_blocks_tiles.py --rows 128,512,2048 --out tiles.json       # needs Triton and a GPU
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
import triton

from qwen4exp.checkpoint.gguf_blocks import fill_random_blocks
from qwen4exp.engine.model.quantized import QuantizedStack
from qwen4exp.kernels import moe, moe_blocks
from qwen4exp.kernels.expert_groups import group_pairs_by_expert
from qwen4exp.kernels.quant_tiles import dequantize_stack

EXPERTS, HIDDEN, INTER, TOP_K = 512, 2560, 640, 10
# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the tiles-in-registers kernel; the first is moe.py's GROUPED_GATE_UP
CONFIGS = [(64, 64, 4, 4), (64, 64, 4, 2)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="128,512,2048")
    parser.add_argument("--qtype", default="Q4_K")
    parser.add_argument("--block-m", default="16,64")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    torch.manual_seed(0)
    stack = QuantizedStack(args.qtype, (EXPERTS, 2 * INTER, HIDDEN), torch.bfloat16).to(device)
    fill_random_blocks(stack.blocks, args.qtype, HIDDEN ** -0.5, seed=1)
    blocks, grid_table, row_bytes = moe_blocks._operands(stack)
    dense = dequantize_stack(stack)
    results = {"date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               "device_name": torch.cuda.get_device_name(device), "qtype": args.qtype,
               "shapes": [EXPERTS, HIDDEN, INTER, TOP_K], "whole_dequant_ms": triton.testing.do_bench(
                   lambda: dequantize_stack(stack)), "runs": []}
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16)
        ids = torch.rand(rows, EXPERTS, device=device).topk(TOP_K, dim=-1).indices
        pairs = rows * TOP_K
        for block_m in (int(m) for m in args.block_m.split(",")):
            pair_of_row, expert_of_block = group_pairs_by_expert(ids, EXPERTS, block_m)
            h = torch.empty(pair_of_row.numel(), INTER, device=device, dtype=torch.bfloat16)
            common = dict(INTERPRETED=False, BLOCK_M=block_m)

            def dense_gemm(config=moe.GROUPED_GATE_UP):
                grid = (expert_of_block.numel() * triton.cdiv(INTER, config["BLOCK_N"]),)
                moe._grouped_gate_up_kernel[grid](x, pair_of_row, expert_of_block, dense, h, pairs, EXPERTS, HIDDEN,
                                                  INTER, TOP_K, **common, **config)

            run = {"rows": rows, "block_m": block_m, "dense_gemm_ms": triton.testing.do_bench(dense_gemm),
                   "tiles_in_registers_ms": {}}
            for block_n, block_k, warps, stages in CONFIGS:
                config = dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
                ms = triton.testing.do_bench(lambda: moe_blocks.grouped_gate_up(
                    x, pair_of_row, expert_of_block, stack, h, pairs, TOP_K, config, common))
                run["tiles_in_registers_ms"][json.dumps(config)] = ms
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
