"""The Gated DeltaNet decode kernels on the CPU through Triton's interpreter, against the torch forms the CPU
engine uses: the delta-rule step (kernels/delta_rule.py: same outputs, the same advanced state for active rows,
idle rows' state untouched, q/k/v read in place from the conv output) and its loop over a short prompt chunk,
the causal conv step (kernels/conv.py, also PLE's dilated conv) and the gated output norm
(kernels/gated_norm.py). Run in a child process: TRITON_INTERPRET must be set before Triton is imported."""

from __future__ import annotations

import importlib.util

import pytest
from triton_interpreter import interpreted_results

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

CHILD = r"""
import json, torch
import torch.nn.functional as F
from qwen4exp.engine.model import conv, delta_rule
from qwen4exp.kernels import conv as conv_kernels
from qwen4exp.kernels import delta_rule as delta_rule_kernels
from qwen4exp.kernels import gated_norm
from qwen4exp.engine.model.norms import GatedRMSNorm
results = {}
gen = torch.Generator().manual_seed(0)
for name in ("float32", "bfloat16"):
    dtype = getattr(torch, name)
    n, hk, hv, dk, dv = 3, 2, 4, 16, 16   # the tiny model's head sizes (dv under the 32-wide block)
    conv_out = torch.randn(n, 2 * hk * dk + hv * dv, generator=gen).to(dtype)    # q, k, v side by side
    q, k, v = torch.split(conv_out, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hv, dv))
    gate_rows = torch.randn(n, 2 * hv + 3, generator=gen).to(dtype)      # a and b: views of one projection
    a, b = gate_rows[:, :hv], gate_rows[:, hv:2 * hv]
    a_log, dt_bias = torch.randn(hv, generator=gen).to(dtype), torch.rand(hv, generator=gen).to(dtype)
    active = torch.tensor([True, False, True])
    state = torch.randn(n, hv, dk, dv, generator=gen)
    ours, theirs = state.clone(), state.clone()
    out = delta_rule_kernels.decode_step(q, k, v, a, b, a_log, dt_bias, active, ours)
    want = delta_rule.gated_delta_rule_rows(q, k, v, a, b, a_log, dt_bias, active, theirs)
    rows = active.nonzero().flatten()
    results[name] = {
        "out_err": (out[rows].float() - want[rows].float()).abs().max().item(),
        "out_scale": want.float().abs().max().item(),
        "state_err": (ours - theirs).abs().max().item(),
        "idle_state_kept": bool(torch.equal(ours[1], state[1])),
        "idle_out_zero": bool((out[1] == 0).all()),
        "state_moved": (ours[0] - state[0]).abs().max().item(),
    }
    for label, taps, dilation in (("gdn conv", 4, 1), ("ple conv", 4, 3)):
        channels = 40
        kept = torch.randn(n, channels, (taps - 1) * dilation, generator=gen).to(dtype)
        x = torch.randn(n, 2 * channels, generator=gen).to(dtype)[:, :channels]    # a row-strided view
        weight = torch.randn(channels, 1, taps, generator=gen).to(dtype)
        ours, theirs = kept.clone(), kept.clone()
        got = conv_kernels.conv_step(ours, x, weight, dilation, active)
        torch_out = conv.causal_conv_step(theirs, x, weight, dilation, active)
        results[f"{name} {label}"] = {
            "out_err": (got.float() - torch_out.float()).abs().max().item(),
            "out_scale": torch_out.float().abs().max().item(),
            "state_equal": bool(torch.equal(ours, theirs)),
            "state_moved": bool(not torch.equal(ours[0], kept[0])),
        }
        for length in (2, 37):       # shorter than the kept inputs, and several row blocks
            chunk = torch.randn(length, channels, generator=gen).to(dtype)
            ours, theirs = kept[0].clone(), kept[0].clone()
            got = conv_kernels.conv_chunk(ours, chunk, weight, dilation)
            conv.keep_last_inputs(ours, chunk)                               # as TritonOps.causal_conv moves them
            want = conv.causal_conv_chunk(theirs, chunk, weight, dilation)   # the torch form on the CPU
            results[f"{name} {label} chunk {length}"] = {
                "out_err": (got.float() - want.float()).abs().max().item(),
                "out_scale": want.float().abs().max().item(),
                "state_equal": bool(torch.equal(ours, theirs)), "state_moved": bool(not torch.equal(ours, kept[0]))}
    norm = GatedRMSNorm(dv, 1e-6, "silu")
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dv, generator=gen) + 0.5)
    norm = norm.to(dtype)
    x, z = (torch.randn(n * hv, dv, generator=gen).to(dtype) for _ in range(2))
    with torch.inference_mode():
        want = norm(x, z)
    got = gated_norm.gated_norm(x, z, norm.weight, norm.eps, silu=True)
    results[f"{name} gated norm"] = {"out_err": (got.float() - want.float()).abs().max().item(),
                                     "out_scale": want.float().abs().max().item()}
    # A 1-slot engine's step: the heads of a lone row's views, as GatedDeltaNet makes them.
    lone = torch.randn(1, 2 * hk * dk + hv * dv, generator=gen).to(dtype)
    q, k, v = torch.split(lone, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(1, hk, dk), k.reshape(1, hk, dk), v.reshape(1, hv, dv)
    state = torch.randn(1, hv, dk, dv, generator=gen)
    ours, theirs = state.clone(), state.clone()
    one = torch.tensor([True])
    out = delta_rule_kernels.decode_step(q, k, v, a[:1], b[:1], a_log, dt_bias, one, ours)
    want = delta_rule.gated_delta_rule_rows(q, k, v, a[:1], b[:1], a_log, dt_bias, one, theirs)
    results[f"{name} one row"] = {"out_err": (out.float() - want.float()).abs().max().item(),
                                  "out_scale": want.float().abs().max().item(),
                                  "state_err": (ours - theirs).abs().max().item()}
    # A short prompt chunk token by token (chunk_tokens) against the decode step on each token in turn, and
    # against the torch chunked form a CPU engine runs: three value heads a key head, two value blocks each.
    tokens, hv, dv = 37, 6, 64
    a_log, dt_bias = torch.randn(hv, generator=gen).to(dtype), torch.rand(hv, generator=gen).to(dtype)
    conv_out = torch.randn(tokens, 2 * hk * dk + hv * dv, generator=gen).to(dtype)
    q, k, v = torch.split(conv_out, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hv, dv))
    gate_rows = torch.randn(tokens, 2 * hv + 3, generator=gen).to(dtype)
    a, b = gate_rows[:, :hv], gate_rows[:, hv:2 * hv]
    start = torch.randn(hv, dk, dv, generator=gen) * 0.1
    chunked, stepped, torch_state = start.clone(), start[None].clone(), start.clone()
    out = delta_rule_kernels.chunk_tokens(q, k, v, a, b, a_log, dt_bias, chunked)
    steps = torch.cat([delta_rule_kernels.decode_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], a[t:t + 1], b[t:t + 1],
                                                      a_log, dt_bias, one, stepped) for t in range(tokens)])
    g, beta = delta_rule.gates(a, b, a_log, dt_bias)
    want = delta_rule.chunked_gated_delta_rule(q, k, v, g, beta, torch_state)
    results[f"{name} chunk tokens"] = {
        "equal_to_steps": bool(torch.equal(out, steps) and torch.equal(chunked, stepped[0])),
        "out_err": (out.float() - want.float()).abs().max().item(),
        "out_scale": want.float().abs().max().item(),
        "state_err": (chunked - torch_state).abs().max().item(),
        "state_scale": torch_state.abs().max().item(),
        "state_moved": (chunked - start).abs().max().item(),
    }
    # A verify step's 3 sub-steps over 3 state rows in one launch (verify_steps, conv_substeps) against the decode
    # step run sub-step after sub-step, rows idle in some sub-steps and active in later ones; the history has room
    # for one more sub-step than the step keeps, which must stay as it was.
    substeps, n = 3, 3
    flags = torch.tensor([[True, False, True], [True, True, False], [False, True, True]])    # [sub-step, row]
    conv_out = torch.randn(substeps * n, 2 * hk * dk + hv * dv, generator=gen).to(dtype)
    q, k, v = torch.split(conv_out, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hv, dv))
    gate_rows = torch.randn(substeps * n, 2 * hv + 3, generator=gen).to(dtype)
    a, b = gate_rows[:, :hv], gate_rows[:, hv:2 * hv]
    start = torch.randn(n, hv, dk, dv, generator=gen) * 0.1

    def stepped_through(step, state, rows):
        outs, kept = [], []
        for j in range(substeps):
            outs.append(step(*(r[j * n:(j + 1) * n] for r in rows), flags[j], state))
            kept.append(state.clone())
        return torch.cat(outs), torch.stack(kept)

    ours, history = start.clone(), torch.full((substeps, *start.shape), float("nan"))
    out = delta_rule_kernels.verify_steps(q, k, v, a, b, a_log, dt_bias, flags.flatten(), ours, history, substeps)
    want, kept = stepped_through(lambda q, k, v, a, b, on, state: delta_rule_kernels.decode_step(
        q, k, v, a, b, a_log, dt_bias, on, state), start.clone(), [q, k, v, a, b])
    results[f"{name} verify steps"] = {
        "out_equal": bool(torch.equal(out, want)), "state_equal": bool(torch.equal(ours, kept[-1])),
        "history_equal": bool(torch.equal(history[:substeps - 1], kept[:-1])),
        "history_rest_untouched": bool(history[substeps - 1].isnan().all()),
        "state_moved": bool(not torch.equal(ours, start))}
    for label, taps, dilation in (("gdn conv", 4, 1), ("ple conv", 4, 3)):
        channels = 40
        kept_inputs = torch.randn(n, channels, (taps - 1) * dilation, generator=gen).to(dtype)
        x = torch.randn(substeps * n, 2 * channels, generator=gen).to(dtype)[:, :channels]
        weight = torch.randn(channels, 1, taps, generator=gen).to(dtype)
        ours, history = kept_inputs.clone(), torch.full((substeps, *kept_inputs.shape), float("nan")).to(dtype)
        out = conv_kernels.conv_substeps(ours, history, x, weight, dilation, flags.flatten(), substeps)
        want, kept = stepped_through(lambda x, on, state: conv_kernels.conv_step(state, x, weight, dilation, on),
                                     kept_inputs.clone(), [x])
        results[f"{name} {label} verify steps"] = {
            "out_equal": bool(torch.equal(out, want)), "state_equal": bool(torch.equal(ours, kept[-1])),
            "history_equal": bool(torch.equal(history[:substeps - 1], kept[:-1])),
            "history_rest_untouched": bool(history[substeps - 1].isnan().all()),
            "state_moved": bool(not torch.equal(ours, kept_inputs))}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results():
    return interpreted_results(CHILD)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_kernel_matches_the_torch_step(results, dtype):
    r = results[dtype]
    assert r["state_moved"] > 1e-3, "the active row's state must advance"
    assert r["state_err"] < 1e-4, r
    # bf16: the kernel rounds only its output; the torch form also rounds nothing earlier (inputs are shared).
    assert r["out_err"] <= 1e-4 * r["out_scale"] + (1e-2 * r["out_scale"] if dtype == "bfloat16" else 0), r


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_kernel_takes_a_lone_row(results, dtype):
    """A 1-slot engine gives the kernel one row, whose views may carry any stride on their size-1 dimension."""
    r = results[f"{dtype} one row"]
    assert r["state_err"] < 1e-4, r
    assert r["out_err"] <= 1e-4 * r["out_scale"] + (1e-2 * r["out_scale"] if dtype == "bfloat16" else 0), r


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_idle_rows_keep_their_state(results, dtype):
    assert results[dtype]["idle_state_kept"] and results[dtype]["idle_out_zero"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("conv", ["gdn conv", "ple conv", "gdn conv chunk 2", "ple conv chunk 2",
                                  "gdn conv chunk 37", "ple conv chunk 37"])
def test_conv_kernels_match_the_torch_conv(results, dtype, conv):
    r = results[f"{dtype} {conv}"]
    # Decode: active rows shift in the new input, idle rows keep theirs. A chunk: the kept inputs move on after the
    # kernel (conv.keep_last_inputs) to the torch form's, from the chunk alone or with the kept ones before it.
    assert r["state_equal"] and r["state_moved"], r
    # Sums of 4 taps in float32 in another order: at most one rounding step of the output's dtype apart.
    assert r["out_err"] <= (2 ** -7 if dtype == "bfloat16" else 1e-5) * max(1.0, r["out_scale"]), r


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gated_norm_kernel_matches_the_torch_norm(results, dtype):
    r = results[f"{dtype} gated norm"]
    assert r["out_scale"] > 0.1
    assert r["out_err"] <= (2 ** -7 if dtype == "bfloat16" else 1e-5) * max(1.0, r["out_scale"]), r


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_short_prompt_chunk_runs_as_its_decode_steps(results, dtype):
    """chunk_tokens (a prompt chunk of up to TOKEN_LOOP_MAX tokens on a GPU) gives every output and the final
    state of the decode step taken on each token in turn, and the torch chunked form's within its rounding."""
    r = results[f"{dtype} chunk tokens"]
    assert r["state_moved"] > 1e-3, r
    assert r["equal_to_steps"], r
    assert r["state_err"] <= 1e-4 * max(1.0, r["state_scale"]), r
    # bf16: both round only the output, the torch form from another summation order.
    assert r["out_err"] <= 1e-4 * r["out_scale"] + (1e-2 * r["out_scale"] if dtype == "bfloat16" else 0), r


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", ["verify steps", "gdn conv verify steps", "ple conv verify steps"])
def test_a_verify_steps_kernel_runs_as_its_decode_steps(results, dtype, kernel):
    """A verify step's sub-steps in one launch (the delta rule, the causal convs) give every output, the final state
    and the state after each sub-step but the last (its history) of the decode step run sub-step after sub-step,
    bit for bit, with rows idle in some sub-steps; the history past the step's sub-steps is not written."""
    r = results[f"{dtype} {kernel}"]
    assert r["state_moved"], r
    assert r["out_equal"] and r["state_equal"] and r["history_equal"] and r["history_rest_untouched"], r


