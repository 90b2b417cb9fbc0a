"""The kernels of the indexer keys a decode step completes (kernels/block_keys.py) on the CPU through Triton's
interpreter, against the torch form (Indexer.complete_blocks): each row's mean of its last completed block's raw
keys within one rounding of torch's, the same for a row whatever rows share the launch, and only the rows whose
token completes a block write it (a verify step's sub-steps of one state row never write one block twice). Run in
a child process: TRITON_INTERPRET must be set before Triton is imported."""

from __future__ import annotations

import importlib.util

import pytest
from triton_interpreter import interpreted_results

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

CHILD = r"""
import json, torch
from qwen4exp.kernels import block_keys
results = {}
gen = torch.Generator().manual_seed(0)
ratio, dim, capacity, n = 4, 16, 64, 3
for name in ("float32", "bfloat16"):
    dtype = getattr(torch, name)
    index_keys = torch.randn(n, capacity, dim, generator=gen).to(dtype)
    # A verify step of 4 sub-steps, rows position-major: row 0 completes block 1 (position 7) in sub-step 1, row 1
    # block 3 (position 15) in sub-step 3, row 2 is idle in its last two sub-steps (position 31 would complete one).
    positions = torch.tensor([[6, 12, 28], [7, 13, 29], [8, 14, 30], [9, 15, 31]])
    active = torch.tensor([[True, True, True], [True, True, True], [True, True, False], [True, True, False]])
    state_rows = torch.arange(n).repeat(4)
    means = block_keys.block_means(index_keys, state_rows, positions.flatten(), ratio)
    block = ((positions.flatten() + 1) // ratio - 1).clamp_min(0)
    columns = block[:, None] * ratio + torch.arange(ratio)
    want = index_keys[state_rows[:, None], columns].float().mean(dim=1).to(dtype)
    alone = torch.cat([block_keys.block_means(index_keys, state_rows[i:i + 1], positions.flatten()[i:i + 1], ratio)
                       for i in range(4 * n)])
    old = torch.randn(n, capacity // ratio, dim, generator=gen).to(dtype)
    blocks = old.clone()
    block_keys.store_finished(blocks, state_rows, positions.flatten(), active.flatten(), means, ratio)
    expected = old.clone()
    expected[0, 1], expected[1, 3] = means[3], means[10]
    results[name] = {
        "mean_err": (means.float() - want.float()).abs().max().item(),
        "mean_scale": want.float().abs().max().item(),
        "alone_equal": bool(torch.equal(alone, means)),
        "stored_as_expected": bool(torch.equal(blocks, expected)),
    }
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results():
    return interpreted_results(CHILD)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_block_means_match_the_torch_mean_and_do_not_depend_on_the_launch(results, dtype):
    r = results[dtype]
    # Four float32 terms summed in another order: at most one rounding step of the keys' dtype apart.
    assert r["mean_err"] <= (2 ** -7 if dtype == "bfloat16" else 1e-6) * max(1.0, r["mean_scale"]), r
    assert r["alone_equal"], r


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_only_rows_that_complete_a_block_write_it(results, dtype):
    assert results[dtype]["stored_as_expected"], results[dtype]
