"""QSA's indexer ranking and sparse attention as Triton kernels (CUDA and ROCm) for bfloat16/float16 models.

Each query attends to at most budget + ratio tokens (2052 on the shipped model), however long the prefix.
The torch forms in qsa.py run attention densely under a [chunk, prefix] mask in prefill (work and mask grow
with the prefix: a 4096-query chunk at a 64K prefix is 6.6 TFLOP and a 256 MiB mask per layer) and spend a
dozen kernels per layer on the gathered tokens in decode. Here:

* `rank_blocks`: every (query, block) pair's indexer score, sum over heads of relu(q_h . k_b) / sqrt(dim),
  written straight into the int64 keys that torch.topk ranks (score bits high, reversed block index low,
  so ties go to the earlier block as in the stable sort of `Indexer.select_mask`; -1 for blocks the query does
  not see yet). One pass, no [rows, blocks, heads] float32 work space; blocks past every row's visible
  count are not read, so decode pays for the sequences' lengths, not the engine's capacity.
* `sparse_attention`: each query row (and its K/V head's group of query heads) reads only the tokens of
  its index list: online softmax over tiles of gathered K/V, on the tensor cores, with the softmax weights
  carried to ~16 bits (flash attention rounds them to the model dtype). Decode splits each list over several
  programs (few rows would leave most of the GPU idle) and combines the parts.

A row's result depends only on its own inputs and index list, never on which rows share the launch, the
chunk it came in, or the prefix length beyond what it sees: warm == cold and alone == together hold.
"""

from __future__ import annotations

import math

import torch

from .guard import interpreted, tl, triton

# Prefill ranks 16 queries per program, so each block key tile serves 16 x heads rows of the product.
RANK_QUERIES = 16
RANK_BLOCKS = 64
# Attention: tokens per tile of the online softmax, warps per program, and list parts per row in decode.
ATTEND_TOKENS = 64
ATTEND_WARPS = 4
DECODE_SPLITS = 8


def fits(head_dim: int, heads: int, kv_heads: int, index_dim: int, index_heads: int) -> bool:
    """Whether a model's QSA shapes suit the kernels (tile dims are powers of two >= 16, tl.dot's smallest);
    others run the torch forms."""
    def tile(d: int) -> bool:
        return d >= 16 and d & (d - 1) == 0
    return tile(head_dim) and tile(index_dim) and heads % kv_heads == 0 and index_heads <= 64


