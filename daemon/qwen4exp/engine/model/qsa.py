"""Qwen Sparse Attention (QSA), the `self_attn` of indexed layers.

An indexer scores compressed keys (the mean of every complete block of `ratio` tokens, normalised and
rotated at the block's first position) against its own multi-head query: relu(q_h . k_b) summed over
heads. Each query attends to the tokens of its top `budget / ratio` blocks plus the incomplete tail
block (which holds the query itself). Up to `dense_limit` visible tokens this is every token.
Attention itself is gated multi-query attention with q/k RMSNorm and partial RoPE. The selection and the
attention are the ops backend's `qsa_attention`: on GPUs in bf16/fp16 the kernels of kernels/qsa_attention.py and
kernels/qsa_select.py over each query's token list (triton_ops.py); the torch forms here (a mask over the prefix
in a chunk, gathered token lists in decode) serve the CPU, float32 and training.
"""

from __future__ import annotations

import math
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from ..state import AttentionState
from .config import ModelConfig
from .norms import RMSNorm

# How many queries have block scores at once: the scores ([rows, n_blocks, heads] float32) and their sort are
# the only work space that grows with the prefix, so a chunk's peak stays its mask plus this budget. Slices are
# as large as the budget allows (at most two per 4096-query chunk up to a 16K prefix on the shipped sizes: few
# launches where memory is plentiful), and never below QUERY_SLICE rows.
SCORE_BUDGET_BYTES = 512 << 20
QUERY_SLICE = 256


