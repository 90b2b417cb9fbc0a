"""Split serving (engine/placement.py) on the CPU: decoder layers placed on `split` devices beside the target, each
layer's state with it, the streams handed across at each boundary. Two names of one physical device ("cpu" and
"cpu:1", torch puts both on the CPU) are two devices with their own budgets: enough to prove the placement, the
per-device fit and exactness (a real hand-over between devices is test_gpu_engine.py's)."""

from __future__ import annotations

import random

import pytest
import torch

from qwen4exp.checkpoint.random_weights import random_model
from qwen4exp.engine import fit_measure
from qwen4exp.engine.engine import Engine
from qwen4exp.engine.engine_config import EngineConfig
from qwen4exp.engine.fit import FitError, fit_context
from qwen4exp.engine.memory import set_device_memory_limit
from qwen4exp.engine.model import causal_lm
from qwen4exp.engine.placement import Placement
from qwen4exp.engine.prefix_cache import PrefixCache
from qwen4exp.engine.request import Request
from qwen4exp.engine.sampling import SamplingParams
from qwen4exp.engine.snapshot import SnapshotBackend
from qwen4exp.model_dir import EMBEDDED_MODEL
from logits_record import assert_same_logits, record_logits
from staggered import run_staggered

MiB = 1 << 20
CONTEXT, CHUNK = 512, 32
# The tiny preset's 8 layers: QSA at 3 and 7, PLE in layer 1. One split device with the last three (a QSA layer's
# cache and a boundary inside the Gated DeltaNet run); two split devices, the second holding the PLE layer.
ONE = [("cpu:1", 3)]
TWO = [("cpu:1", 2), ("cpu:2", 5)]


def _model(counts=None, seed: int = 3, **kwargs):
    model = random_model("tiny", dtype=torch.float32, device="cpu", seed=seed, **kwargs)
    if counts:
        model.place(Placement.with_split("cpu", len(model.model.layers), counts))
    return model


@pytest.fixture(scope="module")
def plain():
    return _model()


@pytest.fixture(scope="module")
def split():
    return _model(ONE)


def test_a_placement_names_each_layers_device_and_reads_back_from_json():
    placement = Placement.with_split("cuda:0", 48, [("cuda:1", 36)])
    assert placement.runs() == [("cuda:0", 0, 11), ("cuda:1", 12, 47)] and placement.is_split
    assert placement.split_layers() == {"cuda:1": (12, 47)} and placement.devices == ["cuda:0", "cuda:1"]
    assert placement.describe() == "layers 0..11 on cuda:0, layers 12..47 on cuda:1"
    assert Placement.from_json(placement.to_json()) == placement
    two = Placement.with_split("cpu", 8, TWO)
    assert two.runs() == [("cpu", 0, 0), ("cpu:2", 1, 5), ("cpu:1", 6, 7)]
    assert not Placement.with_split("cpu", 8, [("cpu:1", 0)]).is_split
    with pytest.raises(ValueError, match="cpu:2 cannot hold 7 layers: 5 are left of 8"):
        Placement.with_split("cpu", 8, [("cpu:1", 3), ("cpu:2", 7)])


@pytest.mark.parametrize("counts", [ONE, TWO], ids=["one-split-device", "two-split-devices"])
def test_a_split_model_gives_the_unsplit_numbers_bit_for_bit(plain, counts, monkeypatch):
    """A prompt chunk (every logits row), decode steps over a state batch and a verify step: the same bits as the
    model on one device, the streams handed across twice per split device in each forward."""
    model = _model(counts)
    handed = []
    real = causal_lm._hand_over
    monkeypatch.setattr(causal_lm, "_hand_over", lambda *args: handed.append(args[2]) or real(*args))
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, plain.config.vocab_size, (70,), generator=generator)   # past QSA's dense reach
    want_state, got_state = plain.new_state(128), model.new_state(128)
    assert torch.equal(model(ids, got_state, all_logits=True), plain(ids, want_state, all_logits=True))
    assert [str(d) for d in handed] == [name for name, _, _ in model.placement.runs()[1:]] + ["cpu"]
    states = {m: m.new_state_batch(3, 128) for m in (plain, model)}
    for m, batch in states.items():
        for row, length in zip(batch.rows, (37, 70, 5)):
            m(ids[:length], row)
    tokens, positions = torch.tensor([4, 5, 6]), torch.tensor([37, 70, 5])
    active = torch.tensor([True, True, False])
    for m in states:
        states[m].allocate_history(2)
    rope = {m: m.rope_table(128, "cpu") for m in states}
    out = {m: m.decode_rows(tokens, positions, active, states[m], rope[m]) for m in states}
    assert torch.equal(out[model], out[plain])
    verify = {m: m.verify_rows(torch.tensor([7, 8, 9] * 3), (positions + 1).repeat(3), active.repeat(3), states[m],
                               rope[m], 3) for m in states}
    assert torch.equal(verify[model][0], verify[plain][0]) and torch.equal(verify[model][1], verify[plain][1])
    for m in states:
        states[m].commit(torch.tensor([2, 0, 2]), 3)
    for a, b in zip(states[plain].carried(), states[model].carried()):
        assert torch.equal(a, b)


