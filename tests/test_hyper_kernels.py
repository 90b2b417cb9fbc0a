"""The fused hyper-connection and RMSNorm kernels (kernels/hyper.py) on the CPU through Triton's interpreter,
against the torch forms the CPU engine runs: the same streams after a PLE add or a sublayer injection (bit for
bit), the same normed values, mixed sublayer input and gates up to float32 summation order, and a row's result
independent of the rows beside it. Run in a child process: TRITON_INTERPRET must be set before Triton is
imported."""

from __future__ import annotations

import importlib.util

import pytest
from triton_interpreter import interpreted_results

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

CHILD = r"""
import json, torch
from qwen4exp.kernels import hyper as hyper_kernels
from types import SimpleNamespace
from qwen4exp.engine.model.hyper import GatedResidual, inject
from qwen4exp.engine.model.norms import RMSNorm
from qwen4exp.engine.model.ops import TORCH_OPS
TORCH_CHUNK = SimpleNamespace(ops=TORCH_OPS, decode=False)   # what GatedResidual reads of a step

def err(a, b):
    return (a.float() - b.float()).abs().max().item()

results = {}
gen = torch.Generator().manual_seed(0)
for label, hidden, low_rank, rows in (("tiny", 64, 16, 3), ("ragged", 48, 40, 3), ("many rows", 64, 16, 70),
                                      ("a long chunk's rows", 64, 16, 300)):
    hc, dtype = 4, torch.bfloat16
    res = GatedResidual(hidden, hc, low_rank, 1e-6)
    with torch.no_grad():
        for p in res.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    res = res.to(dtype)
    streams = torch.randn(rows, hc * hidden, generator=gen).to(dtype)
    out = torch.randn(rows, hidden, generator=gen).to(dtype)
    term = torch.randn(rows, hc * hidden, generator=gen).to(dtype)
    with torch.inference_mode():
        for update, kwargs in (("none", {}), ("add", {"add": term})):
            want_streams, want_mixed, want_gates = res(streams, TORCH_CHUNK, **kwargs)
            new, normed = hyper_kernels.norm_rows(streams, res.hc_norm.weight, res.hc_norm.eps, hidden, **kwargs)
            gate_logits = res.block_inject_weight(normed)
            mixed, gates = hyper_kernels.mix_streams(res.input_mix_weight_down(normed), res.input_mix_weight_up.weight,
                                                     normed, hc, gate_logits)
            alone = [hyper_kernels.mix_streams(res.input_mix_weight_down(normed[i:i + 1]), res.input_mix_weight_up.weight,
                                               normed[i:i + 1], hc, gate_logits[i:i + 1])[0] for i in range(rows)]
            results[f"{label}/{update}"] = {
                "streams_equal": bool(torch.equal(new, want_streams)),
                "normed_err": err(normed, res.hc_norm(want_streams)),
                "mixed_err": err(mixed, want_mixed), "mixed_scale": want_mixed.float().abs().max().item(),
                "gates_err": err(gates, want_gates),
                "alone_equals_together": rows > 64 or all(torch.equal(a[0], m) for a, m in zip(alone, mixed)),
            }
        gates = 2 * torch.sigmoid(torch.randn(rows, hc, generator=gen)).to(dtype)
        want = inject(streams, out, gates)
        new, normed = hyper_kernels.norm_rows(streams, res.hc_norm.weight, res.hc_norm.eps, hidden, inject=(out, gates))
        results[f"{label}/inject"] = {"streams_equal": bool(torch.equal(new, want)),
                                      "normed_err": err(normed, res.hc_norm(want))}
norm = RMSNorm(32, 1e-6)
with torch.no_grad():
    norm.weight.copy_(torch.randn(32, generator=gen))
norm = norm.to(torch.bfloat16)
heads = torch.randn(5, 3, 32, generator=gen).to(torch.bfloat16)
_, normed = hyper_kernels.norm_rows(heads, norm.weight, norm.eps, 32)
results["head norm"] = {"normed_err": err(normed, norm(heads)), "shape": list(normed.shape)}
print(json.dumps(results))
"""