@pytest.mark.gpu
def test_a_short_prompt_chunk_runs_as_its_decode_steps_on_gpu():
    """The shipped model's Gated DeltaNet shapes in bfloat16 on the GPU: chunk_tokens gives the decode steps' outputs
    and state bit for bit, and fla's chunked form's within its rounding (fla serves the longer chunks)."""
    import torch
    from qwen4exp.engine.model import delta_rule
    from qwen4exp.kernels import delta_rule as delta_rule_kernels

    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    hk, hv, dk, dv, tokens = 16, 48, 128, 128, delta_rule_kernels.TOKEN_LOOP_MAX
    conv_out = torch.randn(tokens, 2 * hk * dk + hv * dv, generator=gen, device="cuda").bfloat16()
    q, k, v = torch.split(conv_out, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hv, dv))
    gate_rows = torch.randn(tokens, 2 * hv, generator=gen, device="cuda").bfloat16()
    a, b = gate_rows[:, :hv], gate_rows[:, hv:]
    a_log = torch.randn(hv, generator=gen, device="cuda").bfloat16()
    dt_bias = torch.rand(hv, generator=gen, device="cuda").bfloat16()
    start = torch.randn(hv, dk, dv, generator=gen, device="cuda") * 0.1
    one = torch.ones(1, dtype=torch.bool, device="cuda")
    chunked, stepped = start.clone(), start[None].clone()
    with torch.inference_mode():
        out = delta_rule_kernels.chunk_tokens(q, k, v, a, b, a_log, dt_bias, chunked)
        steps = torch.cat([delta_rule_kernels.decode_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], a[t:t + 1],
                                                          b[t:t + 1], a_log, dt_bias, one, stepped)
                           for t in range(tokens)])
    assert torch.equal(out, steps) and torch.equal(chunked, stepped[0])
    if delta_rule_kernels.fla_available():
        fla_state = start.clone()
        g, beta = delta_rule.gates(a, b, a_log, dt_bias)
        with torch.inference_mode():
            want = delta_rule_kernels.fla_chunk(q, k, v, g, beta, fla_state)
        scale = want.float().abs().max().item()
        assert (out.float() - want.float()).abs().max().item() <= 2e-2 * scale
        assert (chunked - fla_state).abs().max().item() <= 2e-2 * fla_state.abs().max().item()


