"""max_ctx = "auto" on the CPU with the tiny model: a memory cap, 4 slots, snapshots in the same memory.

The tiny model's caches are ~1.8 KB per position per slot and its floor chunk's workspace grows ~4 KB per
position, so caps of 256 and 512 MiB fit contexts of a few times 4096 and the chunks run in well under a
second."""

from __future__ import annotations

import json

import pytest
import torch

from qwen4exp.engine import fit as fit_module
from qwen4exp.engine.fit import FitError, fit_context, resolve_max_ctx
from qwen4exp.engine.fit_measure import Verification, measure_state, verify_context, weight_bytes
from qwen4exp.engine.memory import DeviceMemoryError, device_memory_limit, set_device_memory_limit

MiB = 1 << 20
CPU = torch.device("cpu")
STEP = 4096


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    from qwen4exp.engine.loading import load_model
    return load_model(str(tiny_checkpoint), dtype="float32", device="cpu", progress=False)


def _fit(model, cap, snapshots=True, **kwargs):
    return fit_context(model, slots=4, device="cpu", memory_limit=cap, snapshots_on_device=snapshots, **kwargs)


@pytest.fixture(scope="module")
def fit256(model):
    return _fit(model, 256 * MiB)


@pytest.fixture(scope="module")
def fit512(model):
    return _fit(model, 512 * MiB)


@pytest.mark.parametrize("name", ["fit256", "fit512"])
def test_fit_is_tight_and_verified(name, request):
    result = request.getfixturevalue(name)
    assert result.context % STEP == 0 and result.context >= STEP
    assert result.plan.context == result.context
    at, above = result.planner.evaluate(result.context)[0], result.planner.evaluate(result.context + STEP)[0]
    assert at.fits and not above.fits, (at.needed, above.needed, at.available)
    check = result.verifications[0]
    assert check.context == result.context and check.rows == 256
    assert check.fits and check.needed <= check.available
    # The answer is a measured position: the workspace line is exact there.
    assert result.context in [p for p, _ in result.measured.workspace]
    assert result.plan.devices[0].capacity == result.measured.capacity


@pytest.mark.parametrize("name, cap", [("fit256", 256 * MiB), ("fit512", 512 * MiB)])
def test_the_fit_is_safe_and_tight_when_allocated_and_run(model, name, cap, request):
    """Judged without the planner: every slot and snapshot allocated and the floor chunk run at the last
    position, against the cap less the 10% headroom, fits at the answer and not one step above it."""
    result = request.getfixturevalue(name)
    available = int(cap * 0.9)
    assert result.verifications[0].available == available
    weights = weight_bytes(model, CPU)
    at = verify_context(model, CPU, result.context, [256], 4, True, weights, available)[0]
    above = verify_context(model, CPU, result.context + STEP, [256], 4, True, weights, available)[0]
    assert at.fits and not above.fits, (result.context, at.needed, above.needed, available)


def test_a_planned_chunk_that_misses_when_run_falls_back_to_the_floor_chunk(model, monkeypatch):
    real = fit_module.verify_context

    def planned_chunk_misses(model, device, context, rows, *args):
        checks = real(model, device, context, rows, *args)
        if len(rows) > 1:                     # the floor chunk fits; the planned one needs a byte too many
            last = checks[-1]
            checks[-1] = Verification(last.context, last.rows, last.available + 1, last.available)
        return checks

    monkeypatch.setattr(fit_module, "verify_context", planned_chunk_misses)
    # A given context of 4096 under 256 MiB leaves room for a chunk larger than the floor of 256.
    result = _fit(model, 256 * MiB, trained=STEP, step=STEP, floor=STEP)
    assert result.plan.chunk > 256, "the plan must offer a larger chunk for the fallback to matter"
    assert result.chunk == 256 and result.verifications[0].fits and not result.verifications[-1].fits
    assert any("serving the floor chunk of 256" in note for note in result.notes), result.notes


