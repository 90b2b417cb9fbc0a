"""Matrix products for the few rows of a decode step, at memory bandwidth, in Triton (CUDA and ROCm).

A decode step multiplies one row per slot (4 on the bench) by every weight of the model: ~3.3 GB of weights
for a few kFLOP each. cuBLAS picks GEMM tilings made for many rows there, and on an H200 its products of 4
rows ran at ~1 TB/s for the mid-sized weights (profile_step), against ~4.5 TB/s the memory can read. Here
each program streams a block of the weight's rows once and multiplies it with every input row on the tensor
cores (the rows padded to the MMA's 16, which costs nothing a memory-bound kernel notices). Weights with few
output rows and a long input (the hyper-connections' 324 x 10240) also split the input into parts, each
summed by a program of its own, and the last program of each block adds the parts in a fixed order.

Numerics: float32 sums, rounded once to the output dtype, as F.linear does; only the order inside a sum
differs. A row's result never reads another row's values and the blocks depend on the weight's shape alone,
so a row's output does not depend on the other rows (alone == together holds for the decode step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import guard
from .guard import interpreted, tl, triton
from .rounding import part_counts

MAX_ROWS = 16   # the MMA's row tile; more rows than that go to F.linear


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes x @ weight.T: one dtype, at most MAX_ROWS rows, a weight whose rows are
    contiguous."""
    return (weight.dtype == x.dtype and x.dim() == 2 and x.shape[0] <= MAX_ROWS and weight.dim() == 2
            and weight.stride(1) == 1)