def _slice_rows(n_blocks: int, heads: int) -> int:
    """Most rows per slice: the einsum's [rows, B, heads] float32, the scores, the sort's values and indices and
    two bool masks fit SCORE_BUDGET_BYTES, or QUERY_SLICE rows when they cannot."""
    per_row = max(1, n_blocks) * (4 * heads + 4 + 4 + 12 + 2)
    return max(QUERY_SLICE, SCORE_BUDGET_BYTES // per_row)


def query_slices(n: int, most: int | None = None, align: int = 1) -> list[tuple[int, int]]:
    """[first, last) row ranges of near-equal size: one range up to `most` (QUERY_SLICE, at least 32) rows, else
    ranges of 16 rows or more. A slice's GEMM then takes the same kernels as the whole chunk's and rounds alike; a
    short one may not (MKL has other paths for a few rows, and einsum swaps its operands for a lone row).
    `align`: the ranges start at multiples of it (a range may then pass `most` by up to align - 1 rows)."""
    most = max(32, QUERY_SLICE if most is None else most)
    count = -(-n // most)
    bounds = [i * n // count // align * align for i in range(count)] + [n]
    return [(first, last) for first, last in pairwise(bounds) if last > first]


def token_lists(chosen: torch.Tensor, complete: torch.Tensor, positions: torch.Tensor, ratio: int,
                capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, valid) [rows, k * ratio + ratio]: the tokens of chosen blocks [rows, k] (valid where the query
    sees the block), then the query's incomplete tail block up to itself."""
    within = torch.arange(ratio, device=chosen.device)
    block_tokens = (chosen[:, :, None] * ratio + within).flatten(1)
    tail = complete[:, None] * ratio + within
    index = torch.cat((block_tokens, tail), dim=1).clamp_max(capacity - 1)
    seen = (chosen < complete[:, None]).repeat_interleave(ratio, dim=1)
    return index, torch.cat((seen, tail <= positions[:, None]), dim=1)


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.dim = cfg.indexer_n_heads, cfg.indexer_head_dim
        self.ratio, self.block_topk = cfg.indexer_compress_ratio, cfg.block_topk
        self.index_qk_proj = nn.Linear(cfg.hidden_size, (self.heads + 1) * self.dim, bias=False)
        self.q_layernorm = RMSNorm(self.dim, cfg.rms_norm_eps)
        self.k_layernorm = RMSNorm(self.dim, cfg.rms_norm_eps)

    def store_keys(self, x: torch.Tensor, step, state: AttentionState) -> torch.Tensor:
        """Stores the step's raw indexer keys and pools, normalises and rotates the blocks they complete;
        returns the normed, rotated indexer queries [T, heads, dim]."""
        ops, n = step.ops, x.shape[0]
        q, raw_keys = ops.linear(x, self.index_qk_proj.weight, step).split([self.heads * self.dim, self.dim], dim=-1)
        if step.decode:
            self._store_rows(raw_keys, step, state)
        else:
            self._store_chunk(raw_keys, step, state)
        return ops.rotate(ops.rms_norm(q.reshape(n, self.heads, self.dim), self.q_layernorm), step.cos, step.sin)

    def pool(self, raw: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], step) -> torch.Tensor:
        """Blocks of raw keys [B, ratio, dim] -> their keys [B, dim], rotated by `rope` (cos, sin at each block's
        first position)."""
        pooled = step.ops.rms_norm(raw.float().mean(dim=1).to(raw.dtype), self.k_layernorm)
        return step.ops.rotate(pooled, *rope)

    def _store_chunk(self, raw_keys: torch.Tensor, step, state: AttentionState) -> None:
        start, end = step.start, step.end
        state.index_keys[start:end] = raw_keys
        first, last = start // self.ratio, end // self.ratio
        if last > first:
            raw = state.index_keys[first * self.ratio:last * self.ratio].reshape(last - first, self.ratio, self.dim)

            def block_rope():      # the same in every QSA layer of the chunk: made once
                block_starts = torch.arange(first, last, device=raw.device) * self.ratio
                return step.cos_table[block_starts], step.sin_table[block_starts]
            rope = step.shared(("completed blocks' rope", self.ratio), block_rope)
            state.block_keys[first:last] = self.pool(raw, rope, step)

    def _store_rows(self, raw_keys: torch.Tensor, step, state: AttentionState) -> None:
        """Each row's key at its position (idle rows write past their length: never read), then the key of the
        block each active row completes, if it does (the backend's `complete_blocks`): fixed shapes."""
        state.index_keys[step.state_rows, step.positions] = raw_keys
        step.ops.complete_blocks(self, step, state)

    def complete_blocks(self, step, state: AttentionState) -> None:
        """The torch form of the backend's `complete_blocks`: sub-step by sub-step (in a verify step two sub-steps
        of one row may write one block: the one completing it and another writing back the key it read)."""
        for view in step.substep_views():
            rows, block, columns, finished, rope = view.shared(("indexer blocks", self.ratio),
                                                               lambda: self._completed_blocks(view))
            raw = state.index_keys[rows[:, None], columns]
            state.block_keys[rows, block] = torch.where(finished, self.pool(raw, rope, view),
                                                        state.block_keys[rows, block])

    def last_block(self, positions: torch.Tensor) -> torch.Tensor:
        """The block each position's token completes or last completed (block 0 before the first completes)."""
        return ((positions + 1) // self.ratio - 1).clamp_min(0)

    def _completed_blocks(self, step) -> tuple[torch.Tensor, ...]:
        """decode: (rows, the block each row's token completes or last completed, that block's positions [N, ratio],
        whether the row's token completes it [N, 1], cos and sin at its first position): the same in every QSA
        layer of the step."""
        positions = step.positions
        rows = torch.arange(positions.numel(), device=positions.device)
        block = self.last_block(positions)
        starts = block * self.ratio
        columns = starts[:, None] + torch.arange(self.ratio, device=positions.device)
        finished = (step.active & ((positions + 1) % self.ratio == 0))[:, None]
        return rows, block, columns, finished, (step.cos_table[starts], step.sin_table[starts])

    def select_mask(self, q: torch.Tensor, start: int, state: AttentionState) -> torch.Tensor | None:
        """Token selection for a chunk's queries q [n, heads, dim] at positions start..start+n-1 (their keys
        stored): a bool mask [n, start+n], or None when every query still sees its whole causal context
        (dense). Queries are scored in slices, so beyond the mask itself the work space grows with the prefix,
        not with prefix x chunk."""
        n = q.shape[0]
        end = start + n
        if end <= self.block_topk * self.ratio + self.ratio - 1:
            return None
        positions = torch.arange(start, end, device=q.device)
        complete = (positions + 1) // self.ratio                   # complete blocks each query sees
        # A hard top-k has no gradient: spare autograd's bookkeeping when training runs this with it on.
        with torch.no_grad():
            q = q.float()
            blocks = state.block_keys[:end // self.ratio].float()
            selected = torch.zeros(n, end, dtype=torch.bool, device=q.device)
            for first, last in query_slices(n, _slice_rows(blocks.shape[0], self.heads)):
                chosen = self._chosen_blocks(q[first:last], blocks, complete[first:last])
                self._mark_tokens(selected[first:last], chosen, start + first, start + last,
                                  complete[first:last], positions[first:last])
        return selected

    def _chosen_blocks(self, q: torch.Tensor, blocks: torch.Tensor, complete: torch.Tensor) -> torch.Tensor:
        """The visible blocks that each query of a slice keeps: bool [rows, n_blocks]."""
        n_blocks = blocks.shape[0]
        visible = torch.arange(n_blocks, device=q.device)[None, :] < complete[:, None]
        scores = self._block_scores(q, blocks).masked_fill_(~visible, float("-inf"))
        # Ties (relu makes many scores exactly 0) go to the earlier block, so the choice is reproducible.
        best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :self.block_topk]
        del scores                                                 # before the next [rows, n_blocks] tensor
        return torch.zeros_like(visible).scatter_(1, best, True).logical_and_(visible)

    def _block_scores(self, q: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """float32 [rows, n_blocks]: sum over heads of relu(q_h . k_b), / sqrt(dim). The same operations on
        the same layouts as a whole chunk at once (one GEMM for all heads, then the head sum), so each score
        has the same bits whatever the slicing."""
        return torch.einsum("nhd,bd->nbh", q, blocks).relu_().sum(-1).div_(math.sqrt(self.dim))

    def _mark_tokens(self, selected: torch.Tensor, chosen: torch.Tensor, first: int, last: int,
                     complete: torch.Tensor, positions: torch.Tensor) -> None:
        """Fill the mask rows of queries at positions first..last-1: the tokens of their chosen blocks, and
        their incomplete tail block up to the query itself."""
        n_blocks = chosen.shape[1]
        whole = selected[:, :n_blocks * self.ratio].unflatten(1, (n_blocks, self.ratio))
        whole.copy_(chosen[:, :, None].expand(-1, -1, self.ratio))
        # The slice's tails lie within [its first query's tail start, its last query]: a narrow band.
        low = (first + 1) // self.ratio * self.ratio
        token = torch.arange(low, last, device=selected.device)[None, :]
        tail = (token >= (complete * self.ratio)[:, None]) & (token <= positions[:, None])
        selected[:, low:last].logical_or_(tail)

    def rows_token_lists(self, q: torch.Tensor, positions: torch.Tensor, state: AttentionState
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """One query per row (q [N, heads, dim] at `positions` [N], batched state): the tokens it attends to
        as fixed-size (index [N, S], valid [N, S]): the top blocks' tokens plus the incomplete tail block.
        Same choice as `select_mask`, at fixed shapes."""
        n_blocks = state.block_keys.shape[1]
        complete = (positions + 1) // self.ratio
        scores = torch.relu(torch.bmm(q.float(), state.block_keys.float().transpose(1, 2))).sum(1)
        scores = scores / math.sqrt(self.dim) + 0.0      # + 0.0 turns -0.0 into +0.0 for the bit keys below
        # A non-negative float's bits order like its value; the low word makes earlier blocks win ties,
        # so torch.topk picks exactly what the stable sort of `select_mask` picks.
        order = torch.arange(n_blocks - 1, -1, -1, device=q.device)
        keys = (scores.view(torch.int32).long() << 32) | order
        visible = torch.arange(n_blocks, device=q.device)[None, :] < complete[:, None]
        keys = keys.masked_fill(~visible, -1)
        chosen = keys.topk(min(self.block_topk, n_blocks), dim=-1).indices
        return token_lists(chosen, complete, positions, self.ratio, state.index_keys.shape[1])


class QSAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        hidden = cfg.hidden_size
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim * 2, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.indexer = Indexer(cfg)

    def forward(self, x: torch.Tensor, step, state: AttentionState) -> torch.Tensor:
        """x [T, H] -> [T, H]: stores the step's K/V and indexer keys, then attends to each query's selection."""
        ops, n = step.ops, x.shape[0]
        index_q = self.indexer.store_keys(x, step, state)
        q, gate = ops.linear(x, self.q_proj.weight, step).view(n, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = ops.rotate(ops.rms_norm(q, self.q_norm), step.cos, step.sin)
        k = ops.linear(x, self.k_proj.weight, step).view(n, self.kv_heads, self.head_dim)
        k = ops.rotate(ops.rms_norm(k, self.k_norm), step.cos, step.sin)
        v = ops.linear(x, self.v_proj.weight, step).view(n, self.kv_heads, self.head_dim)
        if step.decode:
            rows = step.state_rows
            state.keys[rows, :, step.positions] = k
            state.values[rows, :, step.positions] = v
        else:
            state.keys[:, step.start:step.end] = k.transpose(0, 1)
            state.values[:, step.start:step.end] = v.transpose(0, 1)
        out = ops.qsa_attention(self, q, index_q, step, state)
        gated = ops.gate_product(out.unflatten(-1, (self.heads, self.head_dim)), gate, silu=False)
        return ops.linear(gated, self.o_proj.weight, step)


def attend_chunk(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, selected: torch.Tensor | None,
                 start: int, scale: float) -> torch.Tensor:
    """A chunk's queries q [n, heads, d] at start.. over one sequence's K/V [kv_heads, capacity, d] under the
    selection mask [n, start+n] (None: causal) -> [n, heads * d]."""
    n, heads, dim = q.shape
    kv_heads = keys.shape[0]
    end = start + n
    if selected is None:
        token = torch.arange(end, device=q.device)
        selected = token[None, :] <= (start + torch.arange(n, device=q.device))[:, None]
    # Query heads grouped under their K/V head; K/V and the mask are broadcast (stride 0), not copied:
    # at a 200K-token prefix a copy per query head would be gigabytes per chunk.
    groups = heads // kv_heads
    q = q.transpose(0, 1).reshape(kv_heads, groups, n, dim)
    k = keys[:, None, :end].expand(-1, groups, -1, -1)
    v = values[:, None, :end].expand(-1, groups, -1, -1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=selected[None, None], scale=scale)
    return out.reshape(heads, n, dim).transpose(0, 1).reshape(n, -1)


def attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor,
                valid: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per row q [N, heads, d] over the gathered tokens of its list (index/valid [N, S]) in batched
    K/V [N, kv_heads, capacity, d], in float32 -> [N, heads * d] in q's dtype."""
    n, heads, dim = q.shape
    kv_heads = keys.shape[1]
    gather = index[:, None, :, None].expand(n, kv_heads, index.shape[1], dim)
    k = keys.gather(2, gather).float()
    v = values.gather(2, gather).float()
    qf = q.reshape(n, kv_heads, heads // kv_heads, dim).float()
    scores = (qf @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).to(q.dtype).reshape(n, heads * dim)