def test_out_of_memory_while_measuring_the_chunk_counts_as_a_miss_there(model, fit512, monkeypatch):
    real = fit_module.measure_workspace
    refused = []

    def out_of_memory_past_8192(model, device, position, rows):
        if position > 8192:
            refused.append(position)
            raise DeviceMemoryError(f"simulated: no room for the chunk at {position}")
        return real(model, device, position, rows)

    monkeypatch.setattr(fit_module, "measure_workspace", out_of_memory_past_8192)
    result = _fit(model, 512 * MiB)
    # The first answer (where the unpatched fit lands, give or take a step of CPU noise) could not be measured;
    # counted as a miss there, it moves the answer below it.
    assert refused and abs(refused[0] - fit512.context) <= STEP
    assert result.context < refused[0] and result.verifications[-1].fits
    assert any(f"out of memory measuring the chunk at {refused[0]}" in note for note in result.notes)


def test_smaller_cap_gives_smaller_context(fit256, fit512):
    assert fit256.context < fit512.context
    assert fit256.measured.slot_bytes_per_position == fit512.measured.slot_bytes_per_position > 0


def test_drafting_counts_each_slots_kept_states_and_leaves_less_context(model, fit256):
    """Speculative decoding keeps a slot's carried state after each draft position (StateBatch.allocate_history):
    the fit counts it per slot, so drafts leave at most the context without them."""
    from qwen4exp.engine.fit import carried_bytes
    kept = model.new_state_batch(4, 64)
    kept.allocate_history(3)
    drafting = _fit(model, 256 * MiB, verify=False, draft_positions=3)
    assert drafting.measured.slot_fixed == fit256.measured.slot_fixed + 3 * carried_bytes(model)
    assert kept.nbytes() - model.new_state_batch(4, 64).nbytes() == 4 * 3 * carried_bytes(model) > 0
    assert drafting.context <= fit256.context


def test_snapshots_in_host_memory_leave_more_context(model, fit256):
    host = _fit(model, 256 * MiB, snapshots=False, verify=False)
    assert host.context > fit256.context
    assert host.plan.devices[0].snapshots == 0 and fit256.plan.devices[0].snapshots > 0
    assert host.verifications == []


def test_plan_table_names_every_row(fit256):
    table = fit256.plan.table()
    for row in ("capacity", "headroom", "weights", "graphs", "caches", "chunk workspace", "snapshots", "free",
                "probes, context search", "probes, chunk search", "notes", "workspace fitted linearly"):
        assert row in table, row
    for probe in fit256.plan.probes:
        assert str(probe.candidate) in table
    assert fit256.plan.devices[0].graphs == 0


def test_a_number_wins_over_auto(model):
    # A cap of 1 byte would fail any fit: a number must not fit at all.
    choice = resolve_max_ctx(8192, model, slots=4, device="cpu", memory_limit=1, snapshots_on_device=True)
    assert choice.context == 8192 and choice.fit is None
    assert resolve_max_ctx("20000", model).context == 20000


@pytest.mark.parametrize("value, words", [
    (8190, "multiple of the QSA compress ratio 4"), (0, "positive multiple"),
    (262148, "past the model's trained context of 262144"), ("lots", "'auto' or a number"), (True, "'auto' or a"),
])
def test_bad_numbers_are_refused(model, value, words):
    with pytest.raises(FitError, match=words):
        resolve_max_ctx(value, model)


def test_other_architectures_refuse_auto():
    with pytest.raises(FitError, match="only for qwen4_exp models, not Linear"):
        resolve_max_ctx("auto", torch.nn.Linear(2, 2), slots=1, device="cpu", snapshots_on_device=False)


