"""The gate product kernel (kernels/gate_product.py: act(gate) * x in one launch) against the torch form the CPU
engine runs (ops.TorchOps.gate_product): the shared expert's SwiGLU input (silu; gate and up are views of the
shared-input product's rows) and QSA's gated output (sigmoid; the gate a strided per-head view), at 1, 3 and 37
rows and widths under and over one program's block, bf16 and fp16. On the CPU through Triton's interpreter (run in
a child process: TRITON_INTERPRET must be set before Triton is imported) and on a GPU at the full model's sizes.
The kernel computes act in float32 as torch does and rounds where torch rounds; exp (and on a GPU the division) may
differ in its last float32 bit between the two (numpy's under the interpreter, the GPU's approximate instructions
compiled), which can move a rounded value.
"""

from __future__ import annotations

import importlib.util

import pytest
from triton_interpreter import interpreted_results

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

CHILD = r"""
import json, torch
from qwen4exp.engine.model.ops import TORCH_OPS
from qwen4exp.kernels import gate_product

def ulps(got, want):
    # distance in representable steps of the dtype (both finite, same sign or zero here)
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16}[got.dtype]
    return (got.view(bits).int() - want.view(bits).int()).abs().max().item()

results = {}
gen = torch.Generator().manual_seed(0)
for dtype in (torch.bfloat16, torch.float16):
    for rows in (1, 3, 37):
        for width in (40, 1100):
            # the shared-input product's rows: router logits, gate, up, the shared gate's logit
            product = (torch.randn(rows, 7 + 2 * width + 1, generator=gen) * 4).to(dtype)
            gate, up = product[:, 7:7 + width], product[:, 7 + width:7 + 2 * width]
            got = gate_product.gate_product(up, gate, silu=True)
            want = TORCH_OPS.gate_product(up, gate, silu=True)
            results[f"silu {dtype} {rows}x{width}"] = [ulps(got, want), bool(torch.equal(got, want)),
                                                       list(got.shape) == list(want.shape)]
        heads, dim = 3, 48
        q_and_gate = (torch.randn(rows, heads, 2 * dim, generator=gen) * 4).to(dtype)
        gate = q_and_gate.chunk(2, dim=-1)[1]
        out = torch.randn(rows, heads * dim, generator=gen).to(dtype)
        got = gate_product.gate_product(out.unflatten(-1, (heads, dim)), gate, silu=False)
        want = TORCH_OPS.gate_product(out.unflatten(-1, (heads, dim)), gate, silu=False)
        results[f"sigmoid {dtype} {rows}x{heads}x{dim}"] = [ulps(got, want), bool(torch.equal(got, want)),
                                                            list(got.shape) == [rows, heads * dim]]
try:
    gate_product.gate_product(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, 9, dtype=torch.bfloat16), True)
    results["mismatch"] = "accepted"
except ValueError as err:
    results["mismatch"] = str(err)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results():
    return interpreted_results(CHILD)


def test_kernel_follows_the_torch_form(results):
    cases = {k: v for k, v in results.items() if k != "mismatch"}
    assert len(cases) == 18, cases
    assert all(shape_ok for _, _, shape_ok in cases.values()), cases
    # bfloat16, the dtype models serve in: bit for bit. float16 keeps three more bits, so one float32 step of exp
    # shows more often; a step of act can move the product by two.
    assert all(equal for k, (_, equal, _) in cases.items() if "bfloat16" in k), cases
    assert all(ulps <= 2 for _, (ulps, _, _) in cases.items()), cases


def test_a_shape_the_kernel_does_not_take_is_refused(results):
    assert "gate product: x (2, 8)" in results["mismatch"] and "gate (2, 9)" in results["mismatch"]


@pytest.mark.gpu
def test_kernel_follows_the_torch_form_on_gpu():
    """The full model's shapes on the GPU (shared expert 640 wide, QSA 24 heads of 256) at 1, 4 and 4096 rows."""
    import torch
    from qwen4exp.engine.model.ops import TORCH_OPS
    from qwen4exp.kernels import gate_product

    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows in (1, 4, 4096):
        product = (torch.randn(rows, 512 + 2 * 640 + 1, generator=gen, device="cuda") * 4).bfloat16()
        gate, up = product[:, 512:1152], product[:, 1152:1792]
        got, want = gate_product.gate_product(up, gate, True), TORCH_OPS.gate_product(up, gate, True)
        assert (got.view(torch.int16).int() - want.view(torch.int16).int()).abs().max() <= 1, rows
        assert (got == want).float().mean() > 0.999, rows
        q_and_gate = (torch.randn(rows, 24, 512, generator=gen, device="cuda") * 4).bfloat16()
        out = torch.randn(rows, 24, 256, generator=gen, device="cuda").bfloat16()
        gate = q_and_gate.chunk(2, dim=-1)[1]
        got, want = gate_product.gate_product(out, gate, False), TORCH_OPS.gate_product(out, gate, False)
        assert (got.view(torch.int16).int() - want.view(torch.int16).int()).abs().max() <= 1, rows
        assert (got == want).float().mean() > 0.999, rows
