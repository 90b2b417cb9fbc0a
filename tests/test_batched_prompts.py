"""Prompt chunks of several sequences in one forward (model.forward_chunks, the engine's `batch_prompts`) on the
Triton backend, where they share the routed experts' grouped launch (TritonOps.chunks_experts): each chunk's
logits and every state tensor it writes are, bit for bit, the ones it gets alone. The tiny model in bfloat16 on
the CPU through Triton's interpreter, so the kernels a GPU runs are the ones checked; a first round from position
0 (QSA dense) and a second continuing each sequence past QSA's dense reach (ranked blocks). The engine's
scheduling of such batches is tested on the torch backend (test_engine.py). Run in a child process:
TRITON_INTERPRET must be set before Triton is imported."""

from __future__ import annotations

import importlib.util

import pytest
from triton_interpreter import interpreted_results

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

CHILD = r"""
import json, torch
from qwen4exp.engine.loading import load_model
from qwen4exp.engine.model.triton_ops import TRITON_OPS
from qwen4exp.engine.state import AttentionState
from qwen4exp.model_dir import resolve_model

model = load_model(str(resolve_model("tiny")), dtype="bfloat16", device="cpu", progress=False)
model.ops = TRITON_OPS
gen = torch.Generator().manual_seed(0)


def written(state):
    tensors = list(state.carried())
    for layer in state.layers:
        if isinstance(layer, AttentionState):
            tensors += [layer.keys[:, :state.length], layer.values[:, :state.length],
                        layer.index_keys[:state.length], layer.block_keys]
    return tensors


rounds = [(3, 9, 20), (17, 30, 16)]     # the second ends past the tiny model's dense reach (35 tokens)
alone = [model.new_state(128) for _ in rounds[0]]
together = [model.new_state(128) for _ in rounds[0]]
results = {"dense_limit": model.config.dense_limit, "rounds": []}
for lengths in rounds:
    prompts = [torch.randint(0, 1000, (n,), generator=gen) for n in lengths]
    solo = [model(ids, state) for ids, state in zip(prompts, alone)]
    shared = model.forward_chunks(list(zip(prompts, together)))
    results["rounds"].append({
        "ends": [state.length for state in together],
        "logits_equal": [bool(torch.equal(a, b)) for a, b in zip(solo, shared)],
        "states_equal": [all(torch.equal(a, b) for a, b in zip(written(s), written(t)))
                         for s, t in zip(alone, together)],
        "logits_finite": all(bool(torch.isfinite(x).all()) for x in shared),
    })
print(json.dumps(results))
"""


@pytest.mark.slow
def test_chunks_in_one_forward_equal_their_forwards_alone_on_the_triton_backend():
    results = interpreted_results(CHILD)
    first, second = results["rounds"]
    assert first["ends"] == [3, 9, 20] and max(second["ends"]) > results["dense_limit"]
    for round_ in (first, second):
        assert round_["logits_finite"]
        assert all(round_["logits_equal"]), round_
        assert all(round_["states_equal"]), round_
