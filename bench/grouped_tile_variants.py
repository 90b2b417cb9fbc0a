"""A prompt chunk's routed GEMMs over quantized experts: the engine's tiles against the same kernels reading each
weight tile a byte a value (kernels/moe_blocks.py's grouped kernels as they were before the tiles below).

    python bench/grouped_tile_variants.py --out variants.json [--rows 128,512,1024,2048]     # a GPU
    TRITON_INTERPRET=1 python bench/grouped_tile_variants.py --check                         # on a CPU

The engine's grouped GEMMs read a tile of
* down over a 32-value type as two runs of 16 values of each block (quant_tiles.halves_tile: whole runs of quant
  bytes a load, as the decode down kernel reads rows); `bytes`: quant_tiles.weight_tile, a lane a value (the grouped
  down kernel with FORM "groups");
* gate/up over Q4_K as the quarters of a 256-value block, each tile a block's 32 quant bytes at the block's start
  plus constants, the scale fields as 32-bit words (moe_blocks._grouped_gate_up_q4k_kernel); `bytes`: the generic
  kernel (_grouped_gate_up_blocks_kernel), a lane a value;
* either product over FP8_B128 (`--types gate/up:FP8_B128,down:FP8_B128`) as 32-bit words of four values
  (quant_tiles.fp8_b128_words_tile) in both variants, since weight_tile reads that type so in any kernel: to
  compare it with another form, run this again with that form's quant_tiles.py laid over the package.

Each tile holds the same values in the same places, so under the interpreter the outputs are equal bit for bit;
compiled, the tensor cores may sum a tile's products in another order for another register layout (`equal` says
which: on an H100 the 16-pair row blocks of Q4_K gate/up and Q5_1 down differ, docs/PERFORMANCE.md). Full model's
shapes (512 experts, 2560 x 640, top-10), the row block the engine picks for the chunk (moe.grouped_form), x and h
random; median of triton.testing.do_bench (L2 flushed).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from qwen4exp.engine.model.quantized import QuantizedStack
from qwen4exp.kernels import moe, moe_blocks
from qwen4exp.kernels.expert_groups import group_pairs_by_expert
from qwen4exp.kernels.guard import interpreted
from qwen4exp.kernels.quant_tiles import grid_for

from experiment_results import save
from moe_rows_variants import make_stack

EXPERTS, HIDDEN, INTER, TOP_K = 512, 2560, 640, 10


def bytes_gate_up(x, pair_of_row, expert_of_block, stack, h, pairs, top_k, config, common):
    """moe_blocks.grouped_gate_up's launch of the generic kernel, whatever the type."""
    blocks = stack.blocks
    inter = h.shape[1]
    grid = (expert_of_block.numel() * triton.cdiv(inter, config["BLOCK_N"]),)
    moe_blocks._grouped_gate_up_blocks_kernel[grid](x, pair_of_row, expert_of_block, blocks,
                                                    grid_for(stack.qtype, blocks), h, pairs, blocks.shape[0],
                                                    x.shape[1], inter, top_k, blocks.shape[-1], QTYPE=stack.qtype,
                                                    **common, **config)


def bytes_down(h, pair_of_row, expert_of_block, weights, stack, y, pairs, config, common):
    """moe_blocks.grouped_down's launch with the tile read a lane a value (FORM "groups")."""
    blocks = stack.blocks
    hidden = y.shape[1]
    grid = (expert_of_block.numel() * triton.cdiv(hidden, config["BLOCK_N"]),)
    moe_blocks._grouped_down_blocks_kernel[grid](h, pair_of_row, expert_of_block, weights, blocks,
                                                 grid_for(stack.qtype, blocks), y, pairs, blocks.shape[0], hidden,
                                                 h.shape[1], blocks.shape[-1], QTYPE=stack.qtype, FORM="groups",
                                                 **common, **config)


