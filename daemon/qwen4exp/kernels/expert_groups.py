"""A prompt chunk's (token, slot) pairs laid out by expert, as the grouped GEMMs read them: moe.py's over dense
expert stacks and moe_blocks.py's over GGML blocks. `group_pairs_by_expert` builds the layout with device ops
(no host synchronisation); `tile_of` and `tile_pairs` are a grouped kernel's view of it."""

from __future__ import annotations

import torch

from .guard import tl, triton


def group_pairs_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay the (token, slot) pairs (pair = token * k + slot) out by expert, each expert's group padded to a
    multiple of block_m, with device-side ops only (no host sync). Returns (pair_of_row [R],
    expert_of_block [R / block_m]) where R = block_m * (ceil(pairs / block_m) + num_experts) bounds the
    padded total: a padding row holds the pair count, and a block past the last group holds num_experts.
    Within a group the pairs keep ascending order (stable sort)."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    device = flat.device
    sorted_experts, order = torch.sort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync to size its output
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    group_start = torch.cumsum(counts, 0) - counts
    rank_in_group = torch.arange(pairs, device=device) - group_start[sorted_experts]
    destination = (padded_end - padded)[sorted_experts] + rank_in_group
    max_blocks = (pairs + block_m - 1) // block_m + num_experts
    pair_of_row = torch.full((max_blocks * block_m,), pairs, dtype=torch.int32, device=device)
    pair_of_row.scatter_(0, destination, order.to(torch.int32))
    block_start = torch.arange(max_blocks, device=device, dtype=torch.int64) * block_m
    expert_of_block = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return pair_of_row, expert_of_block


if triton is not None:

    @triton.jit
    def tile_of(pid, features, expert_of_block_ptr, BLOCK_N: tl.constexpr):
        """Program `pid`'s (row block, its expert, its BLOCK_N features). Program ids run over the feature blocks
        of one row block first, so the programs in flight share their rows and a few experts' weights through L2.
        A row block past the last group has expert num_experts: the grid is sized by an upper bound."""
        blocks_n = tl.cdiv(features, BLOCK_N)
        block_m = pid // blocks_n
        expert = tl.load(expert_of_block_ptr + block_m).to(tl.int64)
        return block_m, expert, (pid % blocks_n) * BLOCK_N + tl.arange(0, BLOCK_N)

    @triton.jit
    def tile_pairs(block_m, pair_of_row_ptr, num_pairs, BLOCK_M: tl.constexpr):
        """A row block's padded rows, the pair each holds, and which hold one (padding rows hold num_pairs)."""
        rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pair_of_row_ptr + rows)
        return rows, pair, pair < num_pairs