def test_a_quantized_split_model_gives_the_unsplit_numbers(monkeypatch):
    """Expert stacks kept as GGML blocks move with their layers."""
    plain, model = _model(quant="q8_0"), _model(ONE, quant="q8_0")
    ids = torch.arange(1, 41)
    assert torch.equal(model(ids, model.new_state(64), all_logits=True),
                       plain(ids, plain.new_state(64), all_logits=True))


def _spec(rng: random.Random):
    length = rng.choice([rng.randint(1, 40), rng.randint(60, 200)])
    sampled = rng.random() < 0.5
    return {"prompt_ids": [rng.randrange(1000) for _ in range(length)], "max_tokens": rng.randint(1, 16),
            "sampling": SamplingParams(temperature=0.9, top_p=0.9, seed=rng.randrange(10**6)) if sampled
            else SamplingParams()}


def _alone(model, spec, **kwargs):
    engine = Engine(model, slots=4, context=CONTEXT, chunk=CHUNK, **kwargs)
    request = engine.submit(Request(**spec))
    engine.run_until_idle()
    return request


@pytest.mark.parametrize("beside, batch", [(False, False), (True, True)], ids=["plain", "beside-and-batched"])
def test_a_split_engine_keeps_alone_equal_to_together_and_to_the_unsplit_engine(plain, split, beside, batch,
                                                                                monkeypatch):
    """Staggered requests on a split engine (decode steps between a chunk's layers, several slots' chunks in one
    forward): every logits row is the one the request gets alone, on the split engine and on the unsplit one."""
    record_logits(monkeypatch)
    rng = random.Random(11)
    specs = [_spec(rng) for _ in range(6)]
    starts = sorted(rng.randint(0, 20) for _ in specs)
    engine = Engine(split, slots=4, context=CONTEXT, chunk=CHUNK, decode_beside_prompts=beside,
                    batch_prompts=batch)
    for spec, request in zip(specs, run_staggered(engine, specs, starts)):
        assert_same_logits(request, _alone(split, spec), "split, together vs alone")
        assert_same_logits(request, _alone(plain, spec), "split vs unsplit")


def test_a_split_engine_restores_prefixes_warm_as_cold(split, monkeypatch):
    """Snapshots hold the state of every device's layers: a resent prompt restored from them gives the cold rows."""
    record_logits(monkeypatch)
    cache = PrefixCache(CHUNK, 64 * MiB, SnapshotBackend.for_device(torch.device("cpu")),
                        split.config.indexer_compress_ratio)
    engine = Engine(split, slots=4, context=CONTEXT, chunk=CHUNK, prefix_cache=cache)
    rng = random.Random(3)
    prompt = [rng.randrange(1000) for _ in range(150)]
    cold = engine.submit(Request(prompt_ids=prompt, max_tokens=12))
    engine.run_until_idle()
    warm = engine.submit(Request(prompt_ids=prompt + [5, 6], max_tokens=12))
    engine.run_until_idle()
    assert warm.cached_tokens >= 128
    assert_same_logits(warm, _alone(split, {"prompt_ids": prompt + [5, 6], "max_tokens": 12}), "warm vs cold")
    assert cold.output_ids == _alone(split, {"prompt_ids": prompt, "max_tokens": 12}).output_ids


