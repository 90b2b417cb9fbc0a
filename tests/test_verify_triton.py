"""A verify step (speculative decoding, model/verify.py) on the Triton backend: the tiny model in bfloat16 on the
CPU through Triton's interpreter, so the kernels a GPU runs are the ones checked, among them those that take all of
a verify step's sub-steps in one launch (TritonOps.whole_verify_ops). Each position's logits are the plain decode
step's there, bit for bit, and the committed state of each row is the one plain decoding leaves after the positions
it keeps. Run in a child process: TRITON_INTERPRET must be set before Triton is imported."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from triton_interpreter import interpreted_results

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

CHILD = r"""
import json, torch
from qwen4exp.engine.loading import load_model
from qwen4exp.engine.model.triton_ops import TRITON_OPS
from qwen4exp.model_dir import resolve_model

device = "__DEVICE__"
model = load_model(str(resolve_model("tiny")), dtype="bfloat16", device=device, progress=False)
gen = torch.Generator().manual_seed(0)
lengths, substeps = [37, 70, 5, 22], 4
# Rows as a speculative step has them: row 0 verifies four positions, row 1 two (its later sub-steps idle, written
# where its next position goes, as the engine places them), row 2 is idle throughout, row 3 verifies three.
fed = [4, 2, 0, 3]
active = torch.tensor([[j < n for n in fed] for j in range(substeps)], device=device)
# On the CPU the prompts go in on the torch backend (the interpreter is slow, and both runs start from one state).
plain, verified = model.new_state_batch(len(lengths), 128), model.new_state_batch(len(lengths), 128)
for plain_row, verified_row, length in zip(plain.rows, verified.rows, lengths):
    model(torch.randint(0, 1000, (length,), generator=gen).to(device), plain_row)
    for ours, theirs in zip(verified_row.tensors(), plain_row.tensors()):
        ours.copy_(theirs)
    verified_row.length = plain_row.length
model.ops = TRITON_OPS
verified.allocate_history(substeps - 1)
rope = model.rope_table(plain.capacity, device)
count = len(lengths)
tokens = torch.randint(0, 1000, (substeps, count), generator=gen).to(device)
positions = torch.tensor([[length + min(j, max(n, 1)) for length, n in zip(lengths, fed)] for j in range(substeps)],
                         device=device)
logits, _ = model.verify_rows(tokens.flatten(), positions.flatten(), active.flatten(), verified, rope, substeps)
keep = [1, 1, 3, 2]            # row 0 keeps two of its positions, the others all theirs (an idle row keeps its own)
logits_equal, kept = [], {}
for j in range(substeps):
    want = model.decode_rows(tokens[j], positions[j], active[j], plain, rope)
    logits_equal += [bool(torch.equal(logits[j * count + i], want[i])) for i in range(count) if active[j, i]]
    for i in range(count):
        if j == keep[i]:
            kept[i] = [t.clone() for t in plain.rows[i].carried()]
verified.commit(torch.tensor(keep, device=device), substeps)
print(json.dumps({
    "whole": sorted(TRITON_OPS.whole_verify_ops),
    "logits_equal": logits_equal,
    "kept_equal": [all(torch.equal(a, b) for a, b in zip(verified.rows[i].carried(), kept[i])) for i in range(count)],
}))
"""


def _check(results: dict) -> None:
    assert {"causal_conv", "delta_rule"} <= set(results["whole"])
    assert len(results["logits_equal"]) == 9 and all(results["logits_equal"]), results
    assert all(results["kept_equal"]), results


@pytest.mark.slow
def test_a_verify_step_is_plain_decode_steps_on_the_triton_backend():
    _check(interpreted_results(CHILD.replace("__DEVICE__", "cpu")))


@pytest.mark.gpu
def test_a_verify_step_is_plain_decode_steps_on_the_gpu():
    """The same on a GPU, the kernels compiled: each verified position's logits and each committed state bit for bit."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm device")
    done = subprocess.run([sys.executable, "-c", CHILD.replace("__DEVICE__", "cuda")], capture_output=True, text=True,
                          timeout=600, check=False, cwd=Path(__file__).parent)
    assert done.returncode == 0, done.stderr[-3000:]
    _check(json.loads(done.stdout.strip().splitlines()[-1]))