def kernel_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` runs x @ weight.T in the kernel (else on cuBLAS, whose kernel follows the row count): every
    weight whose product fits. With its block shapes per weight (`plan`) it beat cuBLAS on the weights of few rows
    and the LM head, and on the 2048-65536-row projections taken together (two of them alone ~3% slower:
    docs/PERFORMANCE.md); and its rows are independent, so a verify step reads each weight once for up to MAX_ROWS
    rows, where a product on cuBLAS has to be repeated for each position to sum as a plain step does."""
    return fits(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T for a decode step: the kernel where it applies, else F.linear. Which one runs
    depends on the shapes alone, so every step of an engine sums alike."""
    return row_products(x, weight) if kernel_takes(x, weight) else F.linear(x, weight)


def is_projection(n: int) -> bool:
    """The 2048-65536-row weights (the Gated DeltaNet and attention projections, the shared expert's): many rows
    over a short input, where narrow tiles keep more loads in flight than `wide_tile_plan`'s."""
    return 2048 < n < 65536


def plan(n: int, k: int) -> dict:
    """Block shapes for an [n, k] weight (fixed per shape, so a restart or another row count sums alike)."""
    return narrow_tile_plan(n, k) if is_projection(n) else wide_tile_plan(n, k)


def wide_tile_plan(n: int, k: int) -> dict:
    """32 weight rows by 256 inputs a tile, for the weights of few rows (the MoE's stacks, QSA's, the
    hyper-connections') and the LM head. Enough programs to keep every SM's loads in flight: at least ~2 per SM
    on an H200's 132, splitting the input when the weight has too few rows for that."""
    block_n = 32       # the fastest, or within 1%, on every such shape
    programs = triton.cdiv(n, block_n)
    split = 1
    while programs * split < 264 and k // (split * 2) >= 1024:
        split *= 2
    return {"BLOCK_N": block_n, "BLOCK_K": 256, "SPLIT_K": split, "num_warps": 4, "num_stages": 4}


def narrow_tile_plan(n: int, k: int) -> dict:
    """16 weight rows by 128 inputs a tile and 2 warps, for the projections: the input split until ~4 programs
    per SM of 132, each part at least 512 inputs (over the six projections together, within 1% of the best of 144
    block shapes for each: bench/row_products_bench.py --grid)."""
    block_n = 16
    programs = triton.cdiv(n, block_n)
    split = 1
    while programs * split < 528 and k // (split * 2) >= 512:
        split *= 2
    return {"BLOCK_N": block_n, "BLOCK_K": 128, "SPLIT_K": split, "num_warps": 2, "num_stages": 4}


def fitted(config: dict, device: torch.device, itemsize: int) -> dict:
    """`config` with as many of its pipeline stages as fit on `device`: a stage holds a [MAX_ROWS, BLOCK_K] tile
    of x and a [BLOCK_K, BLOCK_N] tile of the weight."""
    stage = (MAX_ROWS + config["BLOCK_N"]) * config["BLOCK_K"] * itemsize
    return config | {"num_stages": guard.stages_for(device, stage, config["num_stages"])}


if triton is not None:
    from .rounding import finish_parts, round_to

    @triton.jit
    def _rows_kernel(x_ptr, w_ptr, out_ptr, parts_ptr, counts_ptr, rows, n, k, x_stride, w_stride, part_k,
                     INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        """out[:, block] = x @ w[block].T over the input's part `program_id(1)` (all of it when SPLIT_K is 1;
        else the block's SPLIT_K programs sum through parts: rounding.finish_parts)."""
        block = tl.program_id(0)
        part = tl.program_id(1)
        m = tl.arange(0, BLOCK_M)
        m_ok = m < rows
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        cols_ok = cols < n
        ks = tl.arange(0, BLOCK_K)
        begin = part * part_k
        end = tl.minimum(begin + part_k, k)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(begin, end, BLOCK_K):
            k_ok = start + ks < end
            x = tl.load(x_ptr + m[:, None].to(tl.int64) * x_stride + start + ks[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + cols[None, :].to(tl.int64) * w_stride + start + ks[:, None],
                        mask=k_ok[:, None] & cols_ok[None, :], other=0.0)
            if INTERPRETED:
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, w, acc)
        offsets = m[:, None].to(tl.int64) * n + cols[None, :]
        ok = m_ok[:, None] & cols_ok[None, :]
        if SPLIT_K == 1:
            tl.store(out_ptr + offsets, round_to(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=ok)
        else:
            finish_parts(acc, out_ptr, parts_ptr, counts_ptr, offsets, ok, block, part, rows * n, SPLIT_K, 1,
                         INTERPRETED)


def row_products(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T for M <= MAX_ROWS. `config` overrides `plan`'s block shapes (the bench
    compares them)."""
    rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or rows > MAX_ROWS:
        raise ValueError(f"row products need x [M <= {MAX_ROWS}, K] and weight [N, K]: got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    if rows == 0 or n == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    config, part_k, parts, grid = split_input(fitted(config or plan(n, k), x.device, x.element_size()), k, out)
    _rows_kernel[grid](x, weight, out, parts, part_counts(x.device, grid), rows, n, k, x.stride(0),
                       weight.stride(0), part_k, INTERPRETED=interpreted(x), BLOCK_M=MAX_ROWS, SPLIT_K=grid[1],
                       **config)
    return out


def split_input(config: dict, k: int, out: torch.Tensor) -> tuple[dict, int, torch.Tensor, tuple[int, int]]:
    """For a product into `out` [rows, n] over an input of k columns, split as `config` says: (the kernel's
    config without SPLIT_K, the columns a part holds (whole tiles of BLOCK_K), the float32 partial sums [parts,
    rows, n] (out itself when there is one part), the grid (blocks of features, parts))."""
    config = dict(config)
    split = config.pop("SPLIT_K")
    part_k = triton.cdiv(triton.cdiv(k, split), config["BLOCK_K"]) * config["BLOCK_K"]
    split = triton.cdiv(k, part_k)
    parts = torch.empty(split, *out.shape, device=out.device, dtype=torch.float32) if split > 1 else out
    return config, part_k, parts, (triton.cdiv(out.shape[1], config["BLOCK_N"]), split)
