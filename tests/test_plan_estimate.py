"""`qwen4exp plan --estimate` (engine/fit_estimate.py): the plan for another box from the config alone, held to
measured plans where both exist.

- On this CPU: the real `plan` of the tiny preset under a memory cap, measured in the test, against the estimate
  for the same cap: the context within 5%, weights and slot bytes exact, the workspace samples close.
- On the H200: the fits recorded in docs/results (read here, so a drift of the estimator from them fails):
  the full model at UD-Q4_K_XL with the PLE table on the device and in host memory, the bench preset's chunk
  workspace by rows.
- The three boxes of the issue answer, the estimate touches no device and loads no weights, and bad flags are
  refused by name.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qwen4exp.engine import fit_estimate
from qwen4exp.engine.fit_estimate import DeviceSize, EstimateError, chunk_workspace, estimate_plan, model_facts
from qwen4exp.plan_cli import main

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
MiB = 1 << 20


def within(estimated: float, measured: float, fraction: float) -> bool:
    return abs(estimated - measured) <= fraction * abs(measured)


def run_plan(capsys, *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def full_ud():
    return model_facts("full", "ud-q4_k_xl", "bfloat16")


# ---- against a plan measured here ------------------------------------------------------------------------------------
def test_the_estimate_matches_the_plan_measured_on_this_cpu(tiny_checkpoint, capsys):
    # The measured plan runs in a process of its own, as `qwen4exp plan` does.
    done = subprocess.run([sys.executable, "-m", "qwen4exp", "plan", "--model", str(tiny_checkpoint), "--device",
                           "cpu", "--device-memory-limit", "256MiB", "--json"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout)
    estimated = run_plan(capsys, "--estimate", "--model", str(tiny_checkpoint), "--device", "cpu", "--devices",
                         "target=256MiB")
    m, e = measured["measured"], estimated["components"]
    assert estimated["snapshots"] == measured["snapshots"] == "device"
    assert within(estimated["context"], measured["context"], 0.05), (estimated["context"], measured["context"])
    assert within(estimated["chunk"], measured["chunk"], 0.05)
    # The weights and one slot's bytes are the same tensors counted on the meta device.
    assert e["weights"] == m["weights"]
    assert (e["slot_bytes_per_position"], e["slot_fixed"]) == (m["slot_bytes_per_position"], m["slot_fixed"])
    assert estimated["devices"][0]["capacity"] == m["capacity"]
    # The workspace formula at each position the fit measured: never below what torch allocated there, since an
    # estimate short of the need is a context that does not fit; above by up to 30% or 6 MiB, which only costs
    # context (the 256-row chunk at 4096 allocated 11.8 MiB with torch 2.15; the formula says 15.8 MiB).
    facts = model_facts(str(tiny_checkpoint), None, "float32")
    for position, size in m["workspace"]:
        formula = sum(chunk_workspace(facts, "torch", position, estimated["chunk_floor"]).values())
        assert 0 <= formula - size <= max(0.3 * size, 6 * MiB), (position, formula, size)


def test_a_gguf_is_estimated_from_its_header_as_it_loads(tmp_path):
    """The weights a .gguf puts on the device (blocks kept quantized, the rest dense) and one slot's bytes, from its
    header alone, equal the loaded model's; the named mix of the same preset plans the same file."""
    from qwen4exp.engine.fit_measure import measure_state, weight_bytes
    from qwen4exp.engine.loading import load_model, quantized_ple_tables
    from test_gguf import write_tiny

    path = write_tiny(tmp_path / "tiny.gguf", "ud-q4_k_xl")
    facts = model_facts(str(path), None, "float32")
    model = load_model(str(path), dtype="float32", device="cpu", progress=False)
    assert facts.weights == weight_bytes(model, torch.device("cpu"))
    # (the tiny preset's PLE rows, 4 values, hold no whole IQ4_NL block: the file keeps that table F16, dense)
    assert facts.ple_table == sum(t.blocks.numel() for t in quantized_ple_tables(model))
    assert (facts.per_position, facts.fixed) == measure_state(model, torch.device("cpu"), 4096)
    # The mix's plan for the same shapes (what `--quant ud-q4_k_xl` estimates) keeps the same weights quantized.
    planned = fit_estimate._facts_from_shapes(facts.cfg, _stacks_of_mix(facts.cfg, "ud-q4_k_xl"), "float32", "mix",
                                              "ud-q4_k_xl")
    assert planned.weights == facts.weights and planned.ple_table == facts.ple_table


