"""QSA prefill selection (`Indexer.select_mask`): the query-sliced version picks exactly what the whole-chunk version
picked, and its work space beyond the returned mask no longer grows with chunk x prefix."""

from __future__ import annotations

import copy
import math
from itertools import pairwise

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from qwen4exp.checkpoint.presets import preset_config
from qwen4exp.engine.model import qsa
from qwen4exp.engine.model.config import ModelConfig
from qwen4exp.engine.model.ops import TORCH_OPS
from qwen4exp.engine.model.rope import Rotary, apply_rotary
from qwen4exp.engine.model.step import Step
from qwen4exp.engine.state import AttentionState


@pytest.fixture(autouse=True)
def slices_of_query_slice_rows(monkeypatch):
    """Slice by QUERY_SLICE alone (no byte budget), so these small cases really run in several slices."""
    monkeypatch.setattr(qsa, "SCORE_BUDGET_BYTES", 0)


def test_slices_grow_to_the_byte_budget_and_no_further(monkeypatch):
    monkeypatch.setattr(qsa, "SCORE_BUDGET_BYTES", 512 << 20)
    # Shipped sizes (4 indexer heads): a 4096-token chunk is at most two slices over a 16K prefix (4096 blocks)
    assert qsa._slice_rows(4096, 4) >= 2048
    # ... and 256-row slices over 262144 tokens (65536 blocks), whose scores then take ~0.5 GiB, not 38 GiB.
    assert qsa._slice_rows(65536, 4) == qsa.QUERY_SLICE
    assert qsa._slice_rows(65536, 4) * 65536 * 4 * 4 <= 512 << 20


def select(indexer, x, start, cos_all, sin_all, state):
    """A chunk's selection as the torch ops run it: the chunk's indexer keys stored, then the mask."""
    n = x.shape[0]
    step = Step(TORCH_OPS, torch.zeros(n, dtype=torch.long, device=x.device),
                torch.arange(start, start + n, device=x.device), state, cos_all, sin_all, start=start)
    return indexer.select_mask(indexer.store_keys(x, step, state), start, state)


