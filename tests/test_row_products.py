"""The decode step's matrix-product kernel (row_products.py): on the CPU through Triton's interpreter, against
the float32 product rounded once (what F.linear computes, up to summation order), whole and split over the
input; a row's result independent of the rows beside it; bad shapes refused. On a GPU, at the shapes a decode
step of the shipped sizes hands it. Run in a child process: TRITON_INTERPRET must be set before
Triton is imported."""

from __future__ import annotations

import importlib.util

import pytest
from triton_interpreter import interpreted_results

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

CHILD = r"""
import json, torch
from qwen4exp.kernels import row_products

results = {}
gen = torch.Generator().manual_seed(0)
# (the narrow tiles are the projections' plan, 16 weight rows by 128 inputs, here on a small weight)
for label, rows, n, k, split, plan in (("one row", 1, 40, 300, 1, row_products.wide_tile_plan),
                                       ("four rows, ragged", 4, 37, 200, 1, row_products.wide_tile_plan),
                                       ("split input", 3, 20, 2100, 4, row_products.wide_tile_plan),
                                       ("sixteen rows", 16, 16, 64, 1, row_products.wide_tile_plan),
                                       ("narrow tiles, split", 4, 37, 700, 2, row_products.narrow_tile_plan)):
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
        config = plan(n, k) | {"SPLIT_K": split}
        got = row_products.row_products(x, w, config)
        exact = x.double() @ w.double().T
        # The error beyond float32 summation noise, in units of the dtype's relative step at each value's size
        # (2^-7 for bfloat16, 2^-10 for float16): rounding to nearest stays within 0.5, truncating does not.
        noise = (x.double().abs() @ w.double().abs().T) * 2.0 ** -20
        relative = 2.0 ** -(7 if dtype == torch.bfloat16 else 10)
        beyond = ((got.double() - exact).abs() - noise).clamp_min(0)
        steps = torch.where(beyond > 0, beyond / (exact.abs() * relative), torch.zeros_like(beyond))
        alone = torch.cat([row_products.row_products(x[i:i + 1], w, config) for i in range(rows)])
        results[f"{label}/{dtype}"] = {
            "dtype_kept": got.dtype == dtype and tuple(got.shape) == (rows, n),
            "err_in_steps": steps.max().item(),
            "alone_equal": bool(torch.equal(alone, got)),
        }
# A split sum's last program adds the parts (rounding.finish_parts): again and again the same bits, its counts
# back at zero after each launch.
from qwen4exp.kernels import rounding
x = torch.randn(3, 2100, generator=gen).to(torch.bfloat16)
w = (torch.randn(20, 2100, generator=gen) * 0.1).to(torch.bfloat16)
config = row_products.plan(20, 2100) | {"SPLIT_K": 4}
first = row_products.row_products(x, w, config)
again = [row_products.row_products(x, w, config) for _ in range(3)]
results["split_again"] = {"equal": all(torch.equal(first, a) for a in again),
                          "counts_left": int(rounding.part_counts(torch.device("cpu"), (1, 1)).abs().sum())}
try:
    row_products.row_products(torch.zeros(2, 8), torch.zeros(4, 9))
    results["bad_shape"] = "accepted"
except ValueError as err:
    results["bad_shape"] = str(err)
# A verify step of 4 slots x 5 positions (20 rows, position-major) against its five plain steps of 4 rows, through
# the Triton backend: a weight the row kernel takes (20 rows in fixed 16-row tiles), a weight it does not take (rows
# not contiguous: cuBLAS on a GPU, F.linear here) and streams [rows, 2, K] (F.linear too), whose products must run
# a sub-step at a time at the plain step's shape; the shapes F.linear was given are recorded.
import torch.nn.functional as F
from types import SimpleNamespace
from qwen4exp.engine.model import triton_ops
given = []
def recording_linear(x, weight):
    given.append(list(x.shape))
    return F.linear(x, weight)
triton_ops.F = row_products.F = SimpleNamespace(linear=recording_linear)
ops = triton_ops.TritonOps()
w = (torch.randn(40, 300, generator=gen) * 0.1).to(torch.bfloat16)
for label, shape, weight in (("row kernel", (20, 300), w), ("F.linear", (20, 300), w.T.contiguous().T),
                             ("F.linear, streams", (20, 2, 300), w)):
    x = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    plain = SimpleNamespace(decode=True, substeps=1)
    steps = torch.cat([ops.linear(x[i:i + 4], weight, plain) for i in range(0, 20, 4)])
    given.clear()
    together = ops.linear(x, weight, SimpleNamespace(decode=True, substeps=5))
    results[f"verify, {label}"] = {"equal": bool(torch.equal(together, steps)), "shape": list(together.shape),
                                   "f_linear_given": list(given)}
from qwen4exp.engine.model.backend import ops_for
from qwen4exp.engine.model.ops import TORCH_OPS
results["cpu_uses_f_linear"] = ops_for(torch.zeros(4, 8, dtype=torch.bfloat16)) is TORCH_OPS
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results():
    return interpreted_results(CHILD)


@pytest.mark.parametrize("label", ["one row", "four rows, ragged", "split input", "sixteen rows",
                                   "narrow tiles, split"])
@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float16"])
def test_products_match_the_rounded_float32_product(results, label, dtype):
    r = results[f"{label}/{dtype}"]
    assert r["dtype_kept"], r
    assert r["err_in_steps"] <= 0.5, r     # one rounding to nearest of a float32 sum
    if dtype == "torch.bfloat16":
        # The interpreter's tl.dot is numpy's matmul, whose order of a row's sum can depend on the row's place in
        # the tile (seen: one float16 step); the GPU test below holds the compiled kernel to it in bfloat16.
        assert r["alone_equal"], "a row's product must not depend on the rows beside it"


def test_a_verify_steps_products_give_each_row_its_plain_steps_numbers(results):
    """TritonOps runs a verify step's products (its positions' rows together) as its plain steps run them: a weight
    the row kernel takes in its fixed 16-row tiles, one read for all 20 rows; one that goes to cuBLAS (F.linear) a
    sub-step at a time, at the plain step's 4 rows, since cuBLAS picks its kernel by the row count."""
    assert results["verify, row kernel"] == {"equal": True, "shape": [20, 40], "f_linear_given": []}
    assert results["verify, F.linear"] == {"equal": True, "shape": [20, 40], "f_linear_given": [[4, 300]] * 5}
    assert results["verify, F.linear, streams"] == {"equal": True, "shape": [20, 2, 40],
                                                    "f_linear_given": [[4, 2, 300]] * 5}