def test_drafting_on_a_split_model_gives_the_answers_of_plain_decoding(plain, split):
    """The MTP head stays on the target beside the LM head; verify steps hand each sub-step's rows across."""
    rng = random.Random(4)
    specs = [{"prompt_ids": [rng.randrange(1000) for _ in range(n)], "max_tokens": 24} for n in (9, 80, 33)]
    engine = Engine(split, slots=4, context=CONTEXT, chunk=CHUNK, mtp=3)
    requests = [engine.submit(Request(**spec)) for spec in specs]
    engine.run_until_idle()
    assert sum(r.mtp_drafted for r in requests) > 0
    for spec, request in zip(specs, requests):
        assert request.output_ids == _alone(plain, spec).output_ids


# ---- the fit over several devices -----------------------------------------------------------------------------------
@pytest.fixture
def split_limit():
    set_device_memory_limit("cpu:1", 64 * MiB)
    yield 64 * MiB
    set_device_memory_limit("cpu:1", None)


def _fit(model, cap: int, **kwargs):
    kwargs = {"trained": 8192} | kwargs
    return fit_context(model, slots=2, device="cpu", memory_limit=cap, snapshots_on_device=False, step=256, floor=256,
                       **kwargs)


def test_the_fit_gives_each_device_its_layers_and_fits_more_context_than_the_target_alone(plain):
    """The last five layers (both QSA layers) on cpu:1: the target keeps the MTP head's cache and the split device
    the QSA layers', and the fit over both reaches well past the target alone's."""
    split = _model([("cpu:1", 5)])
    set_device_memory_limit("cpu:1", 96 * MiB)
    try:
        alone, both = _fit(plain, 60 * MiB), _fit(split, 60 * MiB, trained=16384)
    finally:
        set_device_memory_limit("cpu:1", None)
    assert both.context > 1.2 * alone.context, (alone.context, both.context)
    on_target, (on_split,) = both.measured, both.split
    assert on_split.device == "cpu:1" and on_split.capacity == 96 * MiB
    # The weights and one slot's state, per position and fixed, add up to the whole model's.
    assert on_target.weights + on_split.weights == alone.measured.weights
    assert on_target.slot_bytes_per_position + on_split.slot_bytes_per_position == \
        alone.measured.slot_bytes_per_position
    assert on_target.slot_fixed + on_split.slot_fixed == alone.measured.slot_fixed
    # The split layers hold QSA layers 3 and 7's caches; the target the MTP head's, as large as each.
    assert on_split.slot_bytes_per_position == 2 * on_target.slot_bytes_per_position > 0
    # Verified on each device at the answer: every slot allocated there, the chunk run through its layers.
    at_answer = [v for v in both.verifications if v.context == both.context and v.rows == 256]
    assert {v.device for v in at_answer} == {"cpu", "cpu:1"} and all(v.fits for v in at_answer)
    assert [d.name for d in both.plan.devices] == ["cpu", "cpu:1"]


def test_a_split_device_in_host_memory_leaves_the_prefix_cache_its_share(split, split_limit):
    """Beside a discrete GPU the snapshots live in host memory: a split device whose memory is the host's (here
    "cpu:1") plans without the prefix cache's resident limit."""
    reserve = 16 * MiB
    plain_fit, reserved = _fit(split, 60 * MiB), _fit(split, 60 * MiB, host_reserve=reserve)
    assert reserved.split[0].capacity == plain_fit.split[0].capacity - reserve == split_limit - reserve
    assert "less 16.00 MiB for the prefix cache in host memory" in reserved.split[0].capacity_source
    assert reserved.measured.capacity == plain_fit.measured.capacity     # the target keeps its own


def test_drafting_keeps_each_layers_carried_history_on_its_device(split, split_limit):
    """A verify step keeps the carried state of every draft position beside each carried tensor: the fit charges
    each device its own layers' share."""
    from qwen4exp.engine.fit import carried_on

    plain_fit, drafting = _fit(split, 60 * MiB), _fit(split, 60 * MiB, draft_positions=3)
    for before, after, name in [(plain_fit.measured, drafting.measured, "cpu"),
                                (plain_fit.split[0], drafting.split[0], "cpu:1")]:
        assert after.slot_fixed == before.slot_fixed + 3 * carried_on(split, name, "cpu") > before.slot_fixed


