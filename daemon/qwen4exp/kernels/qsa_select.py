"""Each QSA query's token list straight from its ranking keys: one Triton program per query.

`qsa_attention.rank_blocks` writes a key per (query, block): the score's float32 bits in the high word, the
reversed block index in the low word, -1 for blocks the query does not see. The list is the tokens of the
top `k` keys (best scores, ties to the earlier block: `Indexer.select_mask`'s stable sort) in block order, then
the incomplete tail block. torch.topk took those keys (a radix select that spends 2 bits per pass on 64-bit
keys, over the engine's whole capacity), a sort put them back in block order and six more ops expanded them
to tokens: in a decode step on the H200, ~60 us per QSA layer at an 8192-token capacity and more as it
grows, where this kernel takes ~11 us (docs/PERFORMANCE.md).

Here a query's program finds the k-th best score by a radix select over the score word (four 8-bit digits,
each a histogram of the blocks still in the running), then walks its visible blocks in order and keeps those
above that score and the earliest ones equal to it, writing each kept block's `ratio` tokens where a running
count puts them: ascending, with no sort. It reads only the blocks the query sees, so a short sequence in a
long engine pays for its length. The tokens and flags are those of `qsa.token_lists` over the sorted top k;
entries past a short list's visible blocks (it has fewer than k) hold token 0, flagged invalid.
"""

from __future__ import annotations

import torch

from .guard import tl, triton

# Blocks per loop step (histogram and compaction) and warps per query's program.
SELECT_TILE = 2048
SELECT_WARPS = 8

if triton is not None:

    @triton.jit
    def _select_kernel(keys_ptr, complete_ptr, positions_ptr, index_ptr, valid_ptr, n_blocks, capacity,
                       K: tl.constexpr, RATIO: tl.constexpr, TILE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        keys_row = keys_ptr + row * n_blocks
        width = K * RATIO + RATIO
        complete = tl.load(complete_ptr + row).to(tl.int32)
        position = tl.load(positions_ptr + row).to(tl.int32)
        seen = tl.minimum(complete, n_blocks)          # the blocks with a key >= 0
        lanes = tl.arange(0, TILE)
        bins = tl.arange(0, 256)
        within = tl.arange(0, RATIO)

        # The k-th best score (or the lowest, when the query sees k blocks or fewer: all are kept), one 8-bit
        # digit at a time from the top; `need` ends as how many blocks scoring exactly that are kept.
        need = tl.minimum(seen, K)
        prefix = tl.zeros([], tl.int64)
        for shift in tl.static_range(24, -8, -8):
            counts = tl.zeros([256], tl.int32)
            for start in range(0, seen, TILE):
                offs = start + lanes
                key = tl.load(keys_row + offs, mask=offs < seen, other=-1)
                score = key >> 32
                running = (key >= 0) & ((score >> (shift + 8)) == prefix)
                digits = ((score >> shift) & 255).to(tl.int32)
                counts += tl.histogram(tl.where(running, digits, 0), 256)
                # Blocks out of the running were counted in bin 0 above.
                counts -= tl.where(bins == 0, TILE - tl.sum(running.to(tl.int32), axis=0), 0)
            at_least = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts   # digit >= bin
            digit = tl.max(tl.where(at_least >= need, bins, 0), axis=0)
            need -= tl.sum(tl.where(bins > digit, counts, 0), axis=0)
            prefix = prefix * 256 + digit
        threshold = prefix

        # Blocks above the threshold, and the first `need` at it, in block order.
        taken = tl.zeros([], tl.int32)
        tied = tl.zeros([], tl.int32)
        for start in range(0, seen, TILE):
            offs = start + lanes
            key = tl.load(keys_row + offs, mask=offs < seen, other=-1)
            score = key >> 32
            visible = key >= 0
            tie = (visible & (score == threshold)).to(tl.int32)
            kept = (visible & (score > threshold)) | ((tie != 0) & (tied + tl.cumsum(tie, axis=0) - tie < need))
            kept_i = kept.to(tl.int32)
            slot = taken + tl.cumsum(kept_i, axis=0) - kept_i
            where = slot[:, None] * RATIO + within[None, :]
            tl.store(index_ptr + row * width + where, (offs[:, None] * RATIO + within[None, :]).to(tl.int32),
                     mask=kept[:, None])
            tl.store(valid_ptr + row * width + where, tl.full([TILE, RATIO], 1, tl.int1), mask=kept[:, None])
            taken += tl.sum(kept_i, axis=0)
            tied += tl.sum(tie, axis=0)
        # The rest of the k blocks' entries (fewer visible blocks than k), then the tail block up to the query.
        for start in range(0, K * RATIO, TILE):
            offs = start + lanes
            unused = (offs >= taken * RATIO) & (offs < K * RATIO)
            tl.store(index_ptr + row * width + offs, tl.zeros([TILE], tl.int32), mask=unused)
            tl.store(valid_ptr + row * width + offs, tl.zeros([TILE], tl.int1), mask=unused)
        tail = complete * RATIO + within
        tl.store(index_ptr + row * width + K * RATIO + within, tl.minimum(tail, capacity - 1))
        tl.store(valid_ptr + row * width + K * RATIO + within, tail <= position)


def token_lists(keys: torch.Tensor, complete: torch.Tensor, positions: torch.Tensor, k: int, ratio: int,
                capacity: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(index int32, valid bool) [rows, k * ratio + ratio] for ranking keys [rows, n_blocks] (rank_blocks'),
    complete [rows] (blocks each query sees), positions [rows]; k <= n_blocks, ratio a power of two. `out`:
    contiguous tensors of that shape and those dtypes to write (rows of larger lists, say)."""
    rows, n_blocks = keys.shape
    if k > n_blocks or ratio & (ratio - 1):
        raise ValueError(f"token lists: k ({k}) must be at most the {n_blocks} blocks and ratio ({ratio}) a power "
                         f"of two")
    width = k * ratio + ratio
    if out is None:
        out = (torch.empty(rows, width, dtype=torch.int32, device=keys.device),
               torch.empty(rows, width, dtype=torch.bool, device=keys.device))
    index, valid = out
    if index.shape != (rows, width) or index.dtype != torch.int32 or valid.shape != (rows, width) \
            or valid.dtype != torch.bool or not (index.is_contiguous() and valid.is_contiguous()):
        raise ValueError(f"token lists: out must be contiguous int32 and bool tensors of shape {(rows, width)}")
    if rows:
        # The flags go in as bool: Triton stores them as bytes (a view as int8 does not survive torch.compile).
        _select_kernel[(rows,)](keys.contiguous(), complete.contiguous(), positions.contiguous(), index, valid,
                                n_blocks, capacity, K=k, RATIO=ratio, TILE=SELECT_TILE, num_warps=SELECT_WARPS)
    return index, valid