@pytest.mark.gpu
def test_a_verify_step_in_one_launch_runs_as_its_decode_steps_on_gpu():
    """The shipped model's Gated DeltaNet and PLE shapes in bfloat16 on the GPU, 4 state rows, 4 sub-steps (a row
    idle in some of them): verify_steps and conv_substeps give the decode steps' outputs, final state and the state
    after each sub-step bit for bit, as the verify step's exactness (MTP on == off) needs."""
    import torch
    from qwen4exp.kernels import conv as conv_kernels
    from qwen4exp.kernels import delta_rule as delta_rule_kernels

    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm device")
    gen = torch.Generator(device="cuda").manual_seed(1)
    hk, hv, dk, dv, rows, substeps = 16, 48, 128, 128, 4, 4
    flags = torch.rand(substeps, rows, generator=gen, device="cuda") < 0.8
    flags[0] = True
    conv_out = torch.randn(substeps * rows, 2 * hk * dk + hv * dv, generator=gen, device="cuda").bfloat16()
    q, k, v = torch.split(conv_out, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hv, dv))
    gate_rows = torch.randn(substeps * rows, 2 * hv, generator=gen, device="cuda").bfloat16()
    a, b = gate_rows[:, :hv], gate_rows[:, hv:]
    a_log = torch.randn(hv, generator=gen, device="cuda").bfloat16()
    dt_bias = torch.rand(hv, generator=gen, device="cuda").bfloat16()

    def stepped_through(step, state, inputs):
        outs, kept = [], []
        for j in range(substeps):
            outs.append(step(*(x[j * rows:(j + 1) * rows] for x in inputs), flags[j], state))
            kept.append(state.clone())
        return torch.cat(outs), torch.stack(kept)

    start = torch.randn(rows, hv, dk, dv, generator=gen, device="cuda") * 0.1
    with torch.inference_mode():
        ours, history = start.clone(), torch.empty(substeps - 1, *start.shape, device="cuda")
        out = delta_rule_kernels.verify_steps(q, k, v, a, b, a_log, dt_bias, flags.flatten(), ours, history,
                                              substeps)
        want, kept = stepped_through(lambda q, k, v, a, b, on, state: delta_rule_kernels.decode_step(
            q, k, v, a, b, a_log, dt_bias, on, state), start.clone(), [q, k, v, a, b])
    assert torch.equal(out, want) and torch.equal(ours, kept[-1]) and torch.equal(history, kept[:-1])
    for channels, taps, dilation in ((2 * hk * dk + hv * dv, 4, 1), (4 * 2560, 4, 3)):
        inputs = torch.randn(rows, channels, (taps - 1) * dilation, generator=gen, device="cuda").bfloat16()
        x = torch.randn(substeps * rows, channels + 64, generator=gen, device="cuda").bfloat16()[:, :channels]
        weight = torch.randn(channels, 1, taps, generator=gen, device="cuda").bfloat16()
        with torch.inference_mode():
            ours, history = inputs.clone(), torch.empty(substeps - 1, *inputs.shape, device="cuda").bfloat16()
            out = conv_kernels.conv_substeps(ours, history, x, weight, dilation, flags.flatten(), substeps)
            want, kept = stepped_through(lambda x, on, state: conv_kernels.conv_step(state, x, weight, dilation, on),
                                         inputs.clone(), [x])
        assert torch.equal(out, want) and torch.equal(ours, kept[-1]) and torch.equal(history, kept[:-1]), channels