def test_an_fp8_checkpoint_is_estimated_as_it_loads(tmp_path):
    """An FP8 checkpoint directory (its experts kept float8) estimates the weights the loaded model holds; the full
    model in FP8 (`--quant fp8`) keeps its experts as FP8_B128 and its PLE table as FP8_B32, and one H200 with 10%
    headroom holds no context even with the table in host memory (127.0 GiB of weights: docs/MODEL.md)."""
    from qwen4exp.checkpoint.fp8_stacks import planned_fp8_stacks
    from qwen4exp.checkpoint.writer import write_random_checkpoint
    from qwen4exp.engine.fit_measure import weight_bytes
    from qwen4exp.engine.loading import load_model

    path = write_random_checkpoint(tmp_path / "fp8", preset="tiny", seed=2, dtype=torch.float32, progress=False,
                                   fp8_block=(128, 128))
    facts = model_facts(str(path), None, "float32")
    model = load_model(str(path), dtype="float32", device="cpu", progress=False)
    assert facts.quant == "fp8" and facts.weights == weight_bytes(model, torch.device("cpu"))
    full = model_facts("full", "fp8", "bfloat16")
    kept = {name: qtype for name, (qtype, _) in planned_fp8_stacks(full.cfg).items()}
    assert set(kept.values()) == {"FP8_B128", "FP8_B32"}
    assert all(q == "FP8_B32" for name, q in kept.items() if "ngram" in name)
    est = estimate_plan(full, DeviceSize("target", "cuda:0", "cuda", 139 << 30), chunk=2048, ple="host")
    assert est.fit.context is None and "do not fit" in est.fit.error
    assert 127 << 30 < full.weights - full.ple_table < 128 << 30
    # With `headroom = 0.05` (a profile key) it serves: the answer an operator of one H200 gets.
    lean = estimate_plan(full, DeviceSize("target", "cuda:0", "cuda", 139 << 30), chunk=2048, ple="host",
                         headroom=0.05)
    assert lean.fit.context is not None and lean.fit.context >= 16384


def _stacks_of_mix(cfg, mix: str) -> dict:
    from qwen4exp.checkpoint.gguf_loader import quantized_stacks
    from qwen4exp.checkpoint.gguf_writer import PlannedFile
    return quantized_stacks(PlannedFile(cfg, mix), cfg)


# ---- against the H200's recorded measurements --------------------------------------------------------------------
@pytest.mark.parametrize("name", ["speed_h200_full_ud_q4_k_xl_2026-12-04.json",
                                  "speed_h200_full_ud_q4_k_xl_ple_host_2026-12-04.json"])
def test_the_estimate_matches_the_recorded_h200_fits_of_the_full_model(name, full_ud):
    run = json.loads((RESULTS / name).read_text())
    settings, fit = run["settings"], run["fit"]
    assert (settings["preset"], settings["quant"], settings["dtype"]) == ("full", "ud-q4_k_xl", "bfloat16")
    target = DeviceSize("target", "cuda:0", "cuda", run["memory"]["device_total_bytes"])
    est = estimate_plan(full_ud, target, slots=fit["slots"], chunk=settings["chunk"], ple=settings["ple"])
    assert est.fit.ple == settings["ple"] and est.fit.error is None
    assert within(est.fit.weights, fit["weights_bytes"], 0.001), (est.fit.weights, fit["weights_bytes"])
    assert within(target.capacity, fit["capacity_bytes"], 0.001)
    assert within(est.fit.context, fit["context"], 0.05), (est.fit.context, fit["context"])
    assert within(est.fit.chunk, fit["chunk"], 0.05), (est.fit.chunk, fit["chunk"])


