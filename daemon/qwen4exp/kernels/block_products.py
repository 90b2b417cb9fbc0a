"""Matrix products with a weight kept as GGML blocks (the projections and the LM head of a quantized GGUF).

A weight kept quantized (engine/model/quantized.py's QuantizedStack: `blocks` uint8 [N, row bytes], `qtype`,
`shape` [N, K], `dtype`) never exists dense on the device between steps:

* a decode step's few rows (at most row_products.MAX_ROWS) run row_products.py's kernel over the blocks: each
  program streams the blocks of BLOCK_N weight rows once, dequantizes them in registers in tiles of whole
  32-value groups (quant_tiles.py), rounds them to x's dtype and multiplies them with every input row on the
  tensor cores, with plan's block shapes and input splits;
* more rows (a prompt chunk) multiply with the weight dequantized whole into a temporary in x's dtype
  (quant_tiles.dequantize_stack) through F.linear: a GEMM reads each weight tile once per tile of rows, and
  a dequantized tile costs more to make than a dense one costs to read.

Numerics: the values multiplied are the dense twin's (the dequantized weight in the model's dtype, bit for bit),
summed in float32 and rounded once, so each path gives what its dense form (row_products, F.linear) gives on
the twin: under Triton's interpreter bit for bit (tests/test_block_products.py). A row's result depends on that
row alone and the blocks on the weight's shape alone (alone == together holds for the decode step).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .guard import interpreted, tl, triton
from .quant_tiles import LAYOUTS, dequantize_stack, grid_for
from .rounding import part_counts
from . import row_products
from .row_products import MAX_ROWS, fitted, split_input


def plan(n: int, k: int) -> dict:
    """row_products.wide_tile_plan's block shapes with half its input tile: dequantizing costs registers and
    instructions a value, and 128 columns a tile ran 10-20% faster than 256 over Q8_0 blocks at every shape of the
    bench preset's projections but the smallest (bench/row_products_bench.py --qtype; docs/PERFORMANCE.md). Any
    multiple of 32 columns holds whole groups of every block type, which is all the tile's dequantization needs."""
    return row_products.wide_tile_plan(n, k) | {"BLOCK_K": 128}


def kernel_takes(x: torch.Tensor) -> bool:
    """Whether `linear` runs x's rows in the kernel (else F.linear on the dequantized weight)."""
    return math.prod(x.shape[:-1]) <= MAX_ROWS


def linear(x: torch.Tensor, stack) -> torch.Tensor:
    """x [..., K] @ stack[N, K].T in x's dtype: the kernel for at most MAX_ROWS rows, else F.linear on the
    dequantized weight. Which one runs depends on the shapes alone."""
    if kernel_takes(x):
        rows = x.reshape(-1, x.shape[-1])
        return block_row_products(rows, stack.blocks, stack.qtype).reshape(*x.shape[:-1], stack.shape[0])
    return F.linear(x, dequantize_stack(stack))


if triton is not None:
    from .quant_tiles import weight_tile
    from .rounding import finish_parts, round_to

    # The counts of rows and features are not specialized on (a launch's rows are 1..MAX_ROWS), which keeps the
    # builds ahead of time few; the row length, row bytes and part are, as their divisibility lets loads vectorize.
    # `quants_at` (Q8_0_R's: where a row's quants start, k / 16) is an argument, not computed here, so Triton sees
    # that it is a multiple of 16 and loads the quants in 16-byte vectors through the pipeline.
    @triton.jit(do_not_specialize=["rows", "n"])
    def _block_rows_kernel(x_ptr, w_ptr, grid_ptr, out_ptr, parts_ptr, counts_ptr, rows, n, k, x_stride, row_bytes,
                           part_k, quants_at, QTYPE: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
        """out[:, block] = x @ w[block].T over the input's part `program_id(1)` (all of it when SPLIT is 1; else
        the block's SPLIT programs sum through parts: rounding.finish_parts), w's rows dequantized from their
        blocks."""
        block = tl.program_id(0)
        part = tl.program_id(1)
        m = tl.arange(0, BLOCK_M)
        m_ok = m < rows
        feats = block * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = w_ptr + (feats.to(tl.int64) * row_bytes)[None, None, :]
        ks = tl.arange(0, BLOCK_K)
        begin = part * part_k
        end = tl.minimum(begin + part_k, k)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(begin, end, BLOCK_K):
            x = tl.load(x_ptr + m[:, None].to(tl.int64) * x_stride + start + ks[None, :],
                        mask=m_ok[:, None] & (start + ks < end)[None, :], other=0.0)
            if QTYPE == "Q8_0_R":             # the tile [BLOCK_K, BLOCK_N] straight from the split rows
                rows_at = w_ptr + feats.to(tl.int64) * row_bytes
                ok = (feats < n)[None, :] & (start + ks < end)[:, None]
                q = tl.load(rows_at[None, :] + quants_at + start + ks[:, None], mask=ok, other=0)
                groups = tl.arange(0, BLOCK_K // 32)
                scale = tl.load(rows_at.to(tl.pointer_type(tl.float16))[None, :] + start // 32 + groups[:, None],
                                mask=(feats < n)[None, :] & (start + groups * 32 < end)[:, None], other=0.0)
                w = tl.reshape(tl.reshape(q.to(tl.int8, bitcast=True).to(tl.float32), [BLOCK_K // 32, 32, BLOCK_N])
                               * scale.to(tl.float32)[:, None, :], [BLOCK_K, BLOCK_N])
                w = round_to(w, x_ptr.dtype.element_ty, INTERPRETED)
            else:
                w = weight_tile(w_rows, start, end, (feats < n)[None, None, :], grid_ptr, x_ptr.dtype.element_ty,
                                QTYPE, INTERPRETED, BLOCK_K, BLOCK_N)
            if INTERPRETED:
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, w, acc)
        offsets = m[:, None].to(tl.int64) * n + feats[None, :]
        ok = m_ok[:, None] & (feats < n)[None, :]
        if SPLIT == 1:
            tl.store(out_ptr + offsets, round_to(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=ok)
        else:
            finish_parts(acc, out_ptr, parts_ptr, counts_ptr, offsets, ok, block, part, rows * n, SPLIT, 1,
                         INTERPRETED)


def block_row_products(x: torch.Tensor, blocks: torch.Tensor, qtype: str, config: dict | None = None) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] @ W.T for W [N, K] kept as `qtype` blocks (uint8 [N, row bytes]). `config`
    overrides plan's block shapes (the bench compares them)."""
    values, size = LAYOUTS[qtype]
    rows, k = x.shape
    n = blocks.shape[0]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] * values != k * size or rows > MAX_ROWS:
        raise ValueError(f"block row products need x [M <= {MAX_ROWS}, K] and {qtype} blocks [N, K / {values} * "
                         f"{size}]: got x {tuple(x.shape)}, blocks {blocks.dtype} {tuple(blocks.shape)}")
    out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    if rows == 0 or n == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    blocks = blocks if blocks.is_contiguous() else blocks.contiguous()
    # A part holds whole tiles of BLOCK_K (whole 32-value groups, the unit a tile dequantizes).
    config, part_k, parts, grid = split_input(fitted(config or plan(n, k), x.device, x.element_size()), k, out)
    _block_rows_kernel[grid](x, blocks, grid_for(qtype, blocks), out, parts, part_counts(x.device, grid), rows, n,
                             k, x.stride(0), blocks.shape[1], part_k, k // 16, QTYPE=qtype, INTERPRETED=interpreted(x),
                             BLOCK_M=MAX_ROWS, SPLIT=grid[1], **config)
    return out
