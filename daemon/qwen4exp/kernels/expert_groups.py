"""A prompt chunk's (token, slot) pairs laid out by expert, as the grouped GEMMs read them: moe.py's over dense
expert stacks and moe_blocks.py's over GGML blocks. `group_pairs_by_expert` builds the layout on the device (a
stable sort and two kernels, no host synchronisation; `group_pairs_in_torch` is the same in torch's ops);
`tile_of` and `tile_pairs` are a grouped kernel's view of it.

Integers only, so the kernels' layout is the torch form's exactly (tests/test_moe_kernels.py). Why kernels: a
prompt chunk is launched from the host one kernel at a time, and a short chunk of the full model looks bound by
those launches rather than by its kernels (docs/PERFORMANCE.md); the torch form is some twenty a layer."""

from __future__ import annotations

import torch

from .guard import tl, triton


def group_pairs_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay the (token, slot) pairs (pair = token * k + slot) out by expert, each expert's group padded to a
    multiple of block_m, on the device (no host sync). Returns (pair_of_row [R], expert_of_block [R / block_m])
    where R = block_m * (ceil(pairs / block_m) + num_experts) bounds the padded total: a padding row holds the
    pair count, and a block past the last group holds num_experts. Within a group the pairs keep ascending order
    (stable sort). A stable sort, then each group's bounds (one program), then each row block's pairs."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    sorted_experts, order = torch.sort(flat, stable=True)
    max_blocks = (pairs + block_m - 1) // block_m + num_experts
    bounds = torch.empty(4, num_experts, dtype=torch.int64, device=flat.device)
    pair_of_row = torch.empty(max_blocks * block_m, dtype=torch.int32, device=flat.device)
    expert_of_block = torch.empty(max_blocks, dtype=torch.int32, device=flat.device)
    _group_bounds_kernel[(1,)](sorted_experts, bounds, pairs, num_experts, pairs.bit_length(), BLOCK_M=block_m,
                               BLOCK_E=triton.next_power_of_2(num_experts), num_warps=4)
    _row_blocks_kernel[(max_blocks,)](order, bounds, pair_of_row, expert_of_block, pairs, num_experts,
                                      num_experts.bit_length(), BLOCK_M=block_m, num_warps=1)
    return pair_of_row, expert_of_block


def group_pairs_in_torch(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """group_pairs_by_expert's layout in torch's device ops (the kernels' reference in tests)."""
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

    @triton.jit
    def _first_at_least(sorted_ptr, value, count, iterations):
        """For each lane of `value` (or the one value): the first index in sorted[0, count) whose value is >= it
        (count if none)."""
        low = tl.zeros_like(value)
        high = low + count
        for _ in range(iterations):       # bit_length(count) halvings close every interval
            middle = (low + high) // 2
            open_ = low < high
            below = open_ & (tl.load(sorted_ptr + middle, mask=open_ & (middle < count), other=0) < value)
            low = tl.where(below, middle + 1, low)
            high = tl.where(open_ & ~below, middle, high)
        return low

    # The pair and expert counts are not specialized on: one binary for every chunk length.
    @triton.jit(do_not_specialize=["pairs", "experts", "iterations"])
    def _group_bounds_kernel(sorted_ptr, bounds_ptr, pairs, experts, iterations, BLOCK_M: tl.constexpr,
                             BLOCK_E: tl.constexpr):
        """Each expert's group in the sorted pairs and in the padded rows: bounds[0] its first sorted index,
        bounds[1] its first row, bounds[2] the row after its padded group, bounds[3] its pair count."""
        expert = tl.arange(0, BLOCK_E).to(tl.int64)
        ok = expert < experts
        start = _first_at_least(sorted_ptr, expert, pairs, iterations)
        count = tl.where(ok, _first_at_least(sorted_ptr, expert + 1, pairs, iterations) - start, 0)
        padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        padded_end = tl.cumsum(padded, 0)
        tl.store(bounds_ptr + expert, start, mask=ok)
        tl.store(bounds_ptr + experts + expert, padded_end - padded, mask=ok)
        tl.store(bounds_ptr + 2 * experts + expert, padded_end, mask=ok)
        tl.store(bounds_ptr + 3 * experts + expert, count, mask=ok)

    @triton.jit(do_not_specialize=["pairs", "experts", "iterations"])
    def _row_blocks_kernel(order_ptr, bounds_ptr, pair_of_row_ptr, expert_of_block_ptr, pairs, experts, iterations,
                           BLOCK_M: tl.constexpr):
        """Row block program_id(0): its expert (the first whose padded group ends past the block's first row;
        `experts` past the last group) and the pair each of its rows holds (the pair count where none)."""
        block = tl.program_id(0).to(tl.int64)
        first_row = block * BLOCK_M
        expert = _first_at_least(bounds_ptr + 2 * experts, first_row + 1, experts, iterations)   # ends past it
        tl.store(expert_of_block_ptr + block, expert.to(tl.int32))
        at = tl.minimum(expert, experts - 1)
        rank = first_row + tl.arange(0, BLOCK_M) - tl.load(bounds_ptr + experts + at)   # >= 0: past the group's start
        held = rank < tl.where(expert < experts, tl.load(bounds_ptr + 3 * experts + at), 0)
        pair = tl.load(order_ptr + tl.load(bounds_ptr + at) + rank, mask=held, other=pairs)
        tl.store(pair_of_row_ptr + first_row + tl.arange(0, BLOCK_M), pair.to(tl.int32))
