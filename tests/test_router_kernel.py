"""The router kernel (kernels/router.py), which decode steps and prompt chunks take, on the CPU through Triton's
interpreter, and at the shipped sizes on a GPU: the same experts as torch's softmax + top-k with ties going to
the lower expert id (a stable order), weights within one rounding of the torch form's, NaN rows kept in range,
bad shapes refused. Run in a child process: TRITON_INTERPRET must be set before Triton is imported."""

from __future__ import annotations

import importlib.util
import inspect

import pytest
from triton_interpreter import interpreted_results

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)


def stable_route(logits, k, normalize):
    """torch's router with ties in stable order: highest probability first, then the lower expert id."""
    import torch
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = probs.gather(-1, order)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return order, weights.to(logits.dtype)


def steps_apart(a, b) -> float:
    """The largest difference of a from b in bf16 steps at b's size."""
    step = b.float().abs() * 2.0 ** -7 + 1e-30
    return ((a.float() - b.float()).abs() / step).max().item()


CHILD = "import torch\n" + inspect.getsource(stable_route) + inspect.getsource(steps_apart) + r"""
import json
from qwen4exp.kernels import router as router_kernel

results = {}
gen = torch.Generator().manual_seed(0)
for label, rows, experts, k, normalize in (("shipped", 4, 512, 10, True), ("ragged", 3, 60, 4, False),
                                           ("one expert", 2, 8, 1, True)):
    logits = (torch.randn(rows, experts, generator=gen) * 2).bfloat16()
    logits[0, 5] = logits[0, experts - 1] = logits[0].max() + 1      # a tie for the top place
    ids, weights = router_kernel.route_rows(logits, k, normalize)
    want_ids, want_weights = stable_route(logits, k, normalize)
    results[label] = {"ids_equal": bool(torch.equal(ids, want_ids)), "tie": ids[0, :2].tolist(),
                      "weights_steps": steps_apart(weights, want_weights), "dtype": str(weights.dtype)}
nan = torch.full((1, 512), float("nan")).bfloat16()
results["nan_ids"] = router_kernel.route_rows(nan, 10, True)[0].tolist()
try:
    router_kernel.route_rows(torch.zeros(2, 8), 9, True)
    results["bad"] = "accepted"
except ValueError as err:
    results["bad"] = str(err)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results():
    return interpreted_results(CHILD)


@pytest.mark.parametrize("label", ["shipped", "ragged", "one expert"])
def test_router_kernel_follows_the_torch_router(results, label):
    r = results[label]
    assert r["ids_equal"], r
    assert r["weights_steps"] <= 1.0, r
    assert r["dtype"] == "torch.bfloat16"


def test_ties_go_to_the_lower_expert_and_nan_rows_stay_in_range(results):
    assert results["shipped"]["tie"] == [5, 511]
    assert all(0 <= e < 512 for e in results["nan_ids"][0])
    assert "top_k 9 of 8 experts" in results["bad"]


@pytest.mark.gpu
def test_router_kernel_at_shipped_sizes_on_gpu():
    """512 experts, top 10, 4 decode rows and 4096 rows, on the GPU against torch's router in stable order."""
    import torch
    from qwen4exp.kernels import router as router_kernel

    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows in (4, 4096):
        logits = (torch.randn(rows, 512, generator=gen, device="cuda") * 2).bfloat16()
        with torch.inference_mode():
            assert router_kernel.fits(logits)
            ids, weights = router_kernel.route_rows(logits, 10, True)
        want_ids, want_weights = stable_route(logits, 10, True)
        assert torch.equal(ids, want_ids)
        assert steps_apart(weights, want_weights) <= 1.0
