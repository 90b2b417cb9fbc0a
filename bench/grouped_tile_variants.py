"""A prompt chunk's routed GEMMs over quantized experts with their weight tiles read in other forms, timed beside the
engine's (an experiment: whether kernels/moe_blocks.py's grouped kernels should read tiles as the decode kernels
read rows).

    python bench/grouped_tile_variants.py --out variants.json [--rows 128,512,1024,2048]     # a GPU
    TRITON_INTERPRET=1 python bench/grouped_tile_variants.py --check                         # on a CPU

The engine's grouped GEMMs (moe_blocks._grouped_gate_up_blocks_kernel, _grouped_down_blocks_kernel) dequantize each
[BLOCK_K, BLOCK_N] weight tile through quant_tiles.weight_tile (dequantize_groups, a lane a value). The variants
are the same kernels with the tile read otherwise:

* down over a 32-value type: each block as two runs of 16 values (quant_tiles.dequantize_halves, whole runs of
  quant bytes per load, as the decode down kernel reads rows), the runs put back in column order;
* gate/up over Q4_K: the 64-value steps walked as four a 256-value block, each tile a block's 32 quant bytes (low
  nibbles its first 32 values, high the next) at the block's start plus constants, the scale fields as 32-bit words.

Each tile holds the same values in the same places and the products run in the same order, so the outputs must be
equal bit for bit (`equal`); only the loads differ. Full model's shapes (512 experts, 2560 x 640, top-10), the row
block the engine picks for the chunk (moe.grouped_form), x and h random; median of triton.testing.do_bench (L2
flushed).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from qwen4exp.engine.model.quantized import QuantizedStack
from qwen4exp.kernels import moe, moe_blocks
from qwen4exp.kernels.expert_groups import group_pairs_by_expert, tile_of, tile_pairs
from qwen4exp.kernels.guard import interpreted
from qwen4exp.kernels.quant_tiles import dequantize_halves, grid_for
from qwen4exp.kernels.rounding import round_to, silu_mul

from experiment_results import save
from moe_rows_variants import _half, _k_scale_min, make_stack     # the Q4_K scale reads as words

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


@triton.jit
def _q4k_chunk_tile(rows, block, c: tl.constexpr, feat_ok, dtype: tl.constexpr, INTERPRETED: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """The [64, BLOCK_N] tile of values 256 block + 64c .. + 63 of Q4_K rows (`rows` [1, BLOCK_N] byte pointers):
    their 32 quant bytes (low nibbles the first 32 values, high the next), the scale fields as 32-bit words."""
    base = rows + block * 144
    head = base.to(tl.pointer_type(tl.uint32))
    ends = tl.load(head, mask=feat_ok, other=0)
    low = tl.load(head + 1, mask=feat_ok, other=0)
    mid = tl.load(head + 2, mask=feat_ok, other=0)
    high = tl.load(head + 3, mask=feat_ok, other=0)
    d, dmin = _half(ends), _half(ends >> 16)
    j = tl.zeros([1, 1], dtype=tl.int32) + 2 * c      # sub-blocks 2c and 2c + 1, as tensors
    scale_lo, min_lo = _k_scale_min(low, mid, high, j)
    scale_hi, min_hi = _k_scale_min(low, mid, high, j + 1)
    quants = tl.load(base + 16 + c * 32 + tl.arange(0, 32)[:, None], mask=feat_ok, other=0).to(tl.int32)
    w_lo = (d * scale_lo) * (quants & 15).to(tl.float32) - dmin * min_lo
    w_hi = (d * scale_hi) * (quants >> 4).to(tl.float32) - dmin * min_hi
    values = tl.reshape(tl.permute(tl.join(w_lo, w_hi), (2, 0, 1)), [64, BLOCK_N])
    return round_to(values, dtype, INTERPRETED)


@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gate_up_q4k_kernel(x_ptr, pair_of_row_ptr, expert_of_block_ptr, w_ptr, h_ptr, num_pairs, num_experts,
                                hidden, inter, top_k, row_bytes, INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """moe_blocks._grouped_gate_up_blocks_kernel over Q4_K with its weight tiles from _q4k_chunk_tile: the same
    64-value steps in the same order, walked as 4 a 256-value block so each tile's bytes sit at a block's start
    plus constants (BLOCK_K must be 64)."""
    tl.static_assert(BLOCK_K == 64, "a tile is a quarter of a Q4_K block")
    block_m, expert, feat = tile_of(tl.program_id(0), inter, expert_of_block_ptr, BLOCK_N)
    if expert >= num_experts:
        return
    dtype = h_ptr.dtype.element_ty
    rows, pair, pair_ok = tile_pairs(block_m, pair_of_row_ptr, num_pairs, BLOCK_M)
    token = tl.where(pair_ok, pair // top_k, 0).to(tl.int64)
    feat_ok = (feat < inter)[None, :]
    gate_rows = w_ptr + ((expert * 2 * inter + feat) * row_bytes)[None, :]
    up_rows = gate_rows + inter * row_bytes
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * hidden + ks[None, :]
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for block in range(0, hidden // 256):
        for c in tl.static_range(4):
            a = tl.load(x_ptrs, mask=pair_ok[:, None], other=0.0)
            gate = _q4k_chunk_tile(gate_rows, block, c, feat_ok, dtype, INTERPRETED, BLOCK_N)
            up = _q4k_chunk_tile(up_rows, block, c, feat_ok, dtype, INTERPRETED, BLOCK_N)
            if INTERPRETED:
                a, gate, up = a.to(tl.float32), gate.to(tl.float32), up.to(tl.float32)
            acc_gate = tl.dot(a, gate, acc_gate)
            acc_up = tl.dot(a, up, acc_up)
            x_ptrs += BLOCK_K
    h = silu_mul(acc_gate, acc_up, dtype, INTERPRETED)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * inter + feat[None, :], h, mask=(feat < inter)[None, :])


def q4k_gate_up(x, pair_of_row, expert_of_block, stack, h, pairs, top_k, config, common):
    """moe_blocks.grouped_gate_up's launch, of the variant kernel."""
    blocks = stack.blocks
    inter = h.shape[1]
    grid = (expert_of_block.numel() * triton.cdiv(inter, config["BLOCK_N"]),)
    _grouped_gate_up_q4k_kernel[grid](x, pair_of_row, expert_of_block, blocks, h, pairs, blocks.shape[0], x.shape[1],
                                      inter, top_k, blocks.shape[-1], **common, **config)


