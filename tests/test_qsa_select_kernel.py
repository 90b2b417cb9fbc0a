"""The token-list kernel (kernels/qsa_select.py) against the torch form it replaces: torch.topk over the ranking
keys, a sort back into block order, and qsa.token_lists. Every valid entry must be the same token at the same
place (so attention sums the same tokens in the same order), every other entry invalid. Cases: many tied scores
(ties go to the earlier block), queries that see fewer blocks than k, none, exactly k, k equal to the block
count, long rows over several kernel tiles. On the CPU through Triton's interpreter (in a child process:
TRITON_INTERPRET must be set before Triton is imported), and on a GPU at a decode step's shapes."""

from __future__ import annotations

import importlib.util

import pytest
from triton_interpreter import interpreted_results

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

COMMON = r"""
import json, torch
from qwen4exp.engine.model import qsa
from qwen4exp.kernels import qsa_select as qsa_select_kernel


def ranking_keys(scores, complete):
    '''rank_blocks' keys from non-negative float32 scores [rows, n_blocks]: score bits high, reversed block
    index low, -1 where the query does not see the block.'''
    rows, n_blocks = scores.shape
    order = torch.arange(n_blocks - 1, -1, -1, device=scores.device)
    keys = (scores.float().view(torch.int32).long() << 32) | order
    visible = torch.arange(n_blocks, device=scores.device)[None, :] < complete[:, None]
    return keys.masked_fill(~visible, -1)


def compare(scores, complete, positions, k, ratio, capacity):
    keys = ranking_keys(scores, complete)
    chosen = keys.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
    want_index, want_valid = qsa.token_lists(chosen, complete, positions, ratio, capacity)
    index, valid = qsa_select_kernel.token_lists(keys, complete, positions, k, ratio, capacity)
    return {"valid": bool(torch.equal(valid, want_valid)),
            "tokens": bool(torch.equal(index.long()[valid], want_index[valid])),
            "dtypes": [str(index.dtype), str(valid.dtype)], "listed": int(valid.sum())}


def cases(device, gen, big):
    ratio = 4
    out = {}
    n_blocks, k = (6000, 512) if big else (300, 16)
    rows = 6
    # Few distinct scores: most of a row's top k are ties, decided by the block index.
    tied = torch.randint(0, 5, (rows, n_blocks), generator=gen, device=device).float() * 0.25
    spread = torch.rand(rows, n_blocks, generator=gen, device=device) * 3
    complete = torch.tensor([n_blocks, n_blocks - 7, k + 1, k, k // 2, 0], device=device)
    positions = complete * ratio + torch.tensor([3, 0, 1, 2, 3, 0], device=device)
    capacity = n_blocks * ratio + ratio
    for name, scores in (("tied", tied), ("spread", spread), ("zeros", torch.zeros_like(spread))):
        out[name] = compare(scores, complete, positions, k, ratio, capacity)
    # k as large as the block count (a small engine), the tail clamped to the capacity.
    few = torch.rand(3, k, generator=gen, device=device)
    c = torch.tensor([k, k - 3, 1], device=device)
    out["k=blocks"] = compare(few, c, c * ratio + 1, k, ratio, k * ratio)
    return out
"""

CHILD = COMMON + r"""
qsa_select_kernel.SELECT_TILE = 64       # several tiles per row at interpreter-sized rows
print(json.dumps(cases("cpu", torch.Generator().manual_seed(0), big=False)))
"""


def check(results: dict) -> None:
    for name, r in results.items():
        assert r["valid"] and r["tokens"], (name, r)
        assert r["dtypes"] == ["torch.int32", "torch.bool"], (name, r)
    assert results["tied"]["listed"] > 0


@pytest.fixture(scope="module")
def results():
    return interpreted_results(CHILD)


def test_kernel_lists_the_tokens_of_the_torch_form(results):
    check(results)


def test_kernel_refuses_more_blocks_than_there_are():
    import torch
    from qwen4exp.kernels import qsa_select as qsa_select_kernel

    keys = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="k \\(9\\) must be at most the 8 blocks"):
        qsa_select_kernel.token_lists(keys, torch.zeros(2), torch.zeros(2), 9, 4, 64)


@pytest.mark.gpu
def test_kernel_lists_the_tokens_of_the_torch_form_on_gpu():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm device")
    scope: dict = {}
    exec(COMMON, scope)                                    # noqa: S102 - the shared cases above
    check(scope["cases"]("cuda", torch.Generator(device="cuda").manual_seed(0), big=True))
