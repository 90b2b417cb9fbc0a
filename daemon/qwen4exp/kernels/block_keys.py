"""QSA's indexer keys of the blocks a decode step completes, in two Triton kernels (CUDA and ROCm).

A decode step's token completes a block of `ratio` raw indexer keys when its position + 1 is a multiple of the
ratio; the block's key is their mean, normalised and rotated (the norm and the rotation are the backend's row-wise
kernels between these two). The torch form (Indexer.complete_blocks in engine/model/qsa.py) gathers, averages,
reads the old keys back and writes through a `where`, some eight launches a layer, and a verify step (speculative
decoding) ran it once per sub-step, since one state row's sub-steps could write the same block. Here:

* `block_means`: each row's last completed block's raw keys averaged (summed in float32 in one fixed order,
  rounded to the keys' dtype): a row's mean depends on its own keys alone, so a verify step's sub-steps get
  exactly the plain steps' means in one launch;
* `store_finished`: each row that completes its block writes the block's key; the others write nothing (so no
  two rows of a verify step write one block, and no old key is read back).
"""

from __future__ import annotations

import torch

from .guard import interpreted, tl, triton

if triton is not None:
    from .rounding import round_to

    @triton.jit(do_not_specialize=["capacity"])
    def _means_kernel(keys_ptr, state_rows_ptr, positions_ptr, out_ptr, capacity, RATIO: tl.constexpr,
                      DIM: tl.constexpr, INTERPRETED: tl.constexpr):
        """One row: the mean of the raw keys of the last block its position completes or completed."""
        row = tl.program_id(0).to(tl.int64)
        state_row = tl.load(state_rows_ptr + row).to(tl.int64)
        block = tl.maximum((tl.load(positions_ptr + row).to(tl.int64) + 1) // RATIO - 1, 0)
        token = block * RATIO + tl.arange(0, RATIO)
        d = tl.arange(0, DIM)
        raw = tl.load(keys_ptr + (state_row * capacity + token)[:, None] * DIM + d[None, :],
                      mask=(token < capacity)[:, None], other=0.0).to(tl.float32)
        mean = tl.sum(raw, axis=0) / RATIO
        tl.store(out_ptr + row * DIM + d, round_to(mean, out_ptr.dtype.element_ty, INTERPRETED))

    @triton.jit(do_not_specialize=["n_blocks"])
    def _store_kernel(blocks_ptr, state_rows_ptr, positions_ptr, active_ptr, pooled_ptr, n_blocks,
                      RATIO: tl.constexpr, DIM: tl.constexpr):
        """One row: its pooled key into its block, if its token completes the block."""
        row = tl.program_id(0).to(tl.int64)
        position = tl.load(positions_ptr + row).to(tl.int64)
        if (tl.load(active_ptr + row) != 0) & ((position + 1) % RATIO == 0):
            state_row = tl.load(state_rows_ptr + row).to(tl.int64)
            d = tl.arange(0, DIM)
            block = (position + 1) // RATIO - 1
            tl.store(blocks_ptr + (state_row * n_blocks + block) * DIM + d, tl.load(pooled_ptr + row * DIM + d))


def fits(dim: int, ratio: int) -> bool:
    """Whether the kernels take an indexer's key width and block size (powers of two)."""
    return dim & (dim - 1) == 0 and ratio & (ratio - 1) == 0


def _check(keys: torch.Tensor, state_rows: torch.Tensor, positions: torch.Tensor, ratio: int) -> None:
    dim = keys.shape[-1]
    if not fits(dim, ratio) or not keys.is_contiguous() or state_rows.shape != positions.shape:
        raise ValueError(f"block keys: the kernels take contiguous keys of a power-of-two width ({dim}), a "
                         f"power-of-two ratio ({ratio}) and a state row for each position")


def block_means(index_keys: torch.Tensor, state_rows: torch.Tensor, positions: torch.Tensor,
                ratio: int) -> torch.Tensor:
    """[T, dim] in the keys' dtype: for row t, the mean of state row state_rows[t]'s raw keys (index_keys [N,
    capacity, dim]) over the last block that positions[t] completes or completed (block 0 before the first)."""
    _check(index_keys, state_rows, positions, ratio)
    rows, (_, capacity, dim) = positions.numel(), index_keys.shape
    out = torch.empty(rows, dim, dtype=index_keys.dtype, device=index_keys.device)
    if rows:
        _means_kernel[(rows,)](index_keys, state_rows.contiguous(), positions.contiguous(), out, capacity,
                               RATIO=ratio, DIM=dim, INTERPRETED=interpreted(index_keys), num_warps=1)
    return out


def store_finished(block_keys: torch.Tensor, state_rows: torch.Tensor, positions: torch.Tensor,
                   active: torch.Tensor, pooled: torch.Tensor, ratio: int) -> None:
    """block_keys [N, n_blocks, dim][state_rows[t], block] = pooled[t] for each active row t whose position
    completes that block (positions[t] + 1 a multiple of `ratio`); nothing else is written."""
    _check(block_keys, state_rows, positions, ratio)
    rows, n_blocks, dim = positions.numel(), block_keys.shape[1], block_keys.shape[2]
    if pooled.shape != (rows, dim) or pooled.dtype != block_keys.dtype:
        raise ValueError(f"block keys: {tuple(pooled.shape)} {pooled.dtype} keys for {rows} rows of {dim} "
                         f"{block_keys.dtype}")
    if rows:
        _store_kernel[(rows,)](block_keys, state_rows.contiguous(), positions.contiguous(), active.to(torch.uint8),
                               pooled.contiguous(), n_blocks, RATIO=ratio, DIM=dim, num_warps=1)