def test_bad_shapes_are_refused_and_cpu_tensors_go_to_f_linear(results):
    assert "x (2, 8)" in results["bad_shape"] and "weight (4, 9)" in results["bad_shape"], results["bad_shape"]
    assert results["cpu_uses_f_linear"]


def test_a_split_sum_repeats_bit_for_bit_and_leaves_its_counts_at_zero(results):
    assert results["split_again"] == {"equal": True, "counts_left": 0}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(248320, 2560), (1793, 2560), (640, 2560), (324, 10240), (16480, 2560),
                                   (12288, 2560), (2560, 6144), (2560, 2560), (10240, 320), (2560, 640)])
def test_decode_shapes_within_one_rounding_on_gpu(shape):
    """The weights a decode step of the shipped sizes gives the kernel (LM head, MoE stack, QSA indexer,
    hyper-connection stack, and the projections in narrow tiles), 4 rows: within one bf16 rounding of the exact
    product, rows independent."""
    import torch
    import torch.nn.functional as F
    from qwen4exp.kernels import row_products

    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, k = shape
    x = torch.randn(4, k, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=gen, device="cuda") * 0.05).bfloat16()
    with torch.inference_mode():
        assert row_products.kernel_takes(x, w)
        got = row_products.linear(x, w)
        want = F.linear(x, w)
        alone = torch.cat([row_products.linear(x[i:i + 1], w) for i in range(4)])
    exact = x.float() @ w.float().T
    step = torch.maximum(exact.abs() * 2.0 ** -7, (x.float().abs() @ w.float().abs().T) * 2.0 ** -20)
    ours = ((got.float() - exact).abs() / step).max().item()
    cublas = ((want.float() - exact).abs() / step).max().item()
    # One rounding of a float32 sum; cuBLAS may round more (its split-K partial sums of 4 rows can be bf16).
    assert ours <= 1.0, (ours, cublas)
    assert torch.equal(alone, got), "a row's product must not depend on the rows beside it"


@pytest.mark.gpu
def test_split_sums_finished_by_their_last_program_are_stable_on_gpu():
    """A weight of few rows and a long input (the hyper-connections' 324 x 10240, split over programs): its last
    program per block adds the parts, whatever order the programs ran in, so 50 launches and 10 replays of a CUDA
    graph give the first launch's bits, and the counts the last program reads are back at zero."""
    import torch
    from qwen4exp.engine.cuda_graph import capture_graph
    from qwen4exp.kernels import rounding, row_products

    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm device")
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(4, 10240, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(324, 10240, generator=gen, device="cuda") * 0.05).bfloat16()
    assert row_products.plan(324, 10240)["SPLIT_K"] > 1
    with torch.inference_mode():
        first = row_products.linear(x, w)
        launches = [row_products.linear(x, w) for _ in range(50)]
        out = {}
        graph, _ = capture_graph(lambda: out.__setitem__("y", row_products.linear(x, w)), x.device)
        replays = []
        for _ in range(10):
            graph.replay()
            replays.append(out["y"].clone())
        torch.cuda.synchronize()
    assert all(torch.equal(first, y) for y in launches + replays)
    assert int(rounding.part_counts(x.device, (1, 1)).abs().sum()) == 0