def halves_down(h, pair_of_row, expert_of_block, weights, stack, y, pairs, config, common):
    """moe_blocks.grouped_down's launch, of the variant kernel."""
    blocks = stack.blocks
    hidden = y.shape[1]
    grid = (expert_of_block.numel() * triton.cdiv(hidden, config["BLOCK_N"]),)
    _grouped_down_halves_kernel[grid](h, pair_of_row, expert_of_block, weights, blocks, grid_for(stack.qtype, blocks),
                                      y, pairs, blocks.shape[0], hidden, h.shape[1], blocks.shape[-1],
                                      QTYPE=stack.qtype, **common, **config)


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


def both(product: str, stack, args, block_m: int, top_k: int):
    """{"engine": output, "variant": output} of one product over `stack`, and a function running each."""
    x, h, pair_of_row, expert_of_block, weights = args
    pairs = x.shape[0] * top_k
    gate_up_config, down_config = moe.grouped_configs(x.device, x.element_size(), block_m)
    common = dict(INTERPRETED=interpreted(x), BLOCK_M=block_m)
    outs, runs = {}, {}
    if product == "gate/up":
        launches = (("engine", lambda out: moe_blocks.grouped_gate_up(x, pair_of_row, expert_of_block, stack, out,
                                                                        pairs, top_k, gate_up_config, common)),
                    ("variant", lambda out: q4k_gate_up(x, pair_of_row, expert_of_block, stack, out, pairs, top_k,
                                                        gate_up_config, common)))
        shape = (pair_of_row.numel(), h.shape[1])
    else:
        launches = (("engine", lambda out: moe_blocks.grouped_down(h, pair_of_row, expert_of_block, weights, stack,
                                                                     out, pairs, down_config, common)),
                    ("variant", lambda out: halves_down(h, pair_of_row, expert_of_block, weights, stack, out, pairs,
                                                        down_config, common)))
        shape = (pairs, x.shape[1])
    for name, launch in launches:
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
        print(product, qtype, "equal", torch.equal(outs["engine"], outs["variant"]), flush=True)


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
    cases = [("gate/up", "Q4_K", (EXPERTS, 2 * INTER, HIDDEN)), ("down", "Q5_1", (EXPERTS, HIDDEN, INTER)),
             ("down", "Q8_0", (EXPERTS, HIDDEN, INTER))]
    for product, qtype, shape in cases:
        stack = make_stack(qtype, shape, "cuda", 2)
        for rows in (int(r) for r in args.rows.split(",")):
            launch_args, block_m = chunk(rows, EXPERTS, HIDDEN, INTER, TOP_K, "cuda", rows)
            outs, runs = both(product, stack, launch_args, block_m, TOP_K)
            entry = {"product": product, "type": qtype, "rows": rows, "block_m": block_m,
                     "equal": torch.equal(outs["engine"], outs["variant"])}
            for name, run in runs.items():
                entry[f"{name} ms"] = round(triton.testing.do_bench(run), 4)
            print(json.dumps(entry), flush=True)
            results.append(entry)
            save(args.out, results)


if __name__ == "__main__":
    main()
