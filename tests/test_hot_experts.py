"""Hot experts (engine/hot_experts.py): a split layer's most routed experts also kept on the target, the decode
step's pairs routed to them run there. On the CPU, with layers on "cpu:1" beside the target "cpu" (two names of one
device, as tests/test_split.py places them): the same numbers as without hot experts, bit for bit; the copies are
what the hot pairs read; routing is counted while serving; the choice, the fit and the estimate count the copies."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from qwen4exp.checkpoint.random_weights import random_model
from qwen4exp.engine import fit_measure, hot_experts
from qwen4exp.engine.engine import Engine
from qwen4exp.engine.engine_config import EngineConfig
from qwen4exp.engine.placement import Placement
from qwen4exp.engine.request import Request
from qwen4exp.engine.sampling import SamplingParams
from triton_interpreter import interpreted_results

SPLIT = [("cpu:1", 3)]          # the tiny preset's last three layers (5..7) on cpu:1
HOT = {5: (0, 3, 6), 6: (1, 2), 7: (7,)}


def _model(counts=SPLIT, **kwargs):
    model = random_model("tiny", dtype=torch.float32, device="cpu", seed=3, **kwargs)
    if counts:
        model.place(Placement.with_split("cpu", len(model.model.layers), counts))
    return model


def _decode_and_verify(model):
    """A prompt chunk, then a decode step over three rows (one idle) and a verify step of 3 positions."""
    ids = torch.randint(0, model.config.vocab_size, (70,), generator=torch.Generator().manual_seed(5))
    states = model.new_state_batch(3, 128)
    for row, length in zip(states.rows, (37, 70, 5)):
        model(ids[:length], row)
    positions, active = torch.tensor([37, 70, 5]), torch.tensor([True, True, False])
    states.allocate_history(2)
    rope = model.rope_table(128, "cpu")
    decoded = model.decode_rows(torch.tensor([4, 5, 6]), positions, active, states, rope)
    verified = model.verify_rows(torch.tensor([7, 8, 9] * 3), (positions + 1).repeat(3), active.repeat(3), states,
                                 rope, 3)
    return decoded, verified[0]


@pytest.mark.parametrize("quant", [None, "q8_0"])
def test_hot_experts_give_the_numbers_without_them_and_are_what_the_hot_pairs_read(quant):
    plain = _model(quant=quant) if quant else _model()
    model = _model(quant=quant) if quant else _model()
    held = hot_experts.keep_hot(model, HOT)
    layer = model.model.layers[5].mlp.experts
    assert layer.hot.ids == (0, 3, 6) and layer.hot.slot_of.tolist() == [0, -1, -1, 1, -1, -1, 2, -1]
    assert held == hot_experts.hot_bytes(model) > 0
    want, got = _decode_and_verify(plain), _decode_and_verify(model)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    # The hot pairs read the target's copies: spoil one and the decode step changes, the prompt chunk does not.
    hot = layer.hot
    if quant:
        hot.gate_up.blocks.zero_()
    else:
        hot.gate_up.zero_()
    spoiled = _decode_and_verify(model)
    assert not torch.equal(spoiled[0], want[0])
    ids = torch.arange(1, 41)
    assert torch.equal(model(ids, model.new_state(64)), plain(ids, plain.new_state(64)))


def test_the_choice_is_each_layers_most_counted_experts():
    counts = {5: [3, 9, 9, 0, 1, 9, 2, 2], 6: [0] * 8}
    assert hot_experts.choose(counts, 3) == {5: (1, 2, 5), 6: (0, 1, 2)}
    assert hot_experts.choose(counts, 0) == {5: (), 6: ()}
    assert hot_experts.add_counts({5: [1, 2]}, {5: [3, 4], 6: [5, 6]}) == {5: [4, 6], 6: [5, 6]}


def test_serving_counts_every_pair_a_split_layers_decode_steps_route():
    """Each token a decode step feeds a split layer (every generated token but the last) routes top-k pairs; the
    counts hold them all (the prompts' are not counted: chunks run where the layer is), and the layers on the
    target count none."""
    model = _model()
    hot_experts.keep_hot(model, HOT)
    hot_experts.count_while_serving(model)
    engine = Engine(model, slots=2, context=256, chunk=32)
    rng = random.Random(1)
    requests = [engine.submit(Request(prompt_ids=[rng.randrange(1000) for _ in range(n)], max_tokens=m,
                                      sampling=SamplingParams())) for n, m in ((45, 6), (9, 11), (70, 3))]
    engine.run_until_idle()
    assert all(len(r.output_ids) == m for r, m in zip(requests, (6, 11, 3)))
    counts = hot_experts.read_counts(model, stop=True)
    tokens = sum(len(r.output_ids) - 1 for r in requests)
    assert sorted(counts) == [5, 6, 7]
    assert all(sum(row) == tokens * model.config.num_experts_per_tok for row in counts.values())
    assert model.model.layers[5].mlp.experts.counts is None and model.model.layers[0].mlp.experts.counts is None


def test_a_split_engine_with_hot_experts_answers_as_the_unsplit_one():
    spec = dict(prompt_ids=list(range(3, 60)), max_tokens=12, sampling=SamplingParams(temperature=0.8, seed=7))
    answers = []
    for model in (_model(counts=None), _model()):
        if model.placement is not None:
            hot_experts.keep_hot(model, HOT)
        engine = Engine(model, slots=2, context=256, chunk=32)
        request = engine.submit(Request(**spec))
        engine.submit(Request(prompt_ids=[5, 6, 7], max_tokens=9, sampling=SamplingParams()))
        engine.run_until_idle()
        answers.append(request.output_ids)
    assert answers[0] == answers[1]


def test_a_load_keeps_hot_experts_from_calibration_and_the_fit_counts_them_on_the_target(tiny_checkpoint):
    config = EngineConfig(model=str(tiny_checkpoint), device="cpu", dtype="float32", slots=2, max_ctx=256,
                          chunk=32, placement=Placement.with_split("cpu", 8, SPLIT), split=(("cpu:1", None),),
                          hot_experts=3)
    _, model = config.load_model()
    layers = {i: e.hot.ids for i, e in hot_experts.split_experts(model).items()}
    assert sorted(layers) == [5, 6, 7] and all(len(ids) == 3 for ids in layers.values())
    assert all(e.counts is None for e in hot_experts.split_experts(model).values())    # calibration stopped
    held = fit_measure.placed_weight_bytes(model, torch.device("cpu"))
    plain = fit_measure.placed_weight_bytes(_model(), torch.device("cpu"))
    assert held["cpu"] - plain["cpu"] == hot_experts.hot_bytes(model) > 0 and held["cpu:1"] == plain["cpu:1"]
    # Counts from serving decide the next load's choice.
    counts = {5: [0, 0, 0, 0, 0, 9, 8, 7], 6: [1] * 8, 7: [0, 5, 0, 5, 0, 5, 0, 0]}
    assert hot_experts.describe(model)["chosen_from"] == "calibration"
    config.keep_hot_experts(model, counts)
    assert {i: e.hot.ids for i, e in hot_experts.split_experts(model).items()} == \
        {5: (5, 6, 7), 6: (0, 1, 2), 7: (1, 3, 5)}
    assert hot_experts.describe(model)["chosen_from"] == "serving"
    with pytest.raises(ValueError, match=r"hot_experts \(9\) is more than the model's 8 experts"):
        EngineConfig(**{**config.__dict__, "hot_experts": 9}).keep_hot_experts(model)


def test_the_estimate_counts_the_hot_copies_as_the_targets_weights():
    from qwen4exp.engine.fit_estimate import DeviceSize, estimate_plan, model_facts, split_inputs

    facts = model_facts("full", "ud-q4_k_xl", "bfloat16")
    target = DeviceSize("target", "target", "cuda", 32 << 30)
    split = (DeviceSize("split", "split", "cuda", 128 << 30),)
    plain = estimate_plan(facts, target, split, slots=4, chunk=4096, ple="host")
    hot = estimate_plan(facts, target, split, slots=4, chunk=4096, ple="host", hot_experts=16)
    first, last, _ = hot.split.split_layers["split"]
    expert = facts.layer_experts[last]
    assert expert == (2 * 640 * 2560 * 144 // 256) + (2560 * 640 * 34 // 32)     # Q4_K gate/up, Q8_0 down
    without = split_inputs(facts, split, (last - first + 1,), True)[0].weights
    assert hot.split.weights - without == 16 * sum(facts.layer_experts[first:last + 1])
    # The copies take the target's room: as many or more layers go to the split device, no longer a context.
    assert first <= plain.split.split_layers["split"][0] and hot.split.context <= plain.split.context
    assert any(note.startswith(f"hot experts: 16 of each of the {last - first + 1} split") for note in hot.notes)


CHILD = r"""
import json, torch
from types import SimpleNamespace
from qwen4exp.checkpoint.gguf_blocks import random_blocks
from qwen4exp.engine import hot_experts
from qwen4exp.engine.model.quantized import QuantizedStack
from qwen4exp.kernels import moe

E, H, I, K = 8, 256, 64, 2
gen = torch.Generator().manual_seed(3)

def stack(qtype, shape, seed):
    s = QuantizedStack(qtype, shape, torch.bfloat16)
    s.blocks.copy_(torch.from_numpy(random_blocks(qtype, shape, 0.05, seed)))
    return s

results = {}
for name, gate_up, down in (
        ("dense", (torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5).bfloat16(),
         (torch.randn(E, H, I, generator=gen) * I ** -0.5).bfloat16()),
        ("Q4_K + Q8_0", stack("Q4_K", (E, 2 * I, H), 1), stack("Q8_0", (E, H, I), 2))):
    experts = SimpleNamespace(gate_up_proj=gate_up, down_proj=down, hot=None)
    rows = 5
    x = torch.randn(rows, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(rows)])
    weights = torch.rand(rows, K, generator=gen).softmax(-1).bfloat16()
    flags = torch.tensor([1, 1, 0, 1, 1], dtype=torch.uint8)
    shared = (torch.randn(rows, H, generator=gen).bfloat16(), torch.randn(rows, 1, generator=gen).bfloat16())
    want = moe.moe_rows(x, ids, weights, gate_up, down, flags, shared)
    wanted = torch.tensor([1, 4, 6])
    slot_of = torch.full((E,), -1, dtype=torch.long)
    slot_of[wanted] = torch.arange(3)
    experts.hot = hot_experts.HotExperts((1, 4, 6), torch.device("cpu"), hot_experts._copy(gate_up, wanted, "cpu"),
                                         hot_experts._copy(down, wanted, "cpu"), slot_of)
    got = hot_experts.moe_rows(x, ids, weights, experts, flags, shared)
    spoiled = experts.hot.gate_up.blocks if name != "dense" else experts.hot.gate_up
    spoiled.zero_()            # the hot pairs read the copies: spoiling them changes the active rows with hot pairs
    hot_rows = ((slot_of[ids] >= 0).any(-1) & flags.bool()).nonzero().flatten()
    changed = hot_experts.moe_rows(x, ids, weights, experts, flags, shared)
    results[name] = {"equal": bool(torch.equal(got, want)), "some_hot": bool((slot_of[ids] >= 0).any()),
                     "some_cold": bool((slot_of[ids] < 0).any()),
                     "copies_read": bool(hot_rows.numel()) and not torch.equal(changed[hot_rows], want[hot_rows])}