@pytest.mark.parametrize("cap, when", [
    (48, ", before measuring the chunk's workspace"),   # the slots and snapshots alone miss
    (72, ""),                                            # they fit, the measured chunk does not
])
def test_cap_below_the_floor_names_what_is_missing(model, cap, when):
    with pytest.raises(FitError) as caught:
        _fit(model, cap * MiB)
    text = str(caught.value)
    # The breakdown's figures, from what the model measures: its weights, and 4 slots' states at 4096 (again
    # for the 4 snapshots), each state a fixed part plus bytes per position.
    per_position, fixed = measure_state(model, torch.device("cpu"), 4096)
    caches = f"{4 * (fixed + per_position * 4096) / MiB:.1f} MiB"          # the plan writes one decimal
    for words in (f"cannot fit 4 slot(s) on cpu with {cap}.00 MiB (memory limit) and 10% headroom{when}:",
                  "context 4096 is the floor and still does not fit: device 'cpu' needs", "more (needed",
                  f"weights {weight_bytes(model, CPU) / MiB:.1f} MiB", f"caches {caches}", f"snapshots {caches}",
                  "available"):
        assert words in text, (words, text)
    workspace = text.split("chunk workspace ")[1].split(" +")[0]
    assert (workspace == "0 B") == bool(when), text


def test_weights_over_the_cap_are_refused_before_anything_runs(model):
    with pytest.raises(FitError, match=r"the weights alone, 4.39 MiB, do not fit in the 3.60 MiB available on cpu "
                                       r"\(4.00 MiB, memory limit, less 10% headroom\)"):
        _fit(model, 4 * MiB)


def test_a_missed_verification_moves_the_answer_down(model, fit256, monkeypatch):
    real = fit_module.verify_context
    calls = []

    def first_misses(model, device, context, rows, *args):
        checks = real(model, device, context, rows, *args)
        calls.append(context)
        if len(calls) == 1:     # as if the device had held 40 MiB more than the model said
            checks[0] = Verification(context, rows[0], checks[0].available + 40 * MiB, checks[0].available)
        return checks

    monkeypatch.setattr(fit_module, "verify_context", first_misses)
    result = _fit(model, 256 * MiB)
    assert calls[0] == fit256.context and len(calls) == 2
    assert result.context < fit256.context and result.verifications[-1].fits
    assert result.verifications[0].context == calls[0] and not result.verifications[0].fits


@pytest.fixture
def no_cpu_limit():
    yield
    set_device_memory_limit("cpu", None)