if triton is not None:
    from .rounding import round_to

    # rows and n_blocks follow the prompt's length, key_rows a decode step's slots: one binary for all
    @triton.jit(do_not_specialize=["rows", "n_blocks", "key_rows"])
    def _rank_kernel(q_ptr, keys_ptr, complete_ptr, out_ptr, rows, n_blocks, keys_row_stride, key_rows,
                     sqrt_dim: tl.constexpr, HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, DIM: tl.constexpr,
                     QUERIES: tl.constexpr, BLOCK_B: tl.constexpr, INTERPRETED: tl.constexpr):
        """QUERIES query rows x BLOCK_B blocks. With one query per program each row may have its own block
        keys (keys_row_stride; row r's are those of r mod key_rows); the product's M is then the query's heads,
        padded."""
        first_row = tl.program_id(0) * QUERIES
        blocks = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        query = first_row + tl.arange(0, QUERIES)
        complete = tl.load(complete_ptr + query, mask=query < rows, other=0)
        visible = blocks[None, :] < complete[:, None]
        keys = tl.full((QUERIES, BLOCK_B), -1, tl.int64)
        if tl.program_id(1) * BLOCK_B < tl.max(complete, axis=0):
            m = tl.arange(0, QUERIES * HEADS_PAD)
            m_row, m_head = first_row + m // HEADS_PAD, m % HEADS_PAD
            d = tl.arange(0, DIM)
            q = tl.load(q_ptr + (m_row.to(tl.int64) * HEADS + m_head)[:, None] * DIM + d[None, :],
                        mask=((m_row < rows) & (m_head < HEADS))[:, None], other=0.0)
            k_base = keys_ptr + (first_row % key_rows).to(tl.int64) * keys_row_stride
            k = tl.load(k_base + blocks.to(tl.int64)[:, None] * DIM + d[None, :],
                        mask=(blocks < n_blocks)[:, None], other=0.0)
            if INTERPRETED:                      # the interpreter's dot takes no bfloat16
                q, k = q.to(tl.float32), k.to(tl.float32)
            s = tl.maximum(tl.dot(q, tl.trans(k)), 0.0)
            score = tl.sum(tl.reshape(s, (QUERIES, HEADS_PAD, BLOCK_B)), axis=1) / sqrt_dim + 0.0
            bits = score.to(tl.int32, bitcast=True).to(tl.int64)
            keys = tl.where(visible, (bits << 32) | (n_blocks - 1 - blocks).to(tl.int64)[None, :], keys)
        tl.store(out_ptr + query.to(tl.int64)[:, None] * n_blocks + blocks[None, :], keys,
                 mask=(query < rows)[:, None] & (blocks < n_blocks)[None, :])

    @triton.jit(do_not_specialize=["kv_rows"])
    def _attend_kernel(q_ptr, k_ptr, v_ptr, index_ptr, valid_ptr, out_ptr, part_ptr, stats_ptr, tokens,
                       per_split, kv_row_stride, kv_head_stride, kv_rows, scale: tl.constexpr, HEADS: tl.constexpr,
                       GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr,
                       BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, INTERPRETED: tl.constexpr):
        """One (query row, K/V head, list part): the group's query heads over the part's listed tokens (row r's
        K/V: those of r mod kv_rows, where each row has its own)."""
        row, kv_head, part = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
        heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
        in_group = tl.arange(0, GROUP_PAD) < GROUP
        d = tl.arange(0, DIM)
        q = tl.load(q_ptr + (row * HEADS + heads)[:, None] * DIM + d[None, :], mask=in_group[:, None], other=0.0)
        dtype = q.dtype
        if INTERPRETED:
            q = q.to(tl.float32)
        kv_row = row % kv_rows
        k_base = k_ptr + kv_row * kv_row_stride + kv_head * kv_head_stride
        v_base = v_ptr + kv_row * kv_row_stride + kv_head * kv_head_stride
        best = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        total = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, DIM), tl.float32)
        lo = part * per_split
        hi = tl.minimum(lo + per_split, tokens)
        for start in range(lo, hi, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            listed = offs < hi
            token = tl.load(index_ptr + row * tokens + offs, mask=listed, other=0).to(tl.int64)
            ok = listed & (tl.load(valid_ptr + row * tokens + offs, mask=listed, other=0) != 0)
            k = tl.load(k_base + token[:, None] * DIM + d[None, :], mask=ok[:, None], other=0.0)
            if INTERPRETED:
                k = k.to(tl.float32)
            s = tl.where(ok[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))
            new_best = tl.maximum(best, tl.max(s, axis=1))
            shift = tl.where(new_best == float("-inf"), 0.0, new_best)    # no valid token yet: keep zeros
            p = tl.exp(s - shift[:, None])
            fade = tl.exp(best - shift)
            total = total * fade + tl.sum(p, axis=1)
            v = tl.load(v_base + token[:, None] * DIM + d[None, :], mask=ok[:, None], other=0.0)
            # The weights in two parts of the model dtype (high, then the rest): ~16 bits of each weight reach
            # the products instead of flash attention's 8, for a second product on idle tensor cores.
            high = round_to(p, dtype, INTERPRETED)
            low = round_to(p - high.to(tl.float32), dtype, INTERPRETED)
            if INTERPRETED:
                high, low, v = high.to(tl.float32), low.to(tl.float32), v.to(tl.float32)
            acc = tl.dot(low, v, tl.dot(high, v, acc * fade[:, None]))
            best = new_best
        if SPLITS == 1:
            out = acc / total[:, None]
            tl.store(out_ptr + (row * HEADS + heads)[:, None] * DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=in_group[:, None])
        else:
            slot = (row * HEADS + heads) * SPLITS + part
            tl.store(part_ptr + slot[:, None] * DIM + d[None, :], acc, mask=in_group[:, None])
            tl.store(stats_ptr + slot * 2, best, mask=in_group)
            tl.store(stats_ptr + slot * 2 + 1, total, mask=in_group)

    @triton.jit
    def _combine_kernel(part_ptr, stats_ptr, out_ptr, DIM: tl.constexpr, SPLITS: tl.constexpr):
        """One (row, head): the parts' softmax sums rescaled to their common maximum."""
        slot = tl.program_id(0).to(tl.int64)
        parts = tl.arange(0, SPLITS)
        best = tl.load(stats_ptr + (slot * SPLITS + parts) * 2)
        total = tl.load(stats_ptr + (slot * SPLITS + parts) * 2 + 1)
        top = tl.max(best, axis=0)
        weight = tl.where(best == float("-inf"), 0.0, tl.exp(best - top))
        d = tl.arange(0, DIM)
        acc = tl.load(part_ptr + (slot * SPLITS + parts)[:, None] * DIM + d[None, :])
        out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(total * weight, axis=0)
        tl.store(out_ptr + slot * DIM + d, out.to(out_ptr.dtype.element_ty))


def rank_blocks(q: torch.Tensor, block_keys: torch.Tensor, complete: torch.Tensor) -> torch.Tensor:
    """Top-k keys int64 [rows, n_blocks] for queries q [rows, heads, dim] over block keys [n_blocks, dim]
    (one sequence) or [N, n_blocks, dim] (a row each: row r's are r mod N's, so a verify step's sub-steps, rows
    position-major, share their state row's); complete [rows]: the blocks each query sees."""
    rows, heads, dim = q.shape
    per_row = block_keys.dim() == 3
    n_blocks = block_keys.shape[-2]
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"indexer head dim {dim}: the kernel needs a power of two >= 16")
    block_keys = block_keys if block_keys.stride(-1) == 1 and block_keys.stride(-2) == dim \
        else block_keys.contiguous()
    if per_row and rows % block_keys.shape[0]:
        raise ValueError(f"rank_blocks: {rows} query rows do not share {block_keys.shape[0]} rows of block keys")
    out = torch.empty(rows, n_blocks, dtype=torch.int64, device=q.device)
    if rows == 0 or n_blocks == 0:
        return out
    queries = 1 if per_row else RANK_QUERIES
    heads_pad = triton.next_power_of_2(heads)
    if queries * heads_pad < 16:                 # tl.dot's smallest M
        heads_pad = 16 // queries
    grid = (triton.cdiv(rows, queries), triton.cdiv(n_blocks, RANK_BLOCKS))
    _rank_kernel[grid](q.contiguous(), block_keys, complete.to(torch.int32).contiguous(), out, rows, n_blocks,
                       block_keys.stride(0) if per_row else 0, block_keys.shape[0] if per_row else 1,
                       math.sqrt(dim), HEADS=heads, HEADS_PAD=heads_pad,
                       DIM=dim, QUERIES=queries, BLOCK_B=RANK_BLOCKS, INTERPRETED=interpreted(q), num_warps=4)
    return out


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor,
                     valid: torch.Tensor, scale: float, splits: int = 1) -> torch.Tensor:
    """q [rows, heads, dim]; keys/values [kv_heads, T, dim] (one sequence) or [N, kv_heads, T, dim] (a row each:
    row r's are r mod N's, as in rank_blocks); index/valid [rows, S]: the tokens each row attends to. Returns
    [rows, heads, dim] in q's dtype."""
    rows, heads, dim = q.shape
    per_row = keys.dim() == 4
    kv_heads = keys.shape[-3]
    if dim & (dim - 1) or dim < 16 or heads % kv_heads:
        raise ValueError(f"sparse attention: head dim {dim} must be a power of two >= 16 and {heads} query "
                         f"heads a multiple of {kv_heads} K/V heads")
    if keys.stride() != values.stride() or keys.stride(-1) != 1 or keys.stride(-2) != dim:
        raise ValueError("sparse attention: keys and values need one layout with rows of head dim")
    if per_row and rows % keys.shape[0]:
        raise ValueError(f"sparse attention: {rows} query rows do not share {keys.shape[0]} rows of K/V")
    tokens = index.shape[1]
    q = q.contiguous()
    out = torch.empty_like(q)
    if rows == 0:
        return out
    group = heads // kv_heads
    tiles = triton.cdiv(tokens, ATTEND_TOKENS)
    splits = max(1, min(splits, tiles))
    per_split = triton.cdiv(tiles, splits) * ATTEND_TOKENS
    splits = triton.next_power_of_2(triton.cdiv(tokens, per_split)) if splits > 1 else 1
    part = stats = out                          # unused when one program covers a whole list
    if splits > 1:
        part = torch.empty(rows * heads * splits, dim, dtype=torch.float32, device=q.device)
        stats = torch.empty(rows * heads * splits, 2, dtype=torch.float32, device=q.device)
    _attend_kernel[(rows, kv_heads, splits)](
        q, keys, values, index.to(torch.int32).contiguous(), valid.to(torch.bool).contiguous(), out, part,
        stats, tokens, per_split, keys.stride(0) if per_row else 0, keys.stride(-3), keys.shape[0] if per_row else 1,
        scale, HEADS=heads,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), DIM=dim, BLOCK_N=ATTEND_TOKENS,
        SPLITS=splits, INTERPRETED=interpreted(q), num_warps=ATTEND_WARPS)
    if splits > 1:
        part = part.view(rows * heads, splits, dim)
        _combine_kernel[(rows * heads,)](part, stats, out, DIM=dim, SPLITS=splits, num_warps=4)
    return out
