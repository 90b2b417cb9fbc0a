"""Qwen Sparse Attention (QSA), the `self_attn` of indexed layers.

An indexer scores compressed keys (the mean of every complete block of `ratio` tokens, normalised and
rotated at the block's first position) against its own multi-head query: relu(q_h . k_b) summed over
heads. Each query attends to the tokens of its top `budget / ratio` blocks plus the incomplete tail
block (which holds the query itself). Up to `dense_limit` visible tokens this is every token.
Attention itself is gated multi-query attention with q/k RMSNorm and partial RoPE. On GPUs in bf16/fp16 the
ranking and the attention run as the Triton kernels of qsa_kernels.py over each query's token list; the torch
forms here (a mask over the prefix in prefill) serve the CPU, float32 and training.
"""

from __future__ import annotations

import math
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from ..state import AttentionState
from . import qsa_kernels, qsa_select_kernel, row_products
from .config import ModelConfig
from .norms import RMSNorm
from .rope import apply_rotary

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


def _query_slices(n: int, most: int | None = None) -> list[tuple[int, int]]:
    """[first, last) row ranges of near-equal size: one range up to `most` (QUERY_SLICE, at least 32) rows, else
    ranges of 16 rows or more. A slice's GEMM then takes the same kernels as the whole chunk's and rounds alike; a
    short one may not (MKL has other paths for a few rows, and einsum swaps its operands for a lone row)."""
    most = max(32, QUERY_SLICE if most is None else most)
    count = -(-n // most)
    bounds = [i * n // count for i in range(count + 1)]
    return list(pairwise(bounds))


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

    def select(self, x: torch.Tensor, start: int, cos_all: torch.Tensor, sin_all: torch.Tensor,
               state: AttentionState) -> torch.Tensor | None:
        """Token selection for queries at positions start..start+n-1: a bool mask [n, start+n], or None
        when every query still sees its whole causal context (dense). Queries are scored QUERY_SLICE at a
        time, so beyond the mask itself the work space grows with the prefix, not with prefix x chunk."""
        n = x.shape[0]
        end = start + n
        q = self._store_keys(x, start, cos_all, sin_all, state)
        if end <= self.block_topk * self.ratio + self.ratio - 1:
            return None
        positions = torch.arange(start, end, device=x.device)
        complete = (positions + 1) // self.ratio                   # complete blocks each query sees
        # A hard top-k has no gradient: spare autograd's bookkeeping when training runs this with it on.
        with torch.no_grad():
            q = q.float()
            blocks = state.block_keys[:end // self.ratio].float()
            selected = torch.zeros(n, end, dtype=torch.bool, device=x.device)
            for first, last in _query_slices(n, _slice_rows(blocks.shape[0], self.heads)):
                chosen = self._chosen_blocks(q[first:last], blocks, complete[first:last])
                self._mark_tokens(selected[first:last], chosen, start + first, start + last,
                                  complete[first:last], positions[first:last])
        return selected

    def select_tokens(self, x: torch.Tensor, start: int, cos_all: torch.Tensor, sin_all: torch.Tensor,
                      state: AttentionState) -> tuple[torch.Tensor, torch.Tensor]:
        """`select` for the kernels of qsa_kernels: each query's tokens as a list (index, valid [n, S], S =
        budget + ratio) instead of a mask over the prefix. Same tokens as `select`, in ascending order; a
        query's list does not depend on the chunk it comes in."""
        n = x.shape[0]
        end = start + n
        q = self._store_keys(x, start, cos_all, sin_all, state)
        positions = torch.arange(start, end, device=x.device)
        complete = (positions + 1) // self.ratio
        if end <= self.block_topk * self.ratio + self.ratio - 1:
            # Dense: every query sees fewer than block_topk complete blocks, so ranking would keep them all.
            chosen = torch.arange(self.block_topk, device=x.device).expand(n, -1)
            return token_lists(chosen, complete, positions, self.ratio, state.index_keys.shape[0])
        blocks = state.block_keys[:end // self.ratio]
        width = (self.block_topk + 1) * self.ratio
        index = torch.empty(n, width, dtype=torch.int32, device=x.device)
        valid = torch.empty(n, width, dtype=torch.bool, device=x.device)
        # The ranking keys ([rows, n_blocks] int64) are the work space that grows with the prefix.
        for first, last in _query_slices(n, max(QUERY_SLICE, SCORE_BUDGET_BYTES // (16 * blocks.shape[0]))):
            keys = qsa_kernels.rank_blocks(q[first:last], blocks, complete[first:last])
            qsa_select_kernel.token_lists(keys, complete[first:last], positions[first:last], self.block_topk,
                                          self.ratio, state.index_keys.shape[0],
                                          out=(index[first:last], valid[first:last]))
        return index, valid

    def _store_keys(self, x: torch.Tensor, start: int, cos_all: torch.Tensor, sin_all: torch.Tensor,
                    state: AttentionState) -> torch.Tensor:
        """Stores the chunk's indexer keys, pools the blocks it completes; returns its normed, rotated
        indexer queries [n, heads, dim]."""
        n = x.shape[0]
        end = start + n
        q, raw_keys = self.index_qk_proj(x).split([self.heads * self.dim, self.dim], dim=-1)
        state.index_keys[start:end] = raw_keys
        self._compress(start, end, cos_all, sin_all, state)
        return apply_rotary(self.q_layernorm(q.reshape(n, self.heads, self.dim)), cos_all[start:end],
                            sin_all[start:end])

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

    def decode_select(self, x: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                      sin_table: torch.Tensor, state: AttentionState, active: torch.Tensor,
                      kernels_fit: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One query per row (x [N, H] at `positions` [N], batched state): stores its indexer key, pools the
        block it completes, and returns the tokens it attends to as fixed-size (index [N, S], valid [N, S]):
        the top blocks' tokens plus the incomplete tail block. Same choice as `select`, at fixed shapes."""
        n, device = x.shape[0], x.device
        rows = torch.arange(n, device=device)
        within = torch.arange(self.ratio, device=device)
        q, raw_keys = row_products.linear(x, self.index_qk_proj.weight).split([self.heads * self.dim, self.dim],
                                                                              dim=-1)
        state.index_keys[rows, positions] = raw_keys     # idle rows write past their length: never read
        complete = (positions + 1) // self.ratio         # complete blocks this query sees
        block = (complete - 1).clamp_min(0)
        starts = block * self.ratio
        raw = state.index_keys[rows[:, None], starts[:, None] + within]
        pooled = apply_rotary(self.k_layernorm(raw.float().mean(dim=1).to(raw.dtype)), cos_table[starts],
                              sin_table[starts])
        finished = (active & ((positions + 1) % self.ratio == 0))[:, None]
        state.block_keys[rows, block] = torch.where(finished, pooled, state.block_keys[rows, block])

        q = apply_rotary(self.q_layernorm(q.reshape(n, self.heads, self.dim)), cos_table[positions],
                         sin_table[positions])
        n_blocks = state.block_keys.shape[1]
        if kernels_fit and qsa_kernels.usable(x):
            keys = qsa_kernels.rank_blocks(q, state.block_keys, complete)
            return qsa_select_kernel.token_lists(keys, complete, positions, min(self.block_topk, n_blocks),
                                                 self.ratio, state.index_keys.shape[1])
        scores = torch.relu(torch.bmm(q.float(), state.block_keys.float().transpose(1, 2))).sum(1)
        scores = scores / math.sqrt(self.dim) + 0.0      # + 0.0 turns -0.0 into +0.0 for the bit keys below
        # A non-negative float's bits order like its value; the low word makes earlier blocks win ties,
        # so torch.topk picks exactly what the stable sort of `select` picks.
        order = torch.arange(n_blocks - 1, -1, -1, device=device)
        keys = (scores.view(torch.int32).long() << 32) | order
        visible = torch.arange(n_blocks, device=device)[None, :] < complete[:, None]
        keys = keys.masked_fill(~visible, -1)
        chosen = keys.topk(min(self.block_topk, n_blocks), dim=-1).indices
        return token_lists(chosen, complete, positions, self.ratio, state.index_keys.shape[1])

    def _compress(self, start: int, end: int, cos_all, sin_all, state: AttentionState) -> None:
        """Pool, normalise and rotate the blocks completed by this chunk."""
        first, last = start // self.ratio, end // self.ratio
        if last <= first:
            return
        raw = state.index_keys[first * self.ratio:last * self.ratio].reshape(last - first, self.ratio, self.dim)
        pooled = self.k_layernorm(raw.float().mean(dim=1).to(raw.dtype))
        block_starts = torch.arange(first, last, device=raw.device) * self.ratio
        state.block_keys[first:last] = apply_rotary(pooled, cos_all[block_starts], sin_all[block_starts])


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
        self.kernels_fit = qsa_kernels.fits(self.head_dim, self.heads, self.kv_heads, self.indexer.dim,
                                            self.indexer.heads)

    def forward(self, x: torch.Tensor, start: int, cos_all: torch.Tensor, sin_all: torch.Tensor,
                state: AttentionState) -> torch.Tensor:
        """x [n, H] of one sequence whose first token is at `start`; cos/sin cover positions 0..start+n-1."""
        n = x.shape[0]
        end = start + n
        sparse = self.kernels_fit and qsa_kernels.usable(x)
        if sparse:
            index, valid = self.indexer.select_tokens(x, start, cos_all, sin_all, state)
        else:
            selected = self.indexer.select(x, start, cos_all, sin_all, state)
        q, gate = self.q_proj(x).view(n, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        cos, sin = cos_all[start:end], sin_all[start:end]
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(self.k_proj(x).view(n, self.kv_heads, self.head_dim)), cos, sin)
        state.keys[:, start:end] = k.transpose(0, 1)
        state.values[:, start:end] = self.v_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        if sparse:
            out = qsa_kernels.sparse_attention(q, state.keys, state.values, index, valid, self.head_dim ** -0.5)
            return self._output(out.reshape(n, -1), gate)
        if selected is None:
            token = torch.arange(end, device=x.device)
            selected = token[None, :] <= (start + torch.arange(n, device=x.device))[:, None]
        # Query heads grouped under their K/V head; K/V and the mask are broadcast (stride 0), not copied:
        # at a 200K-token prefix a copy per query head would be gigabytes per chunk.
        groups = self.heads // self.kv_heads
        q = q.transpose(0, 1).reshape(self.kv_heads, groups, n, self.head_dim)
        keys = state.keys[:, None, :end].expand(-1, groups, -1, -1)
        values = state.values[:, None, :end].expand(-1, groups, -1, -1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=selected[None, None],
                                             scale=self.head_dim ** -0.5)
        return self._output(out.reshape(self.heads, n, self.head_dim).transpose(0, 1).reshape(n, -1), gate)

    def _output(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The sigmoid-gated heads [n, heads * head_dim] through o_proj."""
        return self.o_proj(out * torch.sigmoid(gate.reshape(out.shape[0], -1)))

    def decode_rows(self, x: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                    sin_table: torch.Tensor, state: AttentionState, active: torch.Tensor) -> torch.Tensor:
        """One token for each of N sequences (x [N, H] at `positions` [N], batched state), at fixed shapes:
        attention reads only the selected tokens' K/V (gathered), in float32."""
        n = x.shape[0]
        rows = torch.arange(n, device=x.device)
        index, valid = self.indexer.decode_select(x, positions, cos_table, sin_table, state, active,
                                                  self.kernels_fit)
        cos, sin = cos_table[positions], sin_table[positions]
        q, gate = self.q_proj(x).view(n, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = row_products.linear(x, self.k_proj.weight).view(n, self.kv_heads, self.head_dim)
        k = apply_rotary(self.k_norm(k), cos, sin)
        state.keys[rows, :, positions] = k
        state.values[rows, :, positions] = row_products.linear(x, self.v_proj.weight).view(n, self.kv_heads,
                                                                                          self.head_dim)
        if self.kernels_fit and qsa_kernels.usable(x):
            out = qsa_kernels.sparse_attention(q, state.keys, state.values, index, valid, self.head_dim ** -0.5,
                                               splits=qsa_kernels.DECODE_SPLITS)
            return self._output(out.reshape(n, -1), gate)
        gather = index[:, None, :, None].expand(n, self.kv_heads, index.shape[1], self.head_dim)
        keys = state.keys.gather(2, gather).float()
        values = state.values.gather(2, gather).float()
        q = q.reshape(n, self.kv_heads, self.heads // self.kv_heads, self.head_dim).float()
        scores = (q @ keys.transpose(-1, -2)) * self.head_dim ** -0.5
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        out = (torch.softmax(scores, dim=-1) @ values).to(x.dtype)
        return self._output(out.reshape(n, self.heads * self.head_dim), gate)
