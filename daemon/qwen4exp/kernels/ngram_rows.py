"""PLE's n-gram table rows as one Triton kernel (CUDA and ROCm): each token's predecessors within its EOS-delimited
segment, their hashes for every n-gram order and head, and the rows of the table those hashes pick.

The torch form (engine/model/ple.py, NGramEmbedding) takes some fifty operators for a prompt chunk (the EOS
segments found with a running maximum, each shift gathered, each order hashed and reduced per head) and some
twenty for a decode step: for a short prompt chunk those launches cost more host time than their work, and in a
replayed decode step each is a kernel of its own. Here one program takes BLOCK tokens of one history row and
writes their rows [count, heads].

Exactness: integer arithmetic only, as the torch form's: products wrap in int64 the same way, the xor and the
reduction modulo each head's table size (made non-negative, as torch.remainder's is) give the same rows, so
the kernel and the torch form agree exactly wherever either runs.
"""

from __future__ import annotations

import torch

from .guard import tl, triton

BLOCK = 128     # tokens a program


if triton is not None:

    # One binary for every prompt length: the lengths are not specialized (a new length compiles nothing)
    @triton.jit(do_not_specialize=["length", "count"])
    def _ngram_rows_kernel(history_ptr, multipliers_ptr, sizes_ptr, offsets_ptr, out_ptr, length, count, eos,
                           NGRAM: tl.constexpr, HEADS_PER_NGRAM: tl.constexpr, BLOCK: tl.constexpr):
        """out[r, i, head] for the last `count` positions of history row r (`length` ids a row)."""
        heads = (NGRAM - 1) * HEADS_PER_NGRAM
        r = tl.program_id(1).to(tl.int64)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < count
        position = length - count + i
        row = history_ptr + r * length
        mixed = tl.load(row + position, mask=ok, other=0) * tl.load(multipliers_ptr)
        crossed = i < 0                          # an EOS between the token and the predecessor s back
        out = out_ptr + (r * count + i) * heads
        for s in tl.static_range(1, NGRAM):
            before = tl.load(row + position - s, mask=ok & (position >= s), other=eos)
            crossed = crossed | (before == eos)
            mixed = mixed ^ (tl.where(crossed, eos, before) * tl.load(multipliers_ptr + s))
            for h in tl.static_range(HEADS_PER_NGRAM):
                head = (s - 1) * HEADS_PER_NGRAM + h
                size = tl.load(sizes_ptr + head)
                rest = mixed % size                     # C's remainder: the dividend's sign
                rest = tl.where(rest < 0, rest + size, rest)
                tl.store(out + head, rest + tl.load(offsets_ptr + head), mask=ok)


def ngram_rows(history: torch.Tensor, count: int, eos: int, multipliers: torch.Tensor, sizes: torch.Tensor,
               offsets: torch.Tensor) -> torch.Tensor:
    """Table rows [R, count, heads] (int64) of the last `count` tokens of each history row [R, length] (int64 ids,
    the oldest first; a token's predecessors are the ids before it in its row, up to the row's start, which
    reads as EOS), as NGramEmbedding's torch form gives them: `multipliers` [ngram_size], `sizes` and `offsets`
    [heads] (its buffers), heads = (ngram_size - 1) x heads a order."""
    rows, length = history.shape
    ngram = multipliers.numel()
    heads = sizes.numel()
    if not 0 < count <= length or ngram < 2 or heads % (ngram - 1) or history.dtype != torch.int64:
        raise ValueError(f"ngram_rows takes int64 history rows of at least `count` ids and heads a multiple of "
                         f"ngram_size - 1: got {history.dtype} {tuple(history.shape)}, count {count}, "
                         f"{ngram} multipliers, {heads} heads")
    history = history.contiguous()
    out = torch.empty(rows, count, heads, dtype=torch.int64, device=history.device)
    if rows:
        _ngram_rows_kernel[(triton.cdiv(count, BLOCK), rows)](
            history, multipliers, sizes, offsets, out, length, count, eos, NGRAM=ngram,
            HEADS_PER_NGRAM=heads // (ngram - 1), BLOCK=BLOCK, num_warps=4)
    return out
