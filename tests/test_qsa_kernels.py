"""QSA's Triton kernels (kernels/qsa_attention.py, kernels/qsa_select.py) against the torch forms: the token lists
that the block ranking gives hold exactly the tokens of `Indexer.select_mask`'s mask, in ascending order, whatever
the chunking;
sparse attention over a list equals softmax attention over the gathered tokens, in one program per list or
split over several. On the CPU through Triton's interpreter (in a child process: TRITON_INTERPRET must be set
before Triton is imported), and at the shipped sizes on a GPU (`pytest -m gpu`)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from triton_interpreter import interpreted_results

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

# Shared by the child process and the GPU test: the torch reference and the cases.
COMMON = r"""
import json, math, sys, torch
sys.path.insert(0, TESTS)
from qwen4exp.engine.model import qsa
from qwen4exp.kernels import qsa_attention as qsa_kernels
from qwen4exp.engine.model.ops import TORCH_OPS
from qwen4exp.engine.model.step import Step
from qwen4exp.engine.model.triton_ops import TritonOps
from qwen4exp.engine.state import AttentionState
from test_qsa_select import ROTARY, make_indexer as float32_indexer, select


def make_indexer(overrides, dtype, device, seed):
    return float32_indexer(overrides, seed).to(device=device, dtype=dtype), ROTARY


def empty_state(indexer, capacity, dtype, device):
    return AttentionState(keys=torch.zeros(1), values=torch.zeros(1),
                          index_keys=torch.zeros(capacity, indexer.dim, dtype=dtype, device=device),
                          block_keys=torch.zeros(-(-capacity // indexer.ratio), indexer.dim, dtype=dtype,
                                                 device=device))


def lists_and_masks(indexer, rotary, x, bounds, dtype, device):
    '''Runs the chunks [a, b) of x through the torch selection (masks) and the kernels' (lists) on twin states.'''
    capacity = x.shape[0] + 8
    cos, sin = rotary.cos_sin(torch.arange(capacity, device=device), dtype)
    masked, listed = empty_state(indexer, capacity, dtype, device), empty_state(indexer, capacity, dtype, device)
    masks, lists = [], []
    with torch.inference_mode():
        for a, b in bounds:
            mask = select(indexer, x[a:b], a, cos, sin, masked)
            if mask is None:                               # dense: every token up to the query
                mask = torch.arange(b, device=device)[None, :] <= torch.arange(a, b, device=device)[:, None]
            masks.append(mask)
            step = Step(TORCH_OPS, torch.zeros(b - a, dtype=torch.long, device=device),
                        torch.arange(a, b, device=device), listed, cos, sin, start=a)
            lists.append(TritonOps._chunk_token_lists(indexer, indexer.store_keys(x[a:b], step, listed), step, listed))
    return masks, lists


def compare_lists(masks, lists):
    '''Whether each list holds its mask row's tokens exactly once, valid entries ascending.'''
    same, repeated, ascending = True, 0, True
    for mask, (index, valid) in zip(masks, lists):
        rebuilt = torch.zeros_like(mask)
        rows = torch.arange(index.shape[0], device=index.device)[:, None].expand_as(index)
        rebuilt[rows[valid], index[valid]] = True
        same &= bool(torch.equal(rebuilt, mask))
        repeated += int((valid.sum(1) - mask.sum(1)).abs().sum())
        kept = torch.where(valid, index, -1)
        ascending &= bool(all(torch.all(r[r >= 0].diff() > 0) for r in kept))
    return {"same": same, "repeated": repeated, "ascending": ascending}


def reference_attention(q, keys, values, index, valid, scale):
    '''float32 softmax attention over each row's gathered tokens; keys [kv, T, d] or [rows, kv, T, d].'''
    rows, heads, dim = q.shape
    if keys.dim() == 3:
        keys, values = keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1)
    kv = keys.shape[1]
    gather = index[:, None, :, None].expand(rows, kv, index.shape[1], dim)
    k, v = keys.gather(2, gather).float(), values.gather(2, gather).float()
    q = q.reshape(rows, kv, heads // kv, dim).float()
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~valid[:, None, None, :], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).reshape(rows, heads, dim)


