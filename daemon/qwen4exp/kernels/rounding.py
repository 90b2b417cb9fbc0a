"""Rounding helpers shared by our Triton kernels, so fused kernels round where torch's low-precision ops do, and
the end of a sum split over programs (`finish_parts`: the last program of an output block adds the parts)."""

from __future__ import annotations

import torch

from .guard import tl, triton


if triton is not None:

    @triton.jit
    def _bf16_bits(v):
        """float32 -> the float32 whose low 16 bits are cleared after rounding to nearest even: integer ops,
        so no compiler can fold a float round trip away or fuse it into an FMA."""
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def round_to(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
        """float32 -> dtype, to nearest even. Triton's CPU interpreter truncates to bfloat16 (3.9), so there
        the rounding is done on the bits; compiled kernels convert directly."""
        if INTERPRETED and dtype == tl.bfloat16:
            v = _bf16_bits(v)
        return v.to(dtype)

    @triton.jit
    def rounded(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
        """v rounded to dtype and back to float32: the value a torch op in dtype would hand on. For bfloat16
        on the bits: with a cast round trip (fp32 -> bf16 -> fp32), a compiled kernel's x + rounded(a * b)
        differed from torch's bf16 ops on an H200 by what a skipped product rounding gives."""
        if dtype == tl.bfloat16:
            return _bf16_bits(v)
        return v.to(dtype).to(tl.float32)

    @triton.jit
    def silu_mul(gate, up, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
        """gate, up float32 -> silu(gate) * up in `dtype`, rounded where torch's low-precision ops round."""
        gate = rounded(gate, dtype, INTERPRETED)
        up = rounded(up, dtype, INTERPRETED)
        act = rounded(gate / (1.0 + tl.exp(-gate)), dtype, INTERPRETED)
        return round_to(act * up, dtype, INTERPRETED)

    @triton.jit
    def finish_parts(part_sum, out_ptr, parts_ptr, counts_ptr, offsets, ok, block, part, size, PARTS: tl.constexpr,
                     DIVISOR: tl.constexpr, INTERPRETED: tl.constexpr):
        """A program's part of output block `block` goes to parts[part]; the last of the block's PARTS programs
        to get here adds them from zero in float32, in part order, divides and rounds once: one fixed sum whatever
        order the programs ran in, in the product's own launch. The block's count (`counts_ptr`, zero before the
        launch) is left at zero again."""
        tl.store(parts_ptr + part * size + offsets, part_sum, mask=ok)
        tl.debug_barrier()                       # every thread's part is written before the program is counted
        arrived = tl.atomic_add(counts_ptr + block, 1, sem="acq_rel")
        if arrived == PARTS - 1:
            total = tl.zeros(part_sum.shape, dtype=tl.float32)
            for p in tl.static_range(PARTS):     # from L2, where the other programs' stores went
                total += tl.load(parts_ptr + p * size + offsets, mask=ok, other=0.0, cache_modifier=".cg").to(
                    tl.float32)
            if DIVISOR != 1:
                total = total / DIVISOR
            tl.store(out_ptr + offsets, round_to(total, out_ptr.dtype.element_ty, INTERPRETED), mask=ok)
            tl.store(counts_ptr + block, 0)


_COUNTS: dict[torch.device, torch.Tensor] = {}
COUNTED_BLOCKS = 16384      # the LM head's blocks of 16 rows (248320 / 16 = 15520) fit: a bench splits it too


def part_counts(device: torch.device, grid: tuple[int, int]) -> torch.Tensor:
    """The zeroed int32 counts finish_parts takes for a launch of `grid` (output blocks, parts), one per block,
    kept per device: every finish_parts launch leaves them at zero, so the launches of one device share them as
    long as they run one after another, as the engine's do (one compute stream; CUDA-graph replays in its order).
    A launch of one part does not count. Made outside a graph capture, which would record the zeroing but not
    run it."""
    blocks, parts = grid
    if parts > 1 and blocks > COUNTED_BLOCKS:
        raise ValueError(f"a split product of {blocks} output blocks; finish_parts counts at most {COUNTED_BLOCKS}")
    device = torch.device(device)
    if device not in _COUNTS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("finish_parts' counts must be made before a CUDA graph captures their first use")
        _COUNTS[device] = torch.zeros(COUNTED_BLOCKS, dtype=torch.int32, device=device)
    return _COUNTS[device]