print(json.dumps(results))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_the_kernels_hot_pairs_give_moe_rows_numbers_bit_for_bit():
    """kernels/moe.py's decode experts with some pairs run as rows of their own over the hot copies (the GPU path):
    the numbers of moe_rows over the whole stacks, dense and GGML blocks, an idle row included (Triton's
    interpreter)."""
    results = interpreted_results(CHILD)
    for name, result in results.items():
        assert result == {"equal": True, "some_hot": True, "some_cold": True, "copies_read": True}, name


@pytest.mark.parametrize("level", ["release", "offload"])
def test_the_worker_counts_while_serving_and_a_park_keeps_the_counts_for_the_next_choice(level, monkeypatch):
    """The first load chooses from a calibration prompt (run once) and counts from then on; a park keeps the counts
    (and frees the copies); the unpark chooses from them. (A given placement and context: the fits beside a split
    are tests/test_split.py's.)"""
    from qwen4exp.model_dir import EMBEDDED_MODEL
    from qwen4exp.server.messages import ParkLevel
    from qwen4exp.server.worker import Worker

    calibrations = []
    real = hot_experts.calibrate
    monkeypatch.setattr(hot_experts, "calibrate", lambda *args: calibrations.append(1) or real(*args))

    config = EngineConfig(model=str(EMBEDDED_MODEL), device="cpu", dtype="float32", slots=2, chunk=64, max_ctx=1024,
                          split=(("cpu:1", None),), placement=Placement.with_split("cpu", 4, [("cpu:1", 2)]),
                          hot_experts=2)
    worker = Worker(config, conn=None)
    info = worker.load()
    assert info["hot_experts"]["chosen_from"] == "calibration" and info["hot_experts"]["per_layer"] == 2
    assert len(calibrations) == 1
    layers = hot_experts.split_experts(worker.engine.model)
    assert sorted(info["hot_experts"]["layers"]) == sorted(str(i) for i in layers) != []
    assert all(e.counts is not None and e.hot is not None for e in layers.values())
    last = max(layers)
    layers[last].counts += torch.tensor([0, 0, 0, 0, 0, 4, 9, 0])      # what serving would have counted
    model = worker.engine.model
    worker.park(ParkLevel(level))
    assert worker.hot_counts[last] == [0, 0, 0, 0, 0, 4, 9, 0]
    assert all(e.hot is None for e in hot_experts.split_experts(model).values())
    again = worker.load()
    assert again["context"] == info["context"] and again["hot_experts"]["chosen_from"] == "serving"
    assert again["hot_experts"]["layers"][str(last)] == [5, 6] and len(calibrations) == 1
    worker.park(ParkLevel.RELEASE)


def test_layers_in_host_memory_beside_a_gpu_keep_no_hot_experts():
    """Their torch forms compute every pair on both devices: copies would cost the GPU's memory for nothing. So
    keep_hot skips them and the estimate counts none for a `cpu` split device."""
    from dataclasses import replace

    from qwen4exp.engine.fit_estimate import DeviceSize, estimate_plan, model_facts

    model = _model()
    assert sorted(hot_experts.hot_layers(model)) == [5, 6, 7]             # two names of the CPU: kept
    model.placement = replace(model.placement, target="cuda:0")           # as beside a GPU target
    assert hot_experts.hot_layers(model) == {} and hot_experts.keep_hot(model, HOT) == 0
    facts = model_facts("full", "ud-q4_k_xl", "bfloat16")
    target = DeviceSize("target", "target", "cuda", 24 << 30)
    host = (DeviceSize("split", "cpu", "cpu", 128 << 30),)
    plain = estimate_plan(facts, target, host, slots=4, chunk=4096, ple="host")
    hot = estimate_plan(facts, target, host, slots=4, chunk=4096, ple="host", hot_experts=16)
    assert hot.split.weights == plain.split.weights and hot.split.context == plain.split.context
    assert not any(note.startswith("hot experts") for note in hot.notes)