def test_ple_auto_moves_the_full_models_table_to_host_memory_on_the_h200(full_ud):
    """As the engine decides (PERFORMANCE.md: 131072 with the table on the device, 262144 in host memory)."""
    target = DeviceSize("target", "cuda:0", "cuda", fit_estimate.H200_TOTAL_BYTES)
    est = estimate_plan(full_ud, target, chunk=4096, ple="auto")
    assert [(t.ple, t.context) for t in est.tried] == [("device", 131072), ("host", 262144)]
    assert est.fit.ple == "host" and any("host memory" in note for note in est.notes)


def test_the_bench_workspace_by_rows_matches_the_recorded_sweep():
    """docs/results/chunk_sweep_h200_5341396.json: the bench preset in bfloat16 at position 65536 (the calibration of
    the Triton per-row constant: each sample within 20%), and one slot's bytes within 5% of the measured total."""
    sweep = json.loads((RESULTS / "chunk_sweep_h200_5341396.json").read_text())
    bench = model_facts("bench", None, "bfloat16")
    for rows, mib in sweep["workspace_MiB_at_65536"].items():
        formula = sum(chunk_workspace(bench, "triton", 65536, int(rows)).values())
        assert within(formula, mib * MiB, 0.20), (rows, formula / MiB, mib)
    for probe, (per_position, fixed) in zip((4096, 8192), sweep["state_bytes_4096_8192"]):
        assert within(bench.per_position * probe + bench.fixed, per_position * probe + fixed, 0.05)


# ---- the three boxes ------------------------------------------------------------------------------------------------
def test_the_seeds_box_is_served_split_at_262144_where_the_target_alone_fits_nothing(capsys):
    doc = run_plan(capsys, "--estimate", "--profile", str(ROOT / "profiles" / "qwen-next-r9700-strix.toml"),
                   "--model", "full", "--quant", "ud-q4_k_xl")
    assert [d["total"] for d in doc["devices"]] == [32 << 30, 128 << 30]
    alone = doc["target_alone"]
    assert alone["context"] is None and "the weights alone" in alone["error"]      # 76.8 GiB on a 32 GiB card
    # The seed fits 131072 x 4 on this box with every cache on the R9700; with the split layers' caches on the
    # iGPU, the trained context x 4 (the goal).
    split = doc["split"]
    assert split["served"] is True and doc["context"] == split["context"] == 262144 and doc["ple"] == "host"
    held = split["split_layers"]["cuda:1"]
    assert held["last"] == 47 and 0 < held["first"] and held["bytes"] > 0
    # Each device's budget in the plan: the iGPU holds its layers' weights and their caches.
    devices = {d["name"]: d for d in doc["plan"]["devices"]}
    assert devices["cuda:1"]["weights"] == held["bytes"] and devices["cuda:1"]["caches"] > 20 << 30
    text = main_text(capsys, "--estimate", "--profile", str(ROOT / "profiles" / "qwen-next-r9700-strix.toml"),
                     "--model", "full", "--quant", "ud-q4_k_xl")
    assert "the target alone (no split): no context fits" in text
    assert f"layers {held['first']}..47" in text and "serving: context 262144 a slot" in text


def test_one_h200_answers_262144_with_the_ple_table_in_host_memory(capsys):
    doc = run_plan(capsys, "--estimate", "--profile", str(ROOT / "profiles" / "h200.toml"), "--model", "full",
                   "--quant", "ud-q4_k_xl", "--slots", "4")
    assert doc["context"] == 262144 and doc["ple"] == "host" and doc["host_memory_for_ple"] > 0
    assert doc["split"] is None and doc["plan"]["context"] == 262144


def test_two_24gb_cards_answer_that_the_full_model_does_not_fit(capsys):
    doc = run_plan(capsys, "--estimate", "--model", "full", "--quant", "ud-q4_k_xl", "--devices",
                   "target=24GiB,split=24GiB")
    assert doc["target_alone"]["context"] is None and "do not fit" in doc["target_alone"]["error"]
    assert doc["context"] is None and doc["split"]["context"] is None and "do not fit" in doc["split"]["error"]
    assert doc["split"]["split_layers"]["split"]["last"] == 47      # as many layers as the second card holds
    assert {t["ple"] for t in doc["tried"]} == {"device", "host"}


