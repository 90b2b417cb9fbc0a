"""The planner through the Python API: the estimate, the state machines, errors and threads."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import pytest

from qwen4exp._core import (
    ChunkFit,
    ContextFit,
    DeviceBudget,
    DeviceProbe,
    Planner,
    PlannerError,
)

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def gpu(**overrides: object) -> DeviceBudget:
    """32 GiB, 4 GiB headroom, 18 GiB fixed, 64 KiB per position, workspace 256 MiB + 4 KiB/position."""
    args: dict[str, object] = dict(
        bytes_per_position=64 * KIB,
        weights=16 * GIB,
        graphs=GIB,
        slot_state=GIB,
        workspace=[(0, 256 * MIB), (65536, 512 * MIB)],
        slots=4,
        headroom=0.125,
    )
    args.update(overrides)
    name = str(args.pop("name", "cuda:0"))
    capacity = int(args.pop("capacity", 32 * GIB))  # type: ignore[call-overload]
    return DeviceBudget(name, capacity, **args)  # type: ignore[arg-type]


def drive(fit: ContextFit | ChunkFit, need: Callable[[str, int], int], available: dict[str, int]) -> int | None:
    """Plays the engine: tries each candidate and reports what every device needed."""
    while (candidate := fit.candidate) is not None:
        fit.report([DeviceProbe(d, need(d, candidate), available[d]) for d in fit.devices])
    return fit.answer


def test_estimate_matches_the_hand_computed_plan() -> None:
    plan = Planner([gpu()]).estimate()
    # 18.25 GiB + 68 KiB per position <= 28 GiB: 150347 positions, so 147456.
    assert plan.context == 147456
    assert plan.binding == "cuda:0"
    assert plan.chunk == 256
    (d,) = plan.devices
    assert (d.capacity, d.headroom, d.weights, d.graphs) == (32 * GIB, 4 * GIB, 16 * GIB, GIB)
    assert d.caches == GIB + 147456 * 64 * KIB
    assert d.free == GIB - 832 * MIB
    assert plan.notes[0].startswith("estimate")
    assert any("fitted linearly in position" in n for n in plan.notes)
    assert [p.candidate for p in plan.probes][0] == 262144


def test_plan_table_and_dict() -> None:
    plan = Planner([gpu()]).estimate()
    table = plan.table()
    for want in ("context 147456 (binding: cuda:0)", "capacity", "chunk workspace", "snapshots", "free", "miss", "fit"):
        assert want in table
    assert str(plan) == table
    as_dict = json.loads(json.dumps(plan.to_dict()))
    assert as_dict["context"] == 147456
    first = as_dict["probes"][0]
    assert first["fits"] is False and first["devices"][0]["needed"] > first["devices"][0]["available"]
    assert set(as_dict["devices"][0]) >= {"capacity", "headroom", "weights", "caches", "graphs", "workspace", "snapshots", "free"}


def test_every_next_context_misses_in_the_model() -> None:
    planner = Planner([gpu()])
    plan = planner.estimate()
    assert all(p.fits for p in planner.evaluate(plan.context))
    assert not all(p.fits for p in planner.evaluate(plan.context + planner.step))


def test_the_floor_miss_says_what_is_missing() -> None:
    with pytest.raises(PlannerError) as info:
        Planner([gpu(weights=40 * GIB)]).estimate()
    msg = str(info.value)
    for want in ("context 4096 is the floor", "'cuda:0' needs", "weights 40.00 GiB", "available 28.00 GiB of 32.00 GiB"):
        assert want in msg
    assert isinstance(info.value, ValueError)


def test_the_shrink_arithmetic_through_the_state_machine() -> None:
    fit = ContextFit([("cuda:0", MIB)])
    assert fit.candidate == 262144
    # 10 GiB short at 1 MiB per position: 10240 positions, rounded down to 8192.
    assert fit.report([DeviceProbe.miss("cuda:0", 10 * GIB)]) == 253952
    # A tiny miss still shrinks one step.
    assert fit.report([DeviceProbe.miss("cuda:0", 1)]) == 249856
    # A fit one step below the smallest miss: the two are one step apart and the search stops.
    assert fit.report([DeviceProbe.fit("cuda:0", GIB)]) is None
    assert (fit.answer, fit.binding, fit.done) == (249856, "cuda:0", True)
    assert [p.fits for p in fit.probes] == [False, False, True]


def test_interpolation_between_fit_and_miss() -> None:
    fit = ContextFit([("d", MIB)])
    fit.report([DeviceProbe.miss("d", 200 * GIB)])  # cut 204800 -> 57344
    assert fit.candidate == 57344
    # Spare 1, shortfall 200 (from the miss at 262144): 1/201 of 204800 is 1018 -> clamped to 61440.
    assert fit.report([DeviceProbe.fit("d", GIB)]) == 61440
    # Spare 50, shortfall 200: a fifth of the way up, rounded down to the step: 98304.
    assert fit.report([DeviceProbe.fit("d", 50 * GIB)]) == 98304


def test_real_mode_search_then_report() -> None:
    planner = Planner([gpu()])
    cf = planner.context_fit()
    model = lambda d, c: planner.evaluate(c)[0].needed  # noqa: E731
    answer = drive(cf, lambda d, c: model(d, c) + GIB, {"cuda:0": 28 * GIB})
    assert answer is not None and answer < 147456
    ch = planner.chunk_fit()
    with pytest.raises(PlannerError, match="not answered"):
        planner.report(cf, ch)
    while (rows := ch.candidate) is not None:
        ch.report(planner.evaluate(answer, rows))
    plan = planner.report(cf, ch)
    assert plan.context == answer
    assert [p.candidate for p in plan.probes] == [p.candidate for p in cf.probes]
    assert plan.probes[0].devices[0].needed == model("cuda:0", 262144) + GIB


def test_split_serving_names_the_binding_device() -> None:
    small = DeviceBudget("r9700", 32 * GIB, bytes_per_position=256 * KIB)
    large = DeviceBudget("strix", 96 * GIB, bytes_per_position=128 * KIB)
    plan = Planner([small, large]).estimate()
    assert (plan.context, plan.binding) == (114688, "r9700")
    assert [d.device for d in plan.probes[0].devices] == ["r9700", "strix"]


def test_chunk_fit_bisects_to_the_largest_whole_step() -> None:
    ch = ChunkFit(["cuda:0"], floor_chunk=512, max_chunk=8192)
    assert drive(ch, lambda d, rows: rows * 1000, {"cuda:0": 3_300_000}) == 3072
    assert ch.binding == "cuda:0"


def test_snapshots_on_the_device_shrink_the_context() -> None:
    without = Planner([gpu()]).estimate()
    plan = Planner([gpu(snapshot_base=100 * MIB, snapshot_per_position=8 * KIB)]).estimate()
    assert plan.context < without.context
    assert plan.devices[0].snapshots_on_device
    assert plan.devices[0].snapshots == 4 * (100 * MIB + 8 * KIB * plan.context)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"headroom": 1.0}, "headroom 1 is not a fraction"),
        ({"headroom": -0.1}, "not a fraction"),
        ({"capacity": 0}, "capacity is 0"),
        ({"slots": 0}, "slots is 0"),
        ({"name": ""}, "needs a name"),
    ],
)
def test_device_inputs_are_checked(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(PlannerError, match=message):
        gpu(**overrides)


def test_negative_bytes_are_refused_by_type() -> None:
    with pytest.raises(OverflowError):
        gpu(weights=-1)


def test_search_settings_are_checked() -> None:
    with pytest.raises(PlannerError, match="floor context 5000"):
        Planner([gpu()], floor=5000)
    with pytest.raises(PlannerError, match="listed twice"):
        Planner([gpu(), gpu()])
    with pytest.raises(PlannerError, match="at least one device"):
        Planner([])
    with pytest.raises(PlannerError, match="maximum chunk of 1000"):
        Planner([gpu()], max_chunk=1000)
    with pytest.raises(PlannerError, match="trained context 2048"):
        ContextFit([("d", 1)], trained=2048)


def test_reports_out_of_turn_are_refused() -> None:
    fit = ContextFit([("a", 1), ("b", 1)])
    with pytest.raises(PlannerError, match="no outcome for device 'b'"):
        fit.report([DeviceProbe.fit("a", 1)])
    with pytest.raises(PlannerError, match="unknown device 'c'"):
        fit.report([DeviceProbe.fit("a", 1), DeviceProbe.fit("c", 1)])
    assert fit.probes == [] and fit.candidate == 262144
    fit.report([DeviceProbe.fit("a", 1), DeviceProbe.fit("b", 1)])
    with pytest.raises(PlannerError, match="already answered 262144"):
        fit.report([DeviceProbe.fit("a", 1), DeviceProbe.fit("b", 1)])
    with pytest.raises(PlannerError, match="positive shortfall"):
        DeviceProbe.miss("a", 0)


def test_a_failed_search_stays_failed() -> None:
    fit = ContextFit([("d", MIB)])
    fit.report([DeviceProbe.miss("d", 1 << 50)])
    assert fit.candidate == 4096
    with pytest.raises(PlannerError, match="context 4096 is the floor"):
        fit.report([DeviceProbe(device="d", needed=30 * GIB, available=28 * GIB)])
    assert fit.done and fit.answer is None and fit.failure is not None
    with pytest.raises(PlannerError, match="needs 2.00 GiB more"):
        fit.report([DeviceProbe.fit("d", 1)])


def test_shared_objects_from_many_threads() -> None:
    planner = Planner([gpu(), DeviceBudget("cuda:1", 24 * GIB, bytes_per_position=32 * KIB)])
    expected = planner.estimate().context
    fit = planner.context_fit()
    lock = threading.Lock()
    results: list[int] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(20):
                results.append(planner.estimate().context)
                with lock:  # one engine step at a time; readers need no lock
                    if (c := fit.candidate) is not None:
                        fit.report(planner.evaluate(c))
                _ = (fit.probes, fit.answer, fit.binding)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert set(results) == {expected}
    assert fit.answer == expected