def attention_case(rows, heads, kv, dim, tokens, listed, per_row, dtype, device, gen):
    q = torch.randn(rows, heads, dim, generator=gen).to(device=device, dtype=dtype)
    shape = (rows, kv, tokens, dim) if per_row else (kv, tokens, dim)
    keys = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    values = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    index = torch.randint(0, tokens, (rows, listed), generator=gen).to(device)
    valid = (torch.rand(rows, listed, generator=gen) < 0.6).to(device)
    valid[:, -1] = True                                    # every query sees at least itself
    valid[0, :-1] = False                                  # one sees only itself: most tiles empty
    return q, keys, values, index, valid, dim ** -0.5


def attention_errors(case, splits):
    q, keys, values, index, valid, scale = case
    want = reference_attention(q, keys, values, index, valid, scale)
    got = qsa_kernels.sparse_attention(q, keys, values, index, valid, scale, splits=splits).float()
    return {"err": (got - want).abs().max().item(), "scale": want.abs().max().item(),
            "finite": bool(torch.isfinite(got).all())}
"""

CHILD = f"TESTS = {str(Path(__file__).parent)!r}\n" + COMMON + r"""
qsa.QUERY_SLICE, qsa.SCORE_BUDGET_BYTES = 32, 0                    # several slices per chunk
results = {}
for dtype_name in ("float32", "bfloat16"):
    dtype = getattr(torch, dtype_name)
    for label, overrides, length, bounds in (
            ("tiny", {}, 300, [(0, 300)]),
            ("tiny chunked", {}, 300, [(0, 20), (20, 36), (36, 101), (101, 217), (217, 300)]),
            ("wide heads", {"indexer_n_heads": 2, "indexer_head_dim": 32}, 260, [(0, 90), (90, 260)])):
        indexer, rotary = make_indexer(overrides, dtype, "cpu", seed=3)
        x = torch.randn(length, indexer.index_qk_proj.in_features, generator=torch.Generator().manual_seed(4))
        x[::7] = 0                                         # q = 0: every block scores exactly 0 (ties)
        masks, lists = lists_and_masks(indexer, rotary, x.to(dtype), bounds, dtype, "cpu")
        results[f"{dtype_name} {label}"] = compare_lists(masks, lists)
        if label == "tiny chunked":                        # the same query's list whatever its chunk
            _, whole = lists_and_masks(indexer, rotary, x.to(dtype), [(0, length)], dtype, "cpu")
            index = torch.cat([i for i, _ in lists]); valid = torch.cat([v for _, v in lists])
            results[f"{dtype_name} chunk invariant"] = bool(
                torch.equal(valid, whole[0][1]) and torch.equal(index[valid], whole[0][0][valid]))
gen = torch.Generator().manual_seed(5)
for dtype_name in ("bfloat16", "float16"):
    dtype = getattr(torch, dtype_name)
    for label, shape in (("group 2", (37, 4, 2, 32)), ("group 12", (9, 24, 2, 64))):
        rows, heads, kv, dim = shape
        for per_row in (False, True):
            case = attention_case(rows, heads, kv, dim, 300, 150, per_row, dtype, "cpu", gen)
            for splits in ((1,) if not per_row else (1, 2, 8)):
                results[f"{dtype_name} {label} per_row={per_row} splits={splits}"] = attention_errors(case, splits)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results():
    return interpreted_results(CHILD)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["tiny", "tiny chunked", "wide heads"])
def test_token_lists_hold_exactly_the_selected_tokens(results, dtype, case):
    r = results[f"{dtype} {case}"]
    assert r == {"same": True, "repeated": 0, "ascending": True}, r


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_querys_list_does_not_depend_on_its_chunk(results, dtype):
    assert results[f"{dtype} chunk invariant"]