# One bf16 step at |x| ~ 4 is 2**-5; the fused forms may land one rounding step away where float32 sums differ.
BF16_STEP = 2 ** -5


@pytest.fixture(scope="module")
def results():
    return interpreted_results(CHILD)


CASES = [f"{label}/{update}" for label in ("tiny", "ragged", "many rows", "a long chunk's rows")
         for update in ("none", "add", "inject")]


@pytest.mark.parametrize("case", CASES)
def test_streams_update_is_exact_and_norm_matches(results, case):
    r = results[case]
    assert r["streams_equal"], "the added or injected streams must equal torch's bf16 result bit for bit"
    assert r["normed_err"] <= 2 * BF16_STEP, r


@pytest.mark.parametrize("case", [c for c in CASES if not c.endswith("inject")])
def test_mixed_input_and_gates_match_torch(results, case):
    r = results[case]
    assert r["mixed_scale"] > 0.05, "the mixed input must not be degenerate"
    assert r["mixed_err"] <= 2 * BF16_STEP, r
    assert r["gates_err"] <= 2 ** -7, r   # gates lie in (0, 2): one bf16 step there is 2**-7
    assert r["alone_equals_together"], "a row's mixed input must not depend on the rows beside it"


def test_one_group_per_row_is_the_plain_rms_norm(results):
    r = results["head norm"]
    assert r["shape"] == [5, 3, 32]
    assert r["normed_err"] <= 2 * BF16_STEP, r


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 128, 4096])
def test_fused_forms_follow_torch_at_shipped_sizes_on_gpu(rows):
    """The shipped hyper-connection sizes (4 x 2560 streams, rank 320) on the GPU: the fused update + norm + mix
    (and the plain norms) of the Triton ops against the torch ops."""
    from types import SimpleNamespace

    import torch
    from qwen4exp.engine.model.hyper import GatedResidual
    from qwen4exp.engine.model.norms import GatedRMSNorm, RMSNorm
    from qwen4exp.engine.model.ops import TORCH_OPS
    from qwen4exp.engine.model.triton_ops import TRITON_OPS

    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden, hc = 2560, 4
    res = GatedResidual(hidden, hc, 320, 1e-6).cuda()
    for p in res.parameters():
        p.requires_grad_(False).copy_(torch.randn(p.shape, generator=gen, device="cuda") * 0.05)
    res = res.bfloat16()
    streams = torch.randn(rows, hc * hidden, generator=gen, device="cuda").bfloat16()
    out = torch.randn(rows, hidden, generator=gen, device="cuda").bfloat16()
    gates = (2 * torch.rand(rows, hc, generator=gen, device="cuda")).bfloat16()
    with torch.inference_mode():
        want = res(streams, SimpleNamespace(ops=TORCH_OPS, decode=False), inject=(out, gates))
        got = res(streams, SimpleNamespace(ops=TRITON_OPS, decode=False), inject=(out, gates))
    assert torch.equal(got[0], want[0]), "the injected streams must match bit for bit"
    mixed_err = (got[1].float() - want[1].float()).abs()
    assert mixed_err.max().item() <= 2 * BF16_STEP, mixed_err.max()
    assert mixed_err.mean().item() <= 1e-3, "all but a few values should agree exactly"
    assert (got[2].float() - want[2].float()).abs().max().item() <= 2 ** -7
    for norm, args in ((RMSNorm(256, 1e-6), (torch.randn(rows, 24, 256, generator=gen, device="cuda"),)),
                       (GatedRMSNorm(128, 1e-6, "silu"), tuple(torch.randn(rows * 48, 128, generator=gen, device="cuda")
                                                                for _ in range(2)))):
        norm = norm.cuda().bfloat16().requires_grad_(False)
        args = tuple(a.bfloat16() for a in args)
        with torch.inference_mode():
            want = norm(*args)
            ops = TRITON_OPS
            got = ops.rms_norm(*args, norm) if isinstance(norm, RMSNorm) else ops.gated_rms_norm(*args, norm)
        assert (got.float() - want.float()).abs().max().item() <= 2 * BF16_STEP * max(1.0, want.abs().max().item())