def chunk(rows: int, experts: int, hidden: int, inter: int, top_k: int, device, seed: int):
    """(x, h, pair_of_row, expert_of_block, weights) of a chunk of `rows` tokens, in the row block the engine picks
    for it over quantized stacks, and that row block."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(rows, experts, generator=g).topk(top_k, dim=-1).indices.to(device)
    weights = torch.rand(rows, top_k, generator=g).softmax(-1).to(device, torch.bfloat16)
    probe = QuantizedStack("Q5_1", (experts, 2 * inter, hidden), torch.bfloat16)
    block_m = moe.grouped_form(probe, probe, rows * top_k).block_m
    pair_of_row, expert_of_block = group_pairs_by_expert(ids, experts, block_m)
    x = torch.randn(rows, hidden, generator=g).to(device, torch.bfloat16)
    h = torch.randn(pair_of_row.numel(), inter, generator=g).to(device, torch.bfloat16)
    return (x, h, pair_of_row, expert_of_block, weights), block_m


def both(product: str, stack, args, block_m: int, top_k: int, override: dict | None = None):
    """{"engine": output, "bytes": output} of one product over `stack`, and a function running each; with
    `override` (launch config entries: block shapes, warps, stages, laid over the engine's) the engine's kernel
    alone, so configured. The `bytes` kernels run at the engine's configs for the type."""
    x, h, pair_of_row, expert_of_block, weights = args
    pairs = x.shape[0] * top_k
    dense_gate_up, dense_down = moe.grouped_configs(x.device, x.element_size(), block_m)
    gate_up_config = moe_blocks.grouped_config("gate/up", stack, block_m, dense_gate_up) | (override or {})
    down_config = moe_blocks.grouped_config("down", stack, block_m, dense_down) | (override or {})
    common = dict(INTERPRETED=interpreted(x), BLOCK_M=block_m)
    outs, runs = {}, {}
    if product == "gate/up":
        launches = (("engine", lambda out: moe_blocks.grouped_gate_up(x, pair_of_row, expert_of_block, stack, out,
                                                                        pairs, top_k, gate_up_config, common)),
                    ("bytes", lambda out: bytes_gate_up(x, pair_of_row, expert_of_block, stack, out, pairs, top_k,
                                                        gate_up_config, common)))
        shape = (pair_of_row.numel(), h.shape[1])
    else:
        launches = (("engine", lambda out: moe_blocks.grouped_down(h, pair_of_row, expert_of_block, weights, stack,
                                                                     out, pairs, down_config, common)),
                    ("bytes", lambda out: bytes_down(h, pair_of_row, expert_of_block, weights, stack, out, pairs,
                                                     down_config, common)))
        shape = (pairs, x.shape[1])
    for name, launch in launches[:1] if override else launches:     # a config's sweep times the engine's tile
        out = torch.zeros(shape, device=x.device, dtype=x.dtype)
        runs[name] = lambda launch=launch, out=out: launch(out)
        runs[name]()
        outs[name] = out
    return outs, runs


def check() -> None:
    """Both kernels of each product on a small chunk under the interpreter: equal outputs."""
    experts, hidden, inter, top_k, rows = 4, 512, 160, 2, 6
    args, block_m = chunk(rows, experts, hidden, inter, top_k, "cpu", 0)
    cases = [("gate/up", "Q4_K", (experts, 2 * inter, hidden))]
    cases += [("down", q, (experts, hidden, inter)) for q in ("Q5_1", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "IQ4_NL")]
    for product, qtype, shape in cases:
        outs, _ = both(product, make_stack(qtype, shape, "cpu", 1), args, block_m, top_k)
        print(product, qtype, "equal", torch.equal(outs["engine"], outs["bytes"]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rows", default="128,512,1024,2048")
    parser.add_argument("--types", default="gate/up:Q4_K,down:Q5_1,down:Q8_0",
                        help="product:type pairs (FP8_B128 for an FP8 checkpoint's experts)")
    parser.add_argument("--configs", default="",
                        help="launch configs to time beside the engine's, ';'-separated, each as "
                             "BLOCK_N=128,num_warps=8,num_stages=3 (any subset)")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.check:
        check()
        return
    results = []
    shapes = {"gate/up": (EXPERTS, 2 * INTER, HIDDEN), "down": (EXPERTS, HIDDEN, INTER)}
    cases = [(product, qtype, shapes[product]) for product, qtype in (p.split(":") for p in args.types.split(","))]
    for product, qtype, shape in cases:
        stack = make_stack(qtype, shape, "cuda", 2)
        for rows in (int(r) for r in args.rows.split(",")):
            launch_args, block_m = chunk(rows, EXPERTS, HIDDEN, INTER, TOP_K, "cuda", rows)
            outs, runs = both(product, stack, launch_args, block_m, TOP_K)
            entry = {"product": product, "type": qtype, "rows": rows, "block_m": block_m,
                     "equal": torch.equal(outs["engine"], outs["bytes"])}
            for name, run in runs.items():
                entry[f"{name} ms"] = round(triton.testing.do_bench(run), 4)
            for text in filter(None, args.configs.split(";")):
                override = {key: int(value) for key, value in (item.split("=") for item in text.split(","))}
                try:
                    outs, runs = both(product, stack, launch_args, block_m, TOP_K, override)
                    entry[f"engine ms at {text}"] = round(triton.testing.do_bench(runs["engine"]), 4)
                except Exception as error:  # noqa: BLE001 - a config the device cannot build is reported
                    entry[f"engine ms at {text}"] = f"failed: {type(error).__name__}"
            print(json.dumps(entry), flush=True)
            results.append(entry)
            save(args.out, results)


if __name__ == "__main__":
    main()
