"""A prompt chunk's routed down GEMM over Q5_1 or Q8_0 experts with its weight tiles read in another form, timed
beside the engine's (an experiment: whether kernels/moe_blocks.py's grouped kernels should read tiles as its decode
down kernel reads rows).

    python bench/grouped_tile_variants.py --out variants.json [--rows 128,512,1024,2048]     # a GPU
    TRITON_INTERPRET=1 python bench/grouped_tile_variants.py --check                         # on a CPU

The engine's grouped down GEMM (moe_blocks._grouped_down_blocks_kernel) dequantizes each [BLOCK_K, BLOCK_N] weight
tile a byte a value (quant_tiles.weight_tile over dequantize_groups). The variant here is the same kernel with the
tile read as the decode down kernel reads a row: each 32-value block as two runs of 16 values
(quant_tiles.dequantize_halves: whole runs of quant bytes per load), the runs then put back in column order. The tile
holds the same values in the same places and the products run in the same order, so the outputs must be equal bit
for bit (`equal`); only the loads differ. Full model's shapes (512 experts, 2560 x 640, top-10), the row block the
engine picks for the chunk (moe.grouped_form), h random; median of triton.testing.do_bench (L2 flushed).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from qwen4exp.checkpoint.gguf_blocks import fill_random_blocks
from qwen4exp.engine.model.quantized import QuantizedStack
from qwen4exp.kernels import moe, moe_blocks
from qwen4exp.kernels.expert_groups import group_pairs_by_expert, tile_of, tile_pairs
from qwen4exp.kernels.guard import interpreted
from qwen4exp.kernels.quant_tiles import dequantize_halves, grid_for
from qwen4exp.kernels.rounding import round_to

EXPERTS, HIDDEN, INTER, TOP_K = 512, 2560, 640, 10


@triton.jit
def _halves_tile(rows, start, limit, feat_ok, grid_ptr, dtype: tl.constexpr, QTYPE: tl.constexpr,
                 INTERPRETED: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """quant_tiles.weight_tile's tile (columns start..limit of BLOCK_N rows, [BLOCK_K, BLOCK_N]) read as two runs of
    16 values of each 32-value block."""
    block = start // 32 + tl.arange(0, BLOCK_K // 32)[:, None, None]
    i = tl.arange(0, 16)[None, :, None]
    low, high = dequantize_halves(rows, block, i, (block < limit // 32) & feat_ok, grid_ptr, QTYPE)
    if QTYPE == "Q8_0":
        values = tl.permute(tl.join(low, high), (0, 1, 3, 2))    # [blocks, 16, 2, N]: column 2i + which
    else:
        values = tl.permute(tl.join(low, high), (0, 3, 1, 2))    # [blocks, 2, 16, N]: column 16 which + i
    return round_to(tl.reshape(values, [BLOCK_K, BLOCK_N]), dtype, INTERPRETED)


@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_down_halves_kernel(h_ptr, pair_of_row_ptr, expert_of_block_ptr, weights_ptr, w_ptr, grid_ptr, y_ptr,
                                num_pairs, num_experts, hidden, inter, row_bytes, QTYPE: tl.constexpr,
                                INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr):
    """moe_blocks._grouped_down_blocks_kernel with its weight tiles from _halves_tile."""
    block_m, expert, feat = tile_of(tl.program_id(0), hidden, expert_of_block_ptr, BLOCK_N)
    if expert >= num_experts:
        return
    dtype = h_ptr.dtype.element_ty
    rows, pair, pair_ok = tile_pairs(block_m, pair_of_row_ptr, num_pairs, BLOCK_M)
    feat_ok = feat < hidden
    w_rows = w_ptr + ((expert * hidden + feat) * row_bytes)[None, None, :]
    ks = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * inter + ks[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, inter, BLOCK_K):
        a = tl.load(h_ptrs, mask=(ks < inter - start)[None, :], other=0.0)
        w = _halves_tile(w_rows, start, inter, feat_ok[None, None, :], grid_ptr, dtype, QTYPE, INTERPRETED,
                         BLOCK_K, BLOCK_N)
        if INTERPRETED:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc)
        h_ptrs += BLOCK_K
    route = tl.load(weights_ptr + pair, mask=pair_ok, other=0.0).to(tl.float32)
    y = round_to(acc * route[:, None], y_ptr.dtype.element_ty, INTERPRETED)
    safe_pair = tl.where(pair_ok, pair, 0).to(tl.int64)
    tl.store(y_ptr + safe_pair[:, None] * hidden + feat[None, :], y, mask=pair_ok[:, None] & feat_ok[None, :])


def halves_down(h, pair_of_row, expert_of_block, weights, stack, y, pairs, config, common):
    """moe_blocks.grouped_down's launch, of the variant kernel."""
    blocks = stack.blocks
    hidden = y.shape[1]
    grid = (expert_of_block.numel() * triton.cdiv(hidden, config["BLOCK_N"]),)
    _grouped_down_halves_kernel[grid](h, pair_of_row, expert_of_block, weights, blocks, grid_for(stack.qtype, blocks),
                                      y, pairs, blocks.shape[0], hidden, h.shape[1], blocks.shape[-1],
                                      QTYPE=stack.qtype, **common, **config)


