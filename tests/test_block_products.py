"""Products with a weight kept as GGML blocks (kernels/block_products.py): the projections and the LM head of a
quantized GGUF. On the CPU through Triton's interpreter, for every block type: a decode step's few rows give
what row_products gives on the weight's dense twin (its dequantized values in the model's dtype), bit for bit
(the same values, summed alike by the interpreter), whole and split over the input; each row independent of the
rows beside it; a chunk's many rows what F.linear gives on the twin; bad shapes refused. On a GPU: the same
within rounding, at the shapes of the full model's projections. Run in a child process: TRITON_INTERPRET must
be set before Triton is imported."""

from __future__ import annotations

import importlib.util

import pytest
from triton_interpreter import interpreted_results

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

QTYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "FP8_B32", "FP8_B128",
          "Q8_0_R"]

CHILD = r"""
import json, torch, torch.nn.functional as F
from qwen4exp.checkpoint.gguf_blocks import random_blocks
from qwen4exp.engine.model.quantized import QuantizedStack
from qwen4exp.kernels import block_products, row_products
from qwen4exp.kernels.quant_tiles import QTYPES

results = {}
gen = torch.Generator().manual_seed(0)
for qtype in QTYPES:
    # 37 weight rows (a ragged last block of rows), 512 columns (two 256-value tiles: every type's blocks)
    stack = QuantizedStack(qtype, (37, 512), torch.bfloat16)
    stack.blocks.copy_(torch.from_numpy(random_blocks(qtype, (37, 512), 0.05, 11)))
    twin = stack.dequantize()
    checks = {}
    for label, rows, split in (("one row", 1, 1), ("four rows", 4, 1), ("split input", 3, 2), ("sixteen", 16, 1)):
        x = torch.randn(rows, 512, generator=gen).bfloat16()
        config = block_products.plan(37, 512) | {"SPLIT_K": split}   # the products' own tiles, on both sides
        got = block_products.block_row_products(x, stack.blocks, qtype, dict(config))
        checks[label] = bool(torch.equal(got, row_products.row_products(x, twin, dict(config))))
        alone = torch.cat([block_products.block_row_products(x[i:i + 1], stack.blocks, qtype, dict(config))
                           for i in range(rows)])
        checks[label + " alone"] = bool(torch.equal(alone, got))
    x = torch.randn(20, 512, generator=gen).bfloat16()
    checks["chunk"] = bool(torch.equal(block_products.linear(x, stack), F.linear(x, twin)))
    checks["decode through linear"] = bool(torch.equal(block_products.linear(x[:3], stack),
                                                       block_products.block_row_products(x[:3], stack.blocks, qtype)))
    results[qtype] = checks
try:
    block_products.block_row_products(torch.zeros(2, 64).bfloat16(), torch.zeros(4, 30, dtype=torch.uint8), "Q8_0")
    results["bad_shape"] = "accepted"
except ValueError as err:
    results["bad_shape"] = str(err)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results():
    return interpreted_results(CHILD)


@pytest.mark.parametrize("qtype", QTYPES)
def test_block_products_are_the_dense_twins_products(results, qtype):
    checks = results[qtype]
    assert checks == dict.fromkeys(checks, True), {name: ok for name, ok in checks.items() if not ok}
    assert len(checks) == 10


def test_a_weight_of_the_wrong_shape_is_refused_with_its_shape(results):
    assert "blocks [N, K / 32 * 34]" in results["bad_shape"] and "(4, 30)" in results["bad_shape"]


@pytest.mark.gpu
@pytest.mark.parametrize("qtype, shape", [("Q8_0", (248320, 2560)), ("Q8_0", (16384, 2560)), ("Q8_0", (2560, 6144)),
                                          ("Q8_0", (2560, 640)), ("Q8_0", (324, 10240)), ("Q4_K", (12288, 2560)),
                                          ("Q6_K", (2560, 6144)), ("IQ4_XS", (640, 2560)),
                                          ("Q8_0_R", (248320, 2560)), ("Q8_0_R", (2560, 6144)),
                                          ("Q8_0_R", (324, 10240))])
def test_decode_shapes_give_the_dense_twins_products_on_gpu(qtype, shape):
    """Compiled: within one rounding of row_products on the twin (compiled tilings may sum in another order), and
    each row independent of the others."""
    import torch

    from qwen4exp.checkpoint.gguf_blocks import random_blocks
    from qwen4exp.engine.model.quantized import QuantizedStack
    from qwen4exp.kernels import block_products, row_products

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    stack = QuantizedStack(qtype, shape, torch.bfloat16)
    stack.blocks.copy_(torch.from_numpy(random_blocks(qtype, shape, 0.02, 5)))
    stack = stack.cuda()
    twin = stack.dequantize()
    x = torch.randn(4, shape[1], device="cuda").bfloat16()
    got = block_products.linear(x, stack)
    want = row_products.row_products(x, twin)
    assert (got.double() - want.double()).abs().max() <= 2 ** -7 * want.double().abs().max() + 1e-6
    assert torch.equal(block_products.linear(x[2:3], stack)[0], got[2])
    chunk = torch.randn(64, shape[1], device="cuda").bfloat16()
    assert torch.equal(block_products.linear(chunk, stack), torch.nn.functional.linear(chunk, twin))
    if qtype == "Q8_0_R":                  # regrouped: the products of the Q8_0 blocks it came from, bit for bit
        from qwen4exp.engine.model.quant_blocks import join_q8_0
        assert torch.equal(got, block_products.block_row_products(x, join_q8_0(stack.blocks), "Q8_0"))
