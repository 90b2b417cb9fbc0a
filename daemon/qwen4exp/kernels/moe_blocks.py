"""The routed experts' products over GGML blocks: the kernels of moe.py for an expert stack kept quantized.

A stack kept quantized (engine/model/quantized.py's QuantizedStack: `blocks` uint8 [E, rows, row bytes], `qtype`,
`shape`) never exists dense on the device. Each kernel reads the blocks of the weight rows it multiplies and
dequantizes them in registers (quant_tiles.py), in tiles of whole blocks:

* decode (`rows_gate_up`, `rows_down`): a (row, slot) pair's matrix-vector products, as moe.py's dense ones:
  tiles of BLOCK_N weight rows against the row's values, float32 sums, fixed grids (CUDA-graph safe); gate/up over
  Q4_K a 256-value block a step, gate and up in one loop (its bytes as vectors), over the other types gate and up
  each in a pass of their own, GROUPS 32-value groups a step, a byte a value (FP8_B128 a 32-bit word of four);
  down over a GGML 32-value type (the down types of llama.cpp's mixes, whose 640-value rows hold no whole 256-value
  block) GROUPS blocks a step, each read as two runs of 16 values in whole runs of bytes (quant_tiles.row_form),
  over the others as gate/up;
* prefill (`grouped_gate_up`, `grouped_down`): the grouped GEMMs over pairs sorted by expert, each weight tile
  read as decode reads rows (down over HALVES' types but IQ4_NL in halves, Q4_K gate/up a quarter block a step,
  FP8_B128 in words, the others a byte a value), dequantized, rounded to x's dtype and fed to the tensor cores as
  the dense kernels' tiles are; a chunk whose experts get many pairs each runs the dense kernels on the stack
  dequantized whole instead (`dequantized_for`: dequantizing a tile once per row block of its expert costs more
  than streaming the dense twin once); a short one runs smaller row blocks (moe.GroupedForm).

Numerics: the decode kernels multiply by the dequantized weights in float32 (llama.cpp's values exactly, not
rounded to x's dtype, which would add instructions to every weight of a memory-bound step); the prefill GEMMs
round each tile to x's dtype for the tensor cores, which is the dense twin's value (QuantizedStack's entries), so
a chunk's products are the dense kernels' on the twin. Every other rounding point of moe.py's kernels is kept.
moe.py chooses per stack, so gate/up and down may be of different types (or one dense), as in llama.cpp's mixes.
"""

from __future__ import annotations

import torch

from .guard import stages_for, tl, triton
from .quant_tiles import grid_for, row_form

# Decode: BLOCK_N weight rows a program, GROUPS 32-value groups a step along the row. Down by quant_tiles.row_form:
# the halves form's tile is the fastest or within 2% of it at the full model's shapes with 1 and 4 busy rows, for
# Q5_1 and Q8_0 (bench/moe_rows_variants.py --sweep on an H100). Gate/up reads a byte a value but over Q4_K (below):
# the halves form took longer over Q8_0 with one busy row (docs/PERFORMANCE.md).
ROWS_GATE_UP = dict(BLOCK_N=8, GROUPS=16, num_warps=4)
# Gate/up over Q4_K: a 256-value block a step, gate and up in one loop (bench/moe_rows_variants.py's `q4k combined`,
# 8 rows a program and 4 warps: 22.4 us against the byte form's 27.2 with one busy slot, 63.6 against 75.6 with 4, on
# an H100, before quant_tiles._exact_float took the byte form's slow conversions out; docs/PERFORMANCE.md).
ROWS_GATE_UP_Q4K = dict(BLOCK_N=8, num_warps=4)
# FP8_B128 in words (a 32-bit load per four values): the best of bench/moe_rows_variants.py --fp8 --sweep on an
# H100 with one busy row (gate/up 35.6 us against 43.2 at the byte form's tiling, down 20.9 against 26.9;
# docs/PERFORMANCE.md).
ROWS_GATE_UP_WORDS = dict(BLOCK_N=8, GROUPS=8, num_warps=4)
ROWS_DOWN = {"halves": dict(BLOCK_N=32, GROUPS=4, num_warps=4), "groups": dict(BLOCK_N=16, GROUPS=4, num_warps=4),
             "words": dict(BLOCK_N=16, GROUPS=4, num_warps=2)}