def main_text(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


# ---- nothing is loaded, no device is touched --------------------------------------------------------------------
def test_the_estimate_touches_no_device_and_loads_no_weights(tmp_path, monkeypatch, capsys):
    from qwen4exp.checkpoint import gguf_file, gguf_loader, loader
    from qwen4exp.engine import loading
    from test_gguf import write_tiny

    path = write_tiny(tmp_path / "tiny.gguf", "q8_0")

    def refuse(*args, **kwargs):
        raise AssertionError("the estimate touched a device or read weights")

    for module, names in ((torch.cuda, ("is_available", "device_count", "mem_get_info", "init", "synchronize",
                                         "memory_reserved", "memory_allocated", "current_device")),
                          (loading, ("load_model", "build_model")), (loader, ("load_weights",)),
                          (gguf_loader, ("load_gguf_weights",)), (gguf_file.GGUFCheckpoint, ("array", "raw"))):
        for name in names:
            monkeypatch.setattr(module, name, refuse)
    for model in (str(path), "full"):
        extra = ["--quant", "ud-q4_k_xl"] if model == "full" else []
        doc = run_plan(capsys, "--estimate", "--model", model, *extra, "--devices", "target=32GiB,split=128GiB")
        assert doc["split"]["context"] is not None


# ---- refusals name the flag -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--devices", "target=12XB"], "--devices: target=12XB"),
    (["--devices", "split=24GiB"], "--devices 'split=24GiB' names no target"),
    (["--devices", "gpu=24GiB"], "--devices: 'gpu=24GiB' is not ROLE=SIZE"),
    (["--devices", "target=0"], "--devices: target=0 must be more than 0"),
    (["--devices", "target=24GiB,target=8GiB"], "--devices names the target twice"),
    ([], "--estimate needs each device's memory"),
    (["--devices", "target=24GiB", "--quant", "q9"], "--quant 'q9'"),
    (["--devices", "target=24GiB", "--device", "tpu"], "--device 'tpu'"),
    (["--devices", "target=24GiB", "--ple", "host"], "--ple host keeps a GGUF's quantized PLE table"),
    (["--devices", "target=24GiB", "--max-ctx", "6"], "--max-ctx 6 must be"),
    (["--devices", "target=24GiB", "--chunk", "-4"], "--chunk must be more than 0"),
    (["--devices", "target=24GiB", "--slots", "17"], "--slots must be"),
    (["--devices", "target=24GiB", "--model", "org/repo"], "--model 'org/repo'"),
    (["--devices", "target=24GiB", "--device-memory-limit", "0"], "--device-memory-limit must be more"),
])
def test_bad_estimate_flags_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as refused:
        main(["--estimate", "--model", "bench", *argv])
    assert message in str(refused.value), str(refused.value)


def test_estimate_flags_without_estimate_are_refused(tiny_checkpoint):
    with pytest.raises(SystemExit, match="--devices is for --estimate"):
        main(["--model", str(tiny_checkpoint), "--device", "cpu", "--devices", "target=1GiB"])


def test_a_profile_device_without_memory_is_named(tmp_path):
    profile = tmp_path / "box.toml"
    profile.write_text('model = "tiny"\n[[devices]]\nname = "cuda:0"\nrole = "target"\n')
    with pytest.raises(SystemExit, match=r"cuda:0 \(target\) has no `memory`"):
        main(["--estimate", "--profile", str(profile)])


def test_a_gguf_with_a_quant_flag_is_refused(tmp_path):
    with pytest.raises(EstimateError, match="--quant Q4_K: a GGUF's types come from its header"):
        model_facts(str(tmp_path / "x.gguf"), "Q4_K", "bfloat16")