@pytest.mark.parametrize("cap, message", [
    (1 * MiB, r"the weights alone, 1.15 MiB, do not fit in the 921.60 KiB available on cpu:1 \(1.00 MiB, memory limit"),
    # (the chunk's workspace is what torch's kernels allocate, which its versions change: not pinned here)
    (2 * MiB, r"on cpu with 60.00 MiB \(memory limit\) and cpu:1 with 2.00 MiB \(memory limit\) and 10% headroom: "
              r"context 256 is the floor and still does not fit: device 'cpu:1' needs [\d.]+ MiB more \(needed "
              r"[\d.]+ MiB = weights 1.1 MiB \+ graphs 0 B \+ caches 318.0 KiB \+ chunk workspace"),
], ids=["weights", "caches-and-chunk"])
def test_a_split_device_too_small_for_its_layers_is_named(split, cap, message):
    set_device_memory_limit("cpu:1", cap)
    try:
        with pytest.raises(FitError, match=message):
            _fit(split, 60 * MiB)
    finally:
        set_device_memory_limit("cpu:1", None)


def test_a_verification_missing_on_the_split_device_moves_the_answer_down(split, split_limit, monkeypatch):
    """The first context checked is the search's answer; a miss on cpu:1 moves the served context below it, to one
    both devices verify."""
    real = fit_measure.verify_context
    calls = []

    def split_misses_first(model, device, context, rows, *args):
        checks = real(model, device, context, rows, *args)
        calls.append(context)
        if len(calls) == 1:
            checks[1] = fit_measure.Verification(context, rows[0], checks[1].available + 8 * MiB,
                                                 checks[1].available, device=checks[1].device)
        return checks

    from qwen4exp.engine import fit as fit_module
    monkeypatch.setattr(fit_module, "verify_context", split_misses_first)
    moved = _fit(split, 60 * MiB)
    monkeypatch.undo()
    assert calls[0] == _fit(split, 60 * MiB).context
    assert len(calls) >= 2 and moved.context == calls[-1] < calls[0]
    assert not moved.verifications[1].fits and moved.verifications[1].device == "cpu:1"
    last = [check for check in moved.verifications if check.context == moved.context]
    assert {check.device for check in last} == {"cpu", "cpu:1"} and last[0].fits and last[1].fits


# ---- the engine config: the placement chosen before the load, kept after it ------------------------------------------
def _config(target_cap: int, split_cap: int, **kwargs) -> EngineConfig:
    return EngineConfig(model=str(EMBEDDED_MODEL), device="cpu", dtype="float32", slots=2, chunk=64,
                        device_memory_limit=target_cap, split=(("cpu:1", split_cap),), **kwargs)


def test_layers_go_to_the_split_device_only_when_the_target_falls_short():
    roomy = _config(512 * MiB, 64 * MiB)
    _, model = roomy.load_model()
    assert model.placement is None
    assert roomy.as_loaded(model).placement == Placement.single("cpu", model.config.num_hidden_layers)
    # The context is given: the placement moves as few layers as the estimate needs, which leaves a measured fit
    # too little room at this budget.
    # test_the_fit_gives_each_device_its_layers_... fits over both devices.
    tight = _config(52 * MiB, 40 * MiB, prefix_cache=True, max_ctx=4096)
    device, model = tight.load_model()
    assert model.placement is not None and model.placement.split_layers()["cpu:1"][1] == 3
    choice = tight.resolve_context(model, device)
    assert choice.context == 4096
    loaded = tight.as_loaded(model)
    assert loaded.placement == model.placement
    # A reload (an unpark, a restarted worker) places the layers as before, whatever is free by then.
    assert loaded.load_model()[1].placement == model.placement
    engine = Engine.from_config(model, loaded, context=choice.context, prefix_cache=loaded.new_prefix_cache(model,
                                                                                                              device))
    request = engine.submit(Request(prompt_ids=list(range(1, 90)), max_tokens=8))
    engine.run_until_idle()
    assert len(request.output_ids) == 8


def test_no_placement_fitting_anything_is_an_error_naming_the_devices():
    with pytest.raises(FitError, match=r"no placement over cpu and cpu:1 fits a context: .*cpu"):
        _config(20 * MiB, 40 * MiB, prefix_cache=True).load_model()