def whole_chunk_select(indexer, x, start, cos_all, sin_all, state):
    """The selection as it was before query slicing: every [n, n_blocks] score at once, a full stable sort."""
    n = x.shape[0]
    end = start + n
    q, raw_keys = indexer.index_qk_proj(x).split([indexer.heads * indexer.dim, indexer.dim], dim=-1)
    state.index_keys[start:end] = raw_keys
    first, last = start // indexer.ratio, end // indexer.ratio
    if last > first:
        raw = state.index_keys[first * indexer.ratio:end // indexer.ratio * indexer.ratio]
        pooled = indexer.k_layernorm(raw.reshape(last - first, indexer.ratio, -1).float().mean(1).to(raw.dtype))
        starts = torch.arange(first, last) * indexer.ratio
        state.block_keys[first:last] = apply_rotary(pooled, cos_all[starts], sin_all[starts])
    if end <= indexer.block_topk * indexer.ratio + indexer.ratio - 1:
        return None
    q = apply_rotary(indexer.q_layernorm(q.reshape(n, indexer.heads, indexer.dim)), cos_all[start:end],
                     sin_all[start:end])
    positions = torch.arange(start, end)
    complete = (positions + 1) // indexer.ratio
    n_blocks = end // indexer.ratio
    blocks = state.block_keys[:n_blocks].float()
    scores = torch.relu(torch.einsum("nhd,bd->nbh", q.float(), blocks)).sum(-1) / math.sqrt(indexer.dim)
    visible = torch.arange(n_blocks)[None, :] < complete[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :indexer.block_topk]
    chosen = torch.zeros_like(visible)
    chosen.scatter_(1, best, True)
    chosen &= visible
    token_blocks = torch.arange(end) // indexer.ratio
    in_chosen = chosen.gather(1, token_blocks.clamp_max(max(n_blocks - 1, 0))[None, :].expand(n, -1))
    token = torch.arange(end)[None, :]
    in_block = token < (complete * indexer.ratio)[:, None]
    in_tail = (token >= (complete * indexer.ratio)[:, None]) & (token <= positions[:, None])
    return (in_block & in_chosen) | in_tail


ROTARY = Rotary(8, 1e7)                                             # the tiny preset's: 8 of head_dim 32
TINY = {}                                                           # 8 heads of 16, ratio 4, 8 blocks kept
SHIPPED_HEADS = {"indexer_n_heads": 4, "indexer_head_dim": 128}     # the full model's indexer, a smaller budget
SHIPPED = {**SHIPPED_HEADS, "indexer_budget": 2048}                 # 512 blocks kept, as shipped


def make_indexer(overrides: dict, seed: int) -> qsa.Indexer:
    cfg = ModelConfig.from_dict({**preset_config("tiny", dtype="float32")["text_config"], **overrides})
    torch.manual_seed(seed)
    indexer = qsa.Indexer(cfg)
    with torch.no_grad():                                  # norms start at identity; make them matter
        indexer.q_layernorm.weight.normal_(0, 0.3)
        indexer.k_layernorm.weight.normal_(0, 0.3)
    return indexer


def make_state(indexer: qsa.Indexer, capacity: int, start: int, gen: torch.Generator, blocks: str) -> AttentionState:
    """A state as if `start` tokens came before: random raw keys, and pooled block keys that are random,
    repeated (exact ties) with some a hair apart (near ties), or half zero (scores exactly 0)."""
    d, ratio = indexer.dim, indexer.ratio
    n_blocks = start // ratio
    keys = torch.randn(n_blocks, d, generator=gen)
    if blocks == "repeated" and n_blocks:
        keys = keys[torch.randint(0, max(1, n_blocks // 4), (n_blocks,), generator=gen)]
        nudged = torch.rand(n_blocks, 1, generator=gen) < 0.3
        keys = keys + nudged * torch.randn(n_blocks, d, generator=gen) * 1e-6
    elif blocks == "zero":
        keys[torch.rand(n_blocks, generator=gen) < 0.5] = 0
    state = AttentionState(keys=torch.zeros(1), values=torch.zeros(1),
                           index_keys=torch.randn(capacity, d, generator=gen),
                           block_keys=torch.zeros(-(-capacity // ratio), d))
    state.block_keys[:n_blocks] = keys
    return state


def run_both(indexer, start: int, n: int, seed: int, blocks: str = "random", zero_queries: bool = False):
    """(old mask, new mask, old state, new state) for one chunk on identical inputs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, indexer.index_qk_proj.in_features, generator=gen)
    if zero_queries:
        x[torch.rand(n, generator=gen) < 0.5] = 0         # q = 0: every block scores 0 for those rows
    capacity = start + n + 5
    cos, sin = ROTARY.cos_sin(torch.arange(capacity), torch.float32)
    old_state = make_state(indexer, capacity, start, gen, blocks)
    new_state = copy.deepcopy(old_state)
    with torch.inference_mode():
        old = whole_chunk_select(indexer, x, start, cos, sin, old_state)
        new = select(indexer, x, start, cos, sin, new_state)
    return old, new, old_state, new_state


def assert_same(old, new, old_state, new_state):
    assert torch.equal(old_state.index_keys, new_state.index_keys)
    assert torch.equal(old_state.block_keys, new_state.block_keys)
    assert (old is None) == (new is None)
    if old is not None:
        assert new.dtype == torch.bool and new.shape == old.shape
        assert torch.equal(old, new), f"{int((old != new).sum())} entries differ"


CASES = [
    # (config, start, n, blocks, zero queries, QUERY_SLICE)
    (TINY, 0, 300, "random", False, 256),
    (TINY, 0, 300, "random", False, 32),
    (TINY, 37, 150, "repeated", False, 40),
    (TINY, 200, 1, "random", False, 32),                 # one query past the dense limit
    (TINY, 200, 2, "zero", False, 32),
    (TINY, 501, 333, "zero", True, 48),                 # n not a multiple of the slice, start mid-block
    (TINY, 1000, 97, "repeated", True, 32),
    (TINY, 20, 15, "random", False, 32),                # ends at the dense limit: None
    (TINY, 0, 36, "random", False, 32),                 # one token past it
    (TINY, 30, 10, "random", False, 32),
    ({"indexer_n_heads": 2, "indexer_head_dim": 32}, 90, 200, "repeated", False, 33),
    ({"indexer_n_heads": 1, "indexer_compress_ratio": 2, "indexer_budget": 16}, 64, 129, "zero", True, 64),
    ({"indexer_compress_ratio": 1, "indexer_budget": 8}, 5, 120, "random", True, 32),
    ({"indexer_compress_ratio": 3, "indexer_budget": 24}, 100, 211, "repeated", False, 50),
    ({**SHIPPED_HEADS, "indexer_budget": 128}, 300, 400, "random", False, 256),
    ({**SHIPPED_HEADS, "indexer_budget": 128}, 300, 400, "repeated", True, 64),
    (SHIPPED, 1900, 500, "random", False, 256),         # rows on both sides of 512 visible blocks
    (SHIPPED, 2047, 64, "zero", True, 32),
]


@pytest.mark.parametrize("overrides, start, n, blocks, zero_queries, query_slice", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_same_mask_as_the_whole_chunk_selection(monkeypatch, overrides, start, n, blocks, zero_queries,
                                                query_slice, seed):
    monkeypatch.setattr(qsa, "QUERY_SLICE", query_slice)
    indexer = make_indexer(overrides, seed)
    old, new, old_state, new_state = run_both(indexer, start, n, seed, blocks, zero_queries)
    assert_same(old, new, old_state, new_state)
    dense = start + n <= indexer.block_topk * indexer.ratio + indexer.ratio - 1
    assert (new is None) == dense


def test_random_configurations(monkeypatch):
    gen = torch.Generator().manual_seed(123)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    sparse = 0
    for trial in range(60):
        ratio = pick([1, 2, 3, 4])
        overrides = {**pick([TINY, SHIPPED_HEADS, {"indexer_n_heads": 2, "indexer_head_dim": 32}]),
                     "indexer_compress_ratio": ratio, "indexer_budget": ratio * pick([2, 8, 16])}
        indexer = make_indexer(overrides, trial)
        dense_limit = indexer.block_topk * indexer.ratio + indexer.ratio - 1
        start = pick([0, int(torch.randint(0, 60, (1,), generator=gen)),
                      dense_limit + int(torch.randint(-5, 300, (1,), generator=gen))])
        n = pick([1, 2, 3, int(torch.randint(1, 60, (1,), generator=gen)),
                  int(torch.randint(60, 400, (1,), generator=gen))])
        monkeypatch.setattr(qsa, "QUERY_SLICE", pick([1, 16, 32, 45, 100, 256]))
        result = run_both(indexer, max(start, 0), n, trial, pick(["random", "repeated", "zero"]),
                          zero_queries=bool(trial % 5 == 0))
        assert_same(*result)
        sparse += result[1] is not None
    assert sparse >= 30


def test_slicing_does_not_change_the_mask(monkeypatch):
    indexer = make_indexer(TINY, 3)
    masks = []
    for query_slice in (32, 37, 64, 200, 4096):
        monkeypatch.setattr(qsa, "QUERY_SLICE", query_slice)
        masks.append(run_both(indexer, 640, 450, 3, "repeated")[1])
    assert all(torch.equal(masks[0], m) for m in masks[1:])


@pytest.mark.parametrize("heads, dim", [(4, 128), (8, 16), (2, 64), (1, 16)])
def test_sliced_scores_have_the_whole_chunks_bits(monkeypatch, heads, dim):
    """Stronger than equal masks: every score is bit for bit the whole chunk's, so ties and near ties at the
    top-k boundary resolve alike. (One GEMM per head, summed in a loop, is not: MKL rounds a few-row GEMM
    differently, and for 8 heads ATen's head sum is not a left-to-right loop in the last vector's columns.)"""
    gen = torch.Generator().manual_seed(heads)
    indexer = make_indexer({"indexer_n_heads": heads, "indexer_head_dim": dim}, 0)
    for n, n_blocks in ((2, 9), (7, 33), (300, 1000), (64, 16), (513, 4099)):
        q = torch.randn(n, heads, dim, generator=gen)
        blocks = torch.randn(n_blocks, dim, generator=gen)
        whole = torch.relu(torch.einsum("nhd,bd->nbh", q, blocks)).sum(-1) / math.sqrt(dim)
        for query_slice in (1, 33, 100, 256):
            monkeypatch.setattr(qsa, "QUERY_SLICE", query_slice)
            sliced = torch.cat([indexer._block_scores(q[first:last], blocks) for first, last in qsa.query_slices(n)])
            assert torch.equal(sliced.view(torch.int32), whole.view(torch.int32)), (n, n_blocks, query_slice)


def test_query_slices_cover_the_chunk_in_bounded_pieces(monkeypatch):
    for query_slice in (1, 16, 32, 45, 256):
        monkeypatch.setattr(qsa, "QUERY_SLICE", query_slice)
        most = max(32, query_slice)
        for n in range(1, 700, 7):
            slices = qsa.query_slices(n)
            assert slices[0][0] == 0 and slices[-1][1] == n
            assert all(a[1] == b[0] for a, b in pairwise(slices))
            sizes = [last - first for first, last in slices]
            assert max(sizes) <= most and (len(sizes) == 1 or min(sizes) >= 16)


class LargestTemporary(TorchDispatchMode):
    """The element count of the largest tensor any op produced, except those in the storage of `keep`."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.seen.append((t.numel(), t.untyped_storage().data_ptr()))
        return out

    def largest(self, keep: torch.Tensor) -> int:
        kept = keep.untyped_storage().data_ptr()
        return max(numel for numel, storage in self.seen if storage != kept)


def _largest_temporary(fn, indexer, start: int, n: int) -> tuple[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, indexer.index_qk_proj.in_features, generator=gen)
    cos, sin = ROTARY.cos_sin(torch.arange(start + n), torch.float32)
    state = make_state(indexer, start + n, start, gen, "random")
    with torch.inference_mode(), LargestTemporary() as meter:
        mask = fn(indexer, x, start, cos, sin, state)
    return meter.largest(mask), mask


def test_work_space_is_bounded_by_the_query_slice(monkeypatch):
    monkeypatch.setattr(qsa, "QUERY_SLICE", 32)
    indexer = make_indexer(TINY, 0)
    start, n = 4000, 600
    n_blocks = (start + n) // indexer.ratio
    largest, mask = _largest_temporary(select, indexer, start, n)
    assert mask.shape == (n, start + n)
    # One slice's scores (32 rows x blocks x heads) at most: nothing of chunk x prefix size but the mask.
    assert largest <= 32 * n_blocks * indexer.heads < n * n_blocks
    old_largest, _ = _largest_temporary(whole_chunk_select, indexer, start, n)
    assert old_largest >= n * n_blocks * indexer.heads          # the meter does see the whole-chunk scores


def test_selection_runs_with_autograd_on():
    """Training calls select with gradients enabled (the indexer's own loss is computed elsewhere)."""
    indexer = make_indexer(TINY, 4)
    gen = torch.Generator().manual_seed(4)
    start, n = 100, 80
    x = torch.randn(n, indexer.index_qk_proj.in_features, generator=gen, requires_grad=True)
    cos, sin = ROTARY.cos_sin(torch.arange(start + n), torch.float32)
    state = make_state(indexer, start + n, start, gen, "random")
    reference = copy.deepcopy(state)
    mask = select(indexer, x, start, cos, sin, state)
    with torch.no_grad():
        expected = whole_chunk_select(indexer, x, start, cos, sin, reference)
    assert torch.equal(mask, expected)