# Prefill: from this many pairs per expert on average (a 3277-token chunk of the full model: 512 experts, top-10),
# a quantized stack is dequantized whole for the chunk (dequantized_for). Below it the GEMMs dequantize their
# tiles: one row block (GROUPED_BLOCK_M = 64 pairs) an expert dequantizes each tile once, which costs less than
# writing the dense twin and reading it again (docs/PERFORMANCE.md: the full model's Q4_K gate/up at 128, 512 and
# 2048 tokens, 1.9-2.1 ms a layer against 2.9-3.0 ms dequantized whole).
DENSE_FROM = 64
# The prompt GEMMs' launch configs over blocks where they differ from the dense kernels' (moe.grouped_configs), by
# (product, type, row block: moe.SMALL_BLOCK_M 16 or GROUPED_BLOCK_M 64): a tile dequantized in registers is not
# streamed by cp.async as a dense one is, and more pipeline stages only cost it registers and shared memory. The
# fastest of bench/grouped_tile_variants.py --configs at the full model's shapes on an H100, 128, 512 and 2048 tokens
# (docs/PERFORMANCE.md: FP8_B128 gate/up 1.89 -> 1.17 ms a layer at 128 tokens, down 1.11 -> 0.56; Q8_0 down 0.80 ->
# 0.52); types not measured keep the dense configs.
GROUPED_OVER_BLOCKS = {
    ("gate/up", "Q4_K", 16): dict(BLOCK_N=32), ("gate/up", "Q4_K", 64): dict(num_stages=1),
    ("gate/up", "FP8_B128", 16): dict(num_stages=1), ("gate/up", "FP8_B128", 64): dict(num_stages=1),
    ("down", "Q5_1", 16): dict(BLOCK_N=32), ("down", "Q5_1", 64): dict(num_stages=1),
    ("down", "Q8_0", 16): dict(num_stages=1, num_warps=8), ("down", "Q8_0", 64): dict(num_stages=1, num_warps=8),
    ("down", "FP8_B128", 16): dict(num_stages=1), ("down", "FP8_B128", 64): dict(num_stages=1),
}