def chunk(rows: int, experts: int, hidden: int, inter: int, top_k: int, device, seed: int):
    """(launch arguments shared by both kernels, the row block) for a chunk of `rows` tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(rows, experts, generator=g).topk(top_k, dim=-1).indices.to(device)
    weights = torch.rand(rows, top_k, generator=g).softmax(-1).to(device, torch.bfloat16)
    probe = QuantizedStack("Q5_1", (experts, 2 * inter, hidden), torch.bfloat16)
    block_m = moe.grouped_form(probe, probe, rows * top_k).block_m
    pair_of_row, expert_of_block = group_pairs_by_expert(ids, experts, block_m)
    h = torch.randn(pair_of_row.numel(), inter, generator=g).to(device, torch.bfloat16)
    return (h, pair_of_row, expert_of_block, weights), block_m


def both(stack, args, block_m: int, pairs: int, hidden: int):
    """y of the engine's launch and of the variant's, and a function running each."""
    h, pair_of_row, expert_of_block, weights = args
    _, config = moe.grouped_configs(h.device, h.element_size(), block_m)
    common = dict(INTERPRETED=interpreted(h), BLOCK_M=block_m)
    outs = {}
    runs = {}
    for name, launch in (("engine", moe_blocks.grouped_down), ("halves", halves_down)):
        y = torch.empty(pairs, hidden, device=h.device, dtype=h.dtype)
        runs[name] = lambda launch=launch, y=y: launch(h, pair_of_row, expert_of_block, weights, stack, y, pairs,
                                                       config, common)
        runs[name]()
        outs[name] = y
    return outs, runs


def make_stack(qtype: str, shape: tuple, device, seed: int) -> QuantizedStack:
    stack = QuantizedStack(qtype, shape, torch.bfloat16).to(device)
    fill_random_blocks(stack.blocks, qtype, shape[-1] ** -0.5, seed=seed)
    return stack


def check() -> None:
    """Both kernels on a small chunk under the interpreter: equal outputs, each 32-value type."""
    experts, hidden, inter, top_k, rows = 4, 64, 160, 2, 6
    for qtype in ("Q5_1", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "IQ4_NL"):
        stack = make_stack(qtype, (experts, hidden, inter), "cpu", 1)
        args, block_m = chunk(rows, experts, hidden, inter, top_k, "cpu", 0)
        outs, _ = both(stack, args, block_m, rows * top_k, hidden)
        print(qtype, "equal", torch.equal(outs["engine"], outs["halves"]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rows", default="128,512,1024,2048")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.check:
        check()
        return
    results = []
    for qtype in ("Q5_1", "Q8_0"):
        stack = make_stack(qtype, (EXPERTS, HIDDEN, INTER), "cuda", 2)
        for rows in (int(r) for r in args.rows.split(",")):
            launch_args, block_m = chunk(rows, EXPERTS, HIDDEN, INTER, TOP_K, "cuda", rows)
            outs, runs = both(stack, launch_args, block_m, rows * TOP_K, HIDDEN)
            entry = {"down": qtype, "rows": rows, "block_m": block_m,
                     "equal": torch.equal(outs["engine"], outs["halves"])}
            for name, run in runs.items():
                entry[f"{name} ms"] = round(triton.testing.do_bench(run), 4)
            print(json.dumps(entry), flush=True)
            results.append(entry)
            if args.out:                          # after each entry: a run cut short keeps what it measured
                with open(args.out, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "triton": triton.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
