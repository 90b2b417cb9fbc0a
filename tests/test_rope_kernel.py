"""The rotary-embedding kernel (kernels/rope.py) against the torch form of engine/model/rope.py, bit for bit: on the
CPU through Triton's interpreter (whole and partial rotary, per-head and flat inputs, bf16 and fp16), and on a GPU
at the shipped QSA sizes. Run in a child process: TRITON_INTERPRET must be set before Triton is imported."""

from __future__ import annotations

import importlib.util

import pytest
from triton_interpreter import interpreted_results

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

CHILD = r"""
import json, torch
from qwen4exp.engine.model import rope
from qwen4exp.kernels import rope as rope_kernel

results = {}
gen = torch.Generator().manual_seed(0)
for shape, rotary in (((3, 4, 16), 8), ((5, 32), 32), ((2, 3, 24), 16)):
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(*shape, generator=gen).to(dtype)
        cos, sin = (torch.randn(shape[0], rotary, generator=gen).to(dtype) for _ in range(2))
        got = rope_kernel.rotate(x, cos, sin)
        want = rope.apply_rotary(x, cos, sin)        # CPU tensors: the torch form
        results[f"{shape}/{rotary}/{dtype}"] = bool(torch.equal(got, want))
for name, x, table in (("bad", torch.zeros(2, 8), torch.zeros(3, 8)),
                       ("4-d", torch.zeros(2, 2, 2, 8), torch.zeros(2, 8))):
    try:
        rope_kernel.rotate(x, table, table)
        results[name] = "accepted"
    except ValueError as err:
        results[name] = str(err)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results():
    return interpreted_results(CHILD)


def test_kernel_equals_the_torch_form(results):
    cases = {k: v for k, v in results.items() if k not in ("bad", "4-d")}
    assert len(cases) == 6 and all(cases.values()), cases
    assert "do not fit x (2, 8)" in results["bad"]
    assert "do not fit x (2, 2, 2, 8)" in results["4-d"]


@pytest.mark.gpu
def test_kernel_equals_the_torch_form_on_gpu():
    """QSA's shipped head shapes on the GPU: the kernel against the torch form, bit for bit."""
    import torch
    from qwen4exp.engine.model.rope import Rotary, apply_rotary
    from qwen4exp.kernels import rope as rope_kernel

    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    cos, sin = Rotary(64, 1e7).cos_sin(torch.arange(40000, 44096, device="cuda"), torch.bfloat16)
    for shape in ((4096, 24, 256), (4096, 128), (4, 24, 256)):
        x = torch.randn(*shape, generator=gen, device="cuda").bfloat16()
        n = shape[0]
        with torch.inference_mode():
            got = rope_kernel.rotate(x, cos[:n], sin[:n])
            want = apply_rotary(x, cos[:n], sin[:n])
        assert torch.equal(got, want), shape
