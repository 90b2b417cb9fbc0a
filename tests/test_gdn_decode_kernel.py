"""The Gated DeltaNet decode kernel (gdn_decode_kernel.py) on the CPU through Triton's interpreter, against
the torch form the CPU engine uses: same outputs, the same advanced state for active rows, idle rows' state
untouched. Run in a child process: TRITON_INTERPRET must be set before Triton is imported."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

CHILD = r"""
import json, torch
from qwen4exp.engine.model import gdn_decode_kernel, gdn_ops
results = {}
for name in ("float32", "bfloat16"):
    dtype = getattr(torch, name)
    gen = torch.Generator().manual_seed(0)
    n, hk, hv, dk, dv = 3, 2, 4, 16, 16   # the tiny model's head sizes (dv under the 32-wide block)
    q, k = (torch.randn(n, hk, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(n, hv, dv, generator=gen).to(dtype)
    g = -torch.rand(n, hv, generator=gen)
    beta = torch.rand(n, hv, generator=gen).to(dtype)
    active = torch.tensor([True, False, True])
    state = torch.randn(n, hv, dk, dv, generator=gen)
    ours, theirs = state.clone(), state.clone()
    out = gdn_decode_kernel.decode_step(q, k, v, g, beta, active, ours)
    want = gdn_ops.gated_delta_rule_rows(q, k, v, g, beta, active, theirs)
    rows = active.nonzero().flatten()
    results[name] = {
        "out_err": (out[rows].float() - want[rows].float()).abs().max().item(),
        "out_scale": want.float().abs().max().item(),
        "state_err": (ours - theirs).abs().max().item(),
        "idle_state_kept": bool(torch.equal(ours[1], state[1])),
        "idle_out_zero": bool((out[1] == 0).all()),
        "state_moved": (ours[0] - state[0]).abs().max().item(),
    }
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_kernel_matches_the_torch_step(results, dtype):
    r = results[dtype]
    assert r["state_moved"] > 1e-3, "the active row's state must advance"
    assert r["state_err"] < 1e-4, r
    # bf16: the kernel rounds only its output; the torch form also rounds nothing earlier (inputs are shared).
    assert r["out_err"] <= 1e-4 * r["out_scale"] + (1e-2 * r["out_scale"] if dtype == "bfloat16" else 0), r


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_idle_rows_keep_their_state(results, dtype):
    assert results[dtype]["idle_state_kept"] and results[dtype]["idle_out_zero"]