def test_a_profiles_split_devices_reach_the_engine_config(tmp_path):
    from qwen4exp.config import load_settings

    profile = tmp_path / "split.toml"
    profile.write_text('model = "tiny"\n[[devices]]\nname = "cuda:0"\nrole = "target"\n'
                       '[[devices]]\nname = "cpu"\nrole = "split"\nmemory_limit = "48GiB"\n')
    config = EngineConfig.from_settings(load_settings(profile))
    assert config.device == "cuda:0" and config.split == (("cpu", 48 << 30),) and config.placement is None


def test_the_placement_is_kept_by_an_unpark_and_by_a_restarted_worker(monkeypatch):
    """The context fitted for a placement counts on it: an unpark (release level) reloads the layers where they
    were, whatever is free by then, and the daemon starts a crashed worker's successor with the same placement."""
    from qwen4exp.server.messages import ParkLevel
    from qwen4exp.server.worker import Worker
    from restarted_worker import next_worker_config

    config = _config(52 * MiB, 40 * MiB, prefix_cache=False, max_ctx=4096)    # as in the test above
    worker = Worker(config, conn=None)
    info = worker.load()
    placed = worker.engine.model.placement
    assert placed is not None and info["placement"] == placed.to_json()
    assert info["placement"]["runs"][-1]["device"] == "cpu:1"
    worker.park(ParkLevel.RELEASE)
    monkeypatch.setattr(EngineConfig, "choose_placement", lambda *a: pytest.fail("a kept placement is chosen again"))
    monkeypatch.setattr(EngineConfig, "resolve_context", lambda *a, **k: pytest.fail("a kept context is refitted"))
    assert worker.load()["context"] == info["context"] and worker.engine.model.placement == placed
    worker.park(ParkLevel.RELEASE)

    assert next_worker_config(config, info).placement == placed          # what the next worker is started with


@pytest.mark.parametrize("counts", [ONE, TWO, [("cpu:1", 8)]], ids=["one-split-device", "two-split-devices",
                                                                     "every-layer-off-the-target"])
def test_the_decode_step_in_segments_gives_the_models_own_step_bit_for_bit(plain, counts):
    """engine/segmented_decode.py, run eagerly (a GPU replays each segment from a graph of its device): a segment
    per run of layers, the embedding and the LM head on the target, the streams handed over between them; three
    steps over rows at different positions, one idle, give decode_rows' logits and states bit for bit."""
    from qwen4exp.engine.segmented_decode import SegmentedDecode, plan_segments

    model = _model(counts)
    plan = [(str(s.device), s.first, s.last, s.embeds, s.finishes) for s in plan_segments(model)]
    if counts == ONE:
        assert plan == [("cpu", 0, 4, True, False), ("cpu:1", 5, 7, False, False), ("cpu", 0, -1, False, True)]
    if counts == [("cpu:1", 8)]:
        assert plan[0] == ("cpu", 0, -1, True, False) and plan[-1] == ("cpu", 0, -1, False, True)
    ids = torch.randint(0, model.config.vocab_size, (70,), generator=torch.Generator().manual_seed(9))
    states = {name: model.new_state_batch(3, 128) for name in ("own", "segments")}
    rope = model.rope_table(128, "cpu")
    inputs = {"tokens": torch.zeros(3, dtype=torch.long), "positions": torch.zeros(3, dtype=torch.long),
              "active": torch.zeros(3, dtype=torch.bool)}
    # Made while every row is empty, as the engine makes its decode runner: its first step runs on idle rows.
    segmented = SegmentedDecode(model, states["segments"], inputs, rope, graphs=False)
    assert segmented.graphs == 0
    for batch in states.values():
        for row, length in zip(batch.rows, (37, 70, 5)):
            model(ids[:length], row)
    for step, tokens in enumerate(([4, 5, 6], [7, 8, 9], [10, 11, 12])):
        positions, active = torch.tensor([37 + step, 70 + step, 5]), torch.tensor([True, True, False])
        want = model.decode_rows(torch.tensor(tokens), positions, active, states["own"], rope)
        inputs["tokens"].copy_(torch.tensor(tokens))
        inputs["positions"].copy_(positions)
        inputs["active"].copy_(active)
        assert torch.equal(segmented.run(), want), step
    for a, b in zip(states["own"].carried(), states["segments"].carried()):
        assert torch.equal(a, b)