def test_drafting_slots_keep_their_states_in_the_estimate_as_in_the_fit(tiny_checkpoint):
    """mtp = 2: each slot's fixed bytes grow by two carried states (as fit.fit_context counts them), and the
    context does not grow; "auto" drafts nothing on a CPU."""
    from qwen4exp.engine.fit import carried_bytes
    from qwen4exp.engine.loading import load_model

    facts = model_facts(str(tiny_checkpoint), None, "float32")
    assert facts.carried == carried_bytes(load_model(str(tiny_checkpoint), dtype="float32", device="cpu",
                                                     progress=False)) > 0
    target = DeviceSize("target", "cpu", "cpu", 256 * MiB)
    plain = estimate_plan(facts, target, chunk=64, mtp="auto")
    drafting = estimate_plan(facts, target, chunk=64, mtp=2)
    assert plain.drafts == 0 and drafting.drafts == 2 and any("2 draft positions" in n for n in drafting.notes)
    assert drafting.fit.context <= plain.fit.context
    with pytest.raises(EstimateError, match="from 0 to 7, got 9"):
        estimate_plan(facts, target, chunk=64, mtp=9)


def test_layers_in_host_memory_share_it_with_a_ple_table_kept_there(capsys):
    """A 24 GB GPU beside 128 GiB of host memory: most layers go to the host, the PLE table too, and the table is
    counted against the host's share: with 96 GiB, a host split fits 40960 a slot where a 96 GiB GPU, whose memory
    the table does not take, fits 262144."""
    roomy = run_plan(capsys, "--estimate", "--model", "full", "--quant", "ud-q4_k_xl", "--device", "cuda",
                     "--devices", "target=24GiB,split=128GiB")
    assert roomy["context"] == 262144 and roomy["ple"] == "host"
    assert roomy["split"]["split_layers"]["split"]["last"] == 47
    from qwen4exp.engine.fit_estimate import DeviceSize, estimate_plan, model_facts

    facts = model_facts("full", "ud-q4_k_xl", "bfloat16")
    target = DeviceSize("target", "cuda:0", "cuda", 24 << 30)
    host = estimate_plan(facts, target, (DeviceSize("split", "cpu", "cpu", 96 << 30),), chunk=512).split
    gpu = estimate_plan(facts, target, (DeviceSize("split", "cuda:1", "cuda", 96 << 30),), chunk=512).split
    assert (host.context, host.ple, gpu.context, gpu.ple) == (40960, "host", 262144, "host")


@pytest.mark.parametrize("devices, where", [("target=80", "--devices target=80: 80 B"),
                                            ("target=32GiB,split=128", "--devices split=128: 128 B")])
def test_a_gpu_size_without_its_unit_is_named(devices, where):
    """What the CUDA driver keeps leaves nothing of 80 bytes: the size is named, not a negative budget."""
    with pytest.raises(SystemExit, match=f"error: {where} is no more than the .* the driver and context take: a "
                                         "size without its unit"):
        main(["--estimate", "--model", "full", "--quant", "ud-q4_k_xl", "--devices", devices])


@pytest.mark.parametrize("argv", [["--max-ctx", "1024", "--no-verify"], ["--estimate", "--model", "full", "--quant",
                                                                          "ud-q4_k_xl", "--devices", "target=139GiB"]])
def test_a_chunk_serve_would_refuse_is_refused_by_plan_too(argv):
    with pytest.raises(SystemExit, match=r"--chunk must be a multiple of 4 tokens \(the QSA block\).*got 7"):
        main([*argv, "--chunk", "7"])


@pytest.mark.parametrize("argv", [["--max-ctx", "1024", "--no-verify"], ["--estimate", "--model", "full", "--quant",
                                                                          "ud-q4_k_xl", "--devices", "target=139GiB"]])
def test_a_dtype_no_profile_takes_is_refused_by_plan(argv, capsys):
    """A profile's dtype is float32 or bfloat16: a plan for float16 would fit an engine that serve cannot build."""
    with pytest.raises(SystemExit):
        main([*argv, "--dtype", "float16"])
    assert "--dtype: invalid choice: 'float16'" in capsys.readouterr().err


def test_plan_takes_a_profiles_dtype_spellings(capsys):
    """bf16 is bfloat16, as in a profile: the same estimate."""
    argv = ["--estimate", "--model", "full", "--quant", "ud-q4_k_xl", "--devices", "target=139GiB", "--ple", "host"]
    assert run_plan(capsys, *argv, "--dtype", "bf16") == run_plan(capsys, *argv, "--dtype", "bfloat16")