if triton is not None:
    from .expert_groups import tile_of, tile_pairs
    from .quant_tiles import (LANES, dequantize_groups, dequantize_halves, fp8_b128_words, halves_columns,
                              halves_tile, q4k_block_halves, q4k_quarter_tile, weight_tile)
    from .rounding import round_to, silu_mul

    @triton.jit
    def _row_products(w_rows, feat_ok, v_row, length, grid_ptr, QTYPE: tl.constexpr, FORM: tl.constexpr,
                      GROUPS: tl.constexpr, BLOCK_N: tl.constexpr):
        """The float32 products w_n . v of BLOCK_N weight rows (`w_rows` [BLOCK_N, 1, 1] byte pointers, `feat_ok`
        which exist) with the `length` values at `v_row`, GROUPS 32-value blocks a step: read as two runs of 16
        values each (FORM "halves"), as 32-bit words of four values (FP8_B128's "words") or a byte a value
        ("groups")."""
        if FORM == "halves":
            step = tl.arange(0, GROUPS)[None, :, None]
            i = tl.arange(0, LANES // 2)[None, None, :]
            acc = tl.zeros([BLOCK_N, GROUPS, LANES // 2], dtype=tl.float32)
            for first in range(0, length // LANES, GROUPS):
                block = first + step
                exists = block < length // LANES
                low, high = dequantize_halves(w_rows, block, i, feat_ok & exists, grid_ptr, QTYPE)
                low_col, high_col = halves_columns(block, i, QTYPE)
                acc += low * tl.load(v_row + low_col, mask=exists, other=0.0).to(tl.float32)
                acc += high * tl.load(v_row + high_col, mask=exists, other=0.0).to(tl.float32)
        elif FORM == "words":
            tl.static_assert(QTYPE == "FP8_B128", "the words form reads FP8_B128")
            group = (tl.arange(0, GROUPS) * LANES)[None, :, None]
            word = tl.arange(0, LANES // 4)[None, None, :]
            lane = (word * 4)[:, :, :, None] + tl.arange(0, 4)[None, None, None, :]     # a word's byte's column
            acc_words = tl.zeros([BLOCK_N, GROUPS, LANES // 4, 4], dtype=tl.float32)
            for start in range(0, length, GROUPS * LANES):
                col = start + group
                col_ok = col < length
                v = tl.load(v_row + col[:, :, :, None] + lane, mask=col_ok[:, :, :, None], other=0.0)
                acc_words += fp8_b128_words(w_rows, col, word, feat_ok & col_ok) * v.to(tl.float32)
            acc = tl.sum(acc_words, axis=3)                    # [BLOCK_N, GROUPS, words], summed as the others below
        else:
            group = (tl.arange(0, GROUPS) * LANES)[None, :, None]
            lane = tl.arange(0, LANES)[None, None, :]
            acc = tl.zeros([BLOCK_N, GROUPS, LANES], dtype=tl.float32)
            for start in range(0, length, GROUPS * LANES):
                col = start + group
                col_ok = col < length
                v = tl.load(v_row + col + lane, mask=col_ok, other=0.0).to(tl.float32)
                acc += dequantize_groups(w_rows, col, lane, feat_ok & col_ok, grid_ptr, QTYPE) * v
        return tl.sum(tl.sum(acc, axis=2), axis=1)

    # top_k is not specialized: engine/hot_experts.py runs pairs as rows of one slot each, which would make 1
    # a binary of its own, built on a request's path.
    @triton.jit(do_not_specialize=["top_k"])
    def _rows_gate_up_blocks_kernel(x_ptr, ids_ptr, active_ptr, w_ptr, grid_ptr, h_ptr, hidden, inter, top_k, row_bytes,
                                    QTYPE: tl.constexpr, INTERPRETED: tl.constexpr, HAS_ACTIVE: tl.constexpr,
                                    FORM: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
        """h[pair, n] = silu(gate_n . x_row) * (up_n . x_row) for one (row, slot) pair and BLOCK_N features."""
        pair = tl.program_id(0)
        row = pair // top_k
        if HAS_ACTIVE:
            if tl.load(active_ptr + row) == 0:
                return
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        feat = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        feat_ok = (feat < inter)[:, None, None]
        gate_rows = w_ptr + ((expert * 2 * inter + feat) * row_bytes)[:, None, None]
        x_row = x_ptr + row.to(tl.int64) * hidden
        gate = _row_products(gate_rows, feat_ok, x_row, hidden, grid_ptr, QTYPE, FORM, GROUPS, BLOCK_N)
        up = _row_products(gate_rows + inter * row_bytes, feat_ok, x_row, hidden, grid_ptr, QTYPE, FORM, GROUPS,
                           BLOCK_N)
        h = silu_mul(gate, up, h_ptr.dtype.element_ty, INTERPRETED)
        tl.store(h_ptr + pair.to(tl.int64) * inter + feat, h, mask=feat < inter)

    @triton.jit(do_not_specialize=["top_k"])   # as the kernel above
    def _rows_gate_up_q4k_kernel(x_ptr, ids_ptr, active_ptr, w_ptr, h_ptr, hidden, inter, top_k, row_bytes,
                                 INTERPRETED: tl.constexpr, HAS_ACTIVE: tl.constexpr, BLOCK_N: tl.constexpr):
        """_rows_gate_up_blocks_kernel over Q4_K: a 256-value block of BLOCK_N gate rows and of their up rows a step,
        both in one loop, each block's 128 quant bytes as [4, 32] runs and its scale fields as 32-bit words."""
        pair = tl.program_id(0)
        row = pair // top_k
        if HAS_ACTIVE:
            if tl.load(active_ptr + row) == 0:
                return
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        feat = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = feat < inter
        gate_rows = w_ptr + (expert * 2 * inter + feat) * row_bytes
        up_rows = gate_rows + inter * row_bytes
        quarter = tl.arange(0, 4)[None, :, None]
        lane = tl.arange(0, LANES)[None, None, :]
        x_row = x_ptr + row.to(tl.int64) * hidden
        acc_gate = tl.zeros([BLOCK_N, 4, LANES], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, 4, LANES], dtype=tl.float32)
        for block in range(0, hidden // 256):
            x_lo = tl.load(x_row + block * 256 + quarter * 64 + lane).to(tl.float32)       # sub-blocks 0, 2, 4, 6
            x_hi = tl.load(x_row + block * 256 + quarter * 64 + 32 + lane).to(tl.float32)  # 1, 3, 5, 7
            g_lo, g_hi = q4k_block_halves(gate_rows, block * 144, lane, ok)
            u_lo, u_hi = q4k_block_halves(up_rows, block * 144, lane, ok)
            acc_gate += g_lo * x_lo
            acc_gate += g_hi * x_hi
            acc_up += u_lo * x_lo
            acc_up += u_hi * x_hi
        h = silu_mul(tl.sum(tl.sum(acc_gate, axis=2), axis=1), tl.sum(tl.sum(acc_up, axis=2), axis=1),
                     h_ptr.dtype.element_ty, INTERPRETED)
        tl.store(h_ptr + pair.to(tl.int64) * inter + feat, h, mask=ok)

    @triton.jit(do_not_specialize=["top_k"])   # as the gate/up kernel's
    def _rows_down_blocks_kernel(h_ptr, ids_ptr, weights_ptr, active_ptr, w_ptr, grid_ptr, y_ptr, hidden, inter, top_k,
                                 row_bytes, QTYPE: tl.constexpr, INTERPRETED: tl.constexpr, HAS_ACTIVE: tl.constexpr,
                                 FORM: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
        """y[pair, n] = weight[pair] * (down_n . h[pair]) in float32, for BLOCK_N output features."""
        pair = tl.program_id(0)
        row = pair // top_k
        if HAS_ACTIVE:
            if tl.load(active_ptr + row) == 0:
                return
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        feat = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        feat_ok = (feat < hidden)[:, None, None]
        w_rows = w_ptr + ((expert * hidden + feat) * row_bytes)[:, None, None]
        h_row = h_ptr + pair.to(tl.int64) * inter
        y = _row_products(w_rows, feat_ok, h_row, inter, grid_ptr, QTYPE, FORM, GROUPS, BLOCK_N)
        y = y * tl.load(weights_ptr + pair).to(tl.float32)
        tl.store(y_ptr + pair.to(tl.int64) * hidden + feat, y, mask=feat < hidden)

    @triton.jit(do_not_specialize=["num_pairs"])   # a prompt's length changes it: one binary for all
    def _grouped_gate_up_blocks_kernel(x_ptr, pair_of_row_ptr, expert_of_block_ptr, w_ptr, grid_ptr, h_ptr,
                                       num_pairs, num_experts, hidden, inter, top_k, row_bytes, QTYPE: tl.constexpr,
                                       INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                       BLOCK_K: tl.constexpr):
        """moe.py's grouped gate/up GEMM with each weight tile dequantized from the expert's blocks."""
        block_m, expert, feat = tile_of(tl.program_id(0), inter, expert_of_block_ptr, BLOCK_N)
        if expert >= num_experts:
            return
        dtype = h_ptr.dtype.element_ty
        rows, pair, pair_ok = tile_pairs(block_m, pair_of_row_ptr, num_pairs, BLOCK_M)
        token = tl.where(pair_ok, pair // top_k, 0).to(tl.int64)
        feat_ok = (feat < inter)[None, None, :]
        gate_rows = w_ptr + ((expert * 2 * inter + feat) * row_bytes)[None, None, :]
        up_rows = gate_rows + inter * row_bytes
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + token[:, None] * hidden + ks[None, :]
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, hidden, BLOCK_K):
            a = tl.load(x_ptrs, mask=pair_ok[:, None] & (ks < hidden - start)[None, :], other=0.0)
            gate = weight_tile(gate_rows, start, hidden, feat_ok, grid_ptr, dtype, QTYPE, INTERPRETED, BLOCK_K,
                               BLOCK_N)
            up = weight_tile(up_rows, start, hidden, feat_ok, grid_ptr, dtype, QTYPE, INTERPRETED, BLOCK_K, BLOCK_N)
            if INTERPRETED:
                a, gate, up = a.to(tl.float32), gate.to(tl.float32), up.to(tl.float32)
            acc_gate = tl.dot(a, gate, acc_gate)
            acc_up = tl.dot(a, up, acc_up)
            x_ptrs += BLOCK_K
        h = silu_mul(acc_gate, acc_up, dtype, INTERPRETED)
        tl.store(h_ptr + rows[:, None].to(tl.int64) * inter + feat[None, :], h, mask=(feat < inter)[None, :])

    @triton.jit(do_not_specialize=["num_pairs"])   # as the kernel above
    def _grouped_gate_up_q4k_kernel(x_ptr, pair_of_row_ptr, expert_of_block_ptr, w_ptr, h_ptr, num_pairs, num_experts,
                                    hidden, inter, top_k, row_bytes, INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr,
                                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """_grouped_gate_up_blocks_kernel over Q4_K: the same 64-value steps in the same order, walked as the four
        quarters of each 256-value block, so a tile's bytes sit at its block's start plus constants and load as
        vectors (quant_tiles.q4k_quarter_tile)."""
        tl.static_assert(BLOCK_K == 64, "a step is a quarter of a Q4_K block")
        block_m, expert, feat = tile_of(tl.program_id(0), inter, expert_of_block_ptr, BLOCK_N)
        if expert >= num_experts:
            return
        dtype = h_ptr.dtype.element_ty
        rows, pair, pair_ok = tile_pairs(block_m, pair_of_row_ptr, num_pairs, BLOCK_M)
        token = tl.where(pair_ok, pair // top_k, 0).to(tl.int64)
        feat_ok = (feat < inter)[None, :]
        gate_rows = w_ptr + ((expert * 2 * inter + feat) * row_bytes)[None, :]
        up_rows = gate_rows + inter * row_bytes
        x_ptrs = x_ptr + token[:, None] * hidden + tl.arange(0, BLOCK_K)[None, :]
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for block in range(0, hidden // 256):
            for c in tl.static_range(4):
                a = tl.load(x_ptrs, mask=pair_ok[:, None], other=0.0)
                gate = q4k_quarter_tile(gate_rows, block, c, feat_ok, dtype, INTERPRETED, BLOCK_N)
                up = q4k_quarter_tile(up_rows, block, c, feat_ok, dtype, INTERPRETED, BLOCK_N)
                if INTERPRETED:
                    a, gate, up = a.to(tl.float32), gate.to(tl.float32), up.to(tl.float32)
                acc_gate = tl.dot(a, gate, acc_gate)
                acc_up = tl.dot(a, up, acc_up)
                x_ptrs += BLOCK_K
        h = silu_mul(acc_gate, acc_up, dtype, INTERPRETED)
        tl.store(h_ptr + rows[:, None].to(tl.int64) * inter + feat[None, :], h, mask=(feat < inter)[None, :])

    @triton.jit(do_not_specialize=["num_pairs"])   # a prompt's length changes it: one binary for all
    def _grouped_down_blocks_kernel(h_ptr, pair_of_row_ptr, expert_of_block_ptr, weights_ptr, w_ptr, grid_ptr, y_ptr,
                                    num_pairs, num_experts, hidden, inter, row_bytes, QTYPE: tl.constexpr,
                                    INTERPRETED: tl.constexpr, FORM: tl.constexpr, BLOCK_M: tl.constexpr,
                                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """moe.py's grouped down GEMM with each weight tile dequantized from the expert's blocks: as two runs of 16
        values a block (FORM "halves", quant_tiles.halves_tile; _grouped_down_form says which types), or a byte a
        value."""
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
            if FORM == "halves":
                w = halves_tile(w_rows, start, inter, feat_ok[None, None, :], grid_ptr, dtype, QTYPE, INTERPRETED,
                                BLOCK_K, BLOCK_N)
            else:
                w = weight_tile(w_rows, start, inter, feat_ok[None, None, :], grid_ptr, dtype, QTYPE, INTERPRETED,
                                BLOCK_K, BLOCK_N)
            if INTERPRETED:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w, acc)
            h_ptrs += BLOCK_K
        route = tl.load(weights_ptr + pair, mask=pair_ok, other=0.0).to(tl.float32)
        y = round_to(acc * route[:, None], y_ptr.dtype.element_ty, INTERPRETED)
        safe_pair = tl.where(pair_ok, pair, 0).to(tl.int64)
        tl.store(y_ptr + safe_pair[:, None] * hidden + feat[None, :], y, mask=pair_ok[:, None] & feat_ok[None, :])


def _operands(stack) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(blocks, the level table, bytes per row) of a quantized stack."""
    blocks = stack.blocks
    if not blocks.is_contiguous():
        raise ValueError("a quantized expert stack's blocks must be contiguous")
    if blocks.data_ptr() % 2:        # the decode kernels read a block's fields as 16-bit words
        raise ValueError("a quantized expert stack's blocks must start 2-byte aligned")
    return blocks, grid_for(stack.qtype, blocks), blocks.shape[-1]


def rows_gate_up(x, ids, flags, stack, h, top_k: int, common: dict) -> None:
    """moe.py's decode gate/up launch for a quantized [E, 2I, H] stack."""
    blocks, grid_table, row_bytes = _operands(stack)
    pairs, inter = h.shape
    if _q4k_words_fit(stack):
        grid = (pairs, triton.cdiv(inter, ROWS_GATE_UP_Q4K["BLOCK_N"]))
        _rows_gate_up_q4k_kernel[grid](x, ids, flags, blocks, h, x.shape[1], inter, top_k, row_bytes, **common,
                                       **ROWS_GATE_UP_Q4K)
        return
    words = row_form(stack.qtype) == "words"         # no halves form for gate/up
    config = ROWS_GATE_UP_WORDS if words else ROWS_GATE_UP
    grid = (pairs, triton.cdiv(inter, config["BLOCK_N"]))
    _rows_gate_up_blocks_kernel[grid](x, ids, flags, blocks, grid_table, h, x.shape[1], inter, top_k, row_bytes,
                                      QTYPE=stack.qtype, FORM="words" if words else "groups", **common, **config)


def _q4k_words_fit(stack) -> bool:
    """Whether the Q4_K kernels that read a block's fields as 32-bit words take `stack` (the decode block-a-step
    kernel, the grouped quarter-block one): Q4_K rows whose words are 4-byte aligned. Shapes and addresses only."""
    return stack.qtype == "Q4_K" and stack.blocks.data_ptr() % 4 == 0 and stack.blocks.shape[-1] % 4 == 0


def rows_down(h, ids, weights, flags, stack, y, top_k: int, common: dict) -> None:
    """moe.py's decode down launch for a quantized [E, H, I] stack."""
    blocks, grid_table, row_bytes = _operands(stack)
    pairs, hidden = y.shape
    form = row_form(stack.qtype)
    config = ROWS_DOWN[form]
    grid = (pairs, triton.cdiv(hidden, config["BLOCK_N"]))
    _rows_down_blocks_kernel[grid](h, ids, weights, flags, blocks, grid_table, y, hidden, h.shape[1], top_k, row_bytes,
                                   QTYPE=stack.qtype, FORM=form, **common, **config)


def dequantized_for(stack, pairs: int) -> bool:
    """Whether a prompt chunk of `pairs` (token, slot) pairs runs over `stack` dequantized whole
    (quant_tiles.dequantize_stack: its dense twin, in a temporary) rather than over its blocks: when the chunk gives
    its experts at least DENSE_FROM pairs each on average, the grouped GEMMs stream dense tiles as they do for a
    dense model, instead of dequantizing each tile once per row block of its expert. Chosen by the shapes alone;
    part of the chunk's moe.GroupedForm (the twin's GEMMs round otherwise than the blocks' do)."""
    return not isinstance(stack, torch.Tensor) and pairs >= DENSE_FROM * stack.shape[0]


def grouped_config(product: str, stack, block_m: int, dense_config: dict) -> dict:
    """The launch config of the grouped `product` ("gate/up" or "down") over `stack` in row blocks of `block_m`:
    the dense kernels' with GROUPED_OVER_BLOCKS' entries for the stack's type laid over it."""
    return dense_config | GROUPED_OVER_BLOCKS.get((product, stack.qtype, block_m), {})


def grouped_gate_up(x, pair_of_row, expert_of_block, stack, h, pairs: int, top_k: int, config: dict,
                    common: dict) -> None:
    """moe.py's grouped gate/up launch for a quantized stack."""
    blocks, grid_table, row_bytes = _operands(stack)
    inter = h.shape[1]
    grid = (expert_of_block.numel() * triton.cdiv(inter, config["BLOCK_N"]),)
    if _q4k_words_fit(stack) and config["BLOCK_K"] == 64:     # the quarter kernel's steps are 64 values
        # A step of this kernel is four of the generic kernel's: each pipeline stage buffers four x tiles and gate's
        # and up's quant bytes (32 a row) and scale words (16 bytes a row) for each. Two stages run loads as far
        # ahead as the generic kernel's four, and leave an H100's or H200's SM room for two programs.
        stage = 4 * (common["BLOCK_M"] * 64 * x.element_size() + 2 * config["BLOCK_N"] * (32 + 16))
        config = config | {"num_stages": stages_for(x.device, stage, min(2, config["num_stages"]))}
        _grouped_gate_up_q4k_kernel[grid](x, pair_of_row, expert_of_block, blocks, h, pairs, blocks.shape[0],
                                          x.shape[1], inter, top_k, row_bytes, **common, **config)
        return
    _grouped_gate_up_blocks_kernel[grid](x, pair_of_row, expert_of_block, blocks, grid_table, h, pairs, blocks.shape[0],
                                  x.shape[1], inter, top_k, row_bytes, QTYPE=stack.qtype, **common, **config)


def grouped_down(h, pair_of_row, expert_of_block, weights, stack, y, pairs: int, config: dict,
                 common: dict) -> None:
    """moe.py's grouped down launch for a quantized stack."""
    blocks, grid_table, row_bytes = _operands(stack)
    hidden = y.shape[1]
    grid = (expert_of_block.numel() * triton.cdiv(hidden, config["BLOCK_N"]),)
    _grouped_down_blocks_kernel[grid](h, pair_of_row, expert_of_block, weights, blocks, grid_table, y, pairs,
                               blocks.shape[0], hidden, h.shape[1], row_bytes, QTYPE=stack.qtype,
                               FORM=_grouped_down_form(stack.qtype), **common, **config)


def _grouped_down_form(qtype: str) -> str:
    """How the grouped down GEMM reads a tile of `qtype`: in halves where the decode down product reads rows so
    (quant_tiles.row_form), but IQ4_NL a lane a value: its halves tile, whose levels are gathered from a table, asks
    a Strix Halo (gfx1151) for more LDS than a workgroup has (66 KiB at 16-pair row blocks,
    tests/test_kernel_builds.py); else through weight_tile (which reads FP8_B128 in words)."""
    return "halves" if row_form(qtype) == "halves" and qtype != "IQ4_NL" else "groups"