ATTENTION = [f"{d} {g} per_row={p} splits={s}" for d in ("bfloat16", "float16") for g in ("group 2", "group 12")
             for p, s in ((False, 1), (True, 1), (True, 2), (True, 8))]


@pytest.mark.parametrize("case", ATTENTION)
def test_sparse_attention_matches_softmax_over_the_gathered_tokens(results, case):
    r = results[case]
    # The softmax weights reach the value product with ~16 bits; values and output are in the model dtype.
    assert r["finite"] and r["err"] <= 2 ** -8 * max(1.0, r["scale"]), r


@pytest.mark.gpu
def test_kernels_at_shipped_sizes_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm device")
    scope: dict = {"TESTS": str(Path(__file__).parent)}
    exec(COMMON, scope)                                    # noqa: S102 - the shared reference above
    gen = torch.Generator().manual_seed(6)
    # 24 query heads over 2 K/V heads of 256, lists of 512 blocks of 4 + the tail, as shipped.
    for per_row, rows, splits in ((False, 512, 1), (True, 4, 8), (True, 1, 1)):
        case = scope["attention_case"](rows, 24, 2, 256, 20000, 2052, per_row, torch.bfloat16, "cuda", gen)
        r = scope["attention_errors"](case, splits)
        assert r["finite"] and r["err"] <= 2 ** -7 * max(1.0, r["scale"]), (per_row, splits, r)
    # The shipped indexer (4 heads of 128, 512 blocks kept) in bfloat16: lists == masks, and chunk invariance.
    indexer, rotary = scope["make_indexer"]({"indexer_n_heads": 4, "indexer_head_dim": 128, "indexer_budget": 2048},
                                            torch.bfloat16, "cuda", seed=7)
    x = torch.randn(6000, indexer.index_qk_proj.in_features, generator=gen).to("cuda", torch.bfloat16)
    bounds = [(0, 2500), (2500, 4096), (4096, 6000)]
    masks, lists = scope["lists_and_masks"](indexer, rotary, x, bounds, torch.bfloat16, "cuda")
    compared = scope["compare_lists"](masks, lists)
    _, whole = scope["lists_and_masks"](indexer, rotary, x, [(0, 6000)], torch.bfloat16, "cuda")
    index, valid = torch.cat([i for i, _ in lists]), torch.cat([v for _, v in lists])
    print(json.dumps(compared))
    assert torch.equal(valid, whole[0][1]) and torch.equal(index[valid], whole[0][0][valid])
    assert compared["repeated"] == 0 and compared["ascending"], compared
    # Scores in another summation order than the torch form's: a tie at the top-k boundary may fall
    # the other way, but not more than rarely.
    if not compared["same"]:
        differing = sum(int((torch.zeros_like(m).index_put_((torch.arange(i.shape[0], device="cuda")[:, None]
                                                             .expand_as(i)[v], i[v]), torch.tensor(True,
                                                             device="cuda")) != m).any(1).sum())
                        for m, (i, v) in zip(masks, lists))
        assert differing <= 6, f"{differing} of 6000 queries chose other blocks than the torch form"


def test_shapes_the_kernels_cannot_tile_take_the_torch_forms():
    from qwen4exp.kernels import qsa_attention as qsa_kernels

    assert qsa_kernels.fits(256, 24, 2, 128, 4)                 # the shipped model
    assert qsa_kernels.fits(32, 4, 2, 16, 8)                    # the tiny preset
    assert not qsa_kernels.fits(96, 24, 2, 128, 4)              # head dim not a power of two
    assert not qsa_kernels.fits(256, 24, 2, 8, 4)               # indexer dim under tl.dot's 16
    assert not qsa_kernels.fits(256, 24, 5, 128, 4)             # query heads not whole K/V groups