def test_plan_command_prints_a_parsable_plan(tiny_checkpoint, capsys, no_cpu_limit):
    from qwen4exp.plan_cli import main

    assert main(["--model", str(tiny_checkpoint), "--device", "cpu", "--device-memory-limit", "256MiB",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["device_memory_limit"] == 256 * MiB and doc["snapshots"] == "device"
    assert doc["context"] % STEP == 0 and doc["context"] == doc["plan"]["context"]
    assert doc["plan"]["devices"][0]["capacity"] == 256 * MiB
    assert doc["plan"]["probes"] and doc["verifications"][0]["fits"]
    assert device_memory_limit("cpu") == 256 * MiB


def test_plan_command_checks_a_given_context(tiny_checkpoint, capsys, no_cpu_limit):
    from qwen4exp.plan_cli import main

    assert main(["--model", str(tiny_checkpoint), "--device", "cpu", "--device-memory-limit", "256MiB",
                 "--max-ctx", "8192", "--no-verify"]) == 0
    out = capsys.readouterr().out
    assert "serving: context 8192" in out and "chunk workspace" in out and "not verified" in out
    with pytest.raises(SystemExit, match="context 65536 is the floor and still does not fit"):
        main(["--model", str(tiny_checkpoint), "--device", "cpu", "--device-memory-limit", "256MiB",
              "--max-ctx", "65536", "--no-verify"])
    with pytest.raises(SystemExit, match="--device-memory-limit: unknown size unit 'xb'"):
        main(["--model", str(tiny_checkpoint), "--device", "cpu", "--device-memory-limit", "12XB"])


def test_plan_takes_its_settings_from_a_profile(tmp_path, capsys, no_cpu_limit):
    from qwen4exp.plan_cli import main

    profile = tmp_path / "box.toml"
    profile.write_text('model = "tiny"\nslots = 2\nmax_ctx = "auto"\ndevice_memory_limit = "256MiB"\n'
                       '[[devices]]\nname = "cpu"\nrole = "target"\n')
    assert main(["--profile", str(profile), "--slots", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["device_memory_limit"] == 256 * MiB          # from the profile
    assert doc["slots"] == 3                                 # the flag wins over the profile


def test_a_profile_headroom_leaves_that_share_free(tmp_path, capsys, no_cpu_limit):
    """`headroom` in a profile is the share of the device the fit keeps free: 40% of 256 MiB leaves too little for
    16 slots, 5% (--headroom, which wins over the profile) fits them; a share past one half is refused by name."""
    from qwen4exp.plan_cli import main

    profile = tmp_path / "box.toml"
    profile.write_text('model = "tiny"\nslots = 16\nmax_ctx = "auto"\ndevice_memory_limit = "256MiB"\n'
                       'headroom = 0.4\n[[devices]]\nname = "cpu"\nrole = "target"\n')
    with pytest.raises(SystemExit, match=r"available 153.6 MiB of 256.0 MiB after 102.4 MiB headroom"):
        main(["--profile", str(profile), "--no-verify"])
    assert main(["--profile", str(profile), "--headroom", "0.05", "--no-verify", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["headroom"] == 0.05 and doc["context"] >= 4096
    with pytest.raises(SystemExit):
        main(["--profile", str(profile), "--headroom", "0.6"])
    assert "--headroom: 0.6 is not a fraction from 0 to 0.5" in capsys.readouterr().err


class _Recorded(Exception):
    pass


@pytest.mark.parametrize("devices, chunk, slots, floor", [
    ('device_memory_limit = "256MiB"\nheadroom = 0.2\n[[devices]]\nname = "cpu"\nrole = "target"\n', 512, 2, 512),
    # The device's own limit wins over device_memory_limit; chunk "auto" on the CPU is 64, held as 256 rows.
    (('device_memory_limit = "1GiB"\n[[devices]]\nname = "cpu"\nrole = ["target", "snapshots"]\n'
      'memory_limit = "256MiB"\n'), '"auto"', 3, 256),
])
def test_plan_and_serve_fit_the_same_profile_with_the_same_settings(tiny_checkpoint, tmp_path, monkeypatch,
                                                                     no_cpu_limit, devices, chunk, slots, floor):
    """`qwen4exp plan --profile P` and the worker `serve` starts for P call the fit with the same settings: the
    chunk it must hold (the profile's, not the planner's default 256), where snapshots live, the limit."""
    import inspect

    from qwen4exp.config import load_settings
    from qwen4exp.engine.engine_config import EngineConfig
    from qwen4exp.plan_cli import main as plan
    from qwen4exp.server.worker import Worker

    calls = []

    def record(model, **kwargs):
        bound = inspect.signature(fit_context).bind(model, **kwargs)
        bound.apply_defaults()
        calls.append({k: v for k, v in bound.arguments.items() if k != "model"})
        raise _Recorded

    monkeypatch.setattr(fit_module, "fit_context", record)
    profile = tmp_path / "box.toml"
    profile.write_text(f'model = "{tiny_checkpoint}"\nslots = {slots}\nmax_ctx = "auto"\nchunk = {chunk}\n{devices}')
    with pytest.raises(_Recorded):
        plan(["--profile", str(profile)])
    with pytest.raises(_Recorded):
        Worker(EngineConfig.from_settings(load_settings(profile)), conn=None).load()
    planned, served = calls
    assert planned["chunk_floor"] == floor and planned["slots"] == slots and planned["memory_limit"] == 256 * MiB
    assert planned["headroom"] == (0.2 if "headroom" in devices else 0.1)
    assert planned["snapshots_on_device"] is True          # on the CPU, snapshots take the memory the slots use
    assert planned == served
