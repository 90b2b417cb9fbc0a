"""Every Triton kernel, at the shapes the engine launches for the bench and full presets (prompt chunks of 1-4096
tokens, dense and ranked QSA, decode steps of 1-8 rows; bfloat16, and GGUF weights in every block type),
compiled on the CPU for each GPU of guard.CHECKED_TARGETS: the H200's sm_90, sm_80, the R9700's gfx1201 and the
Strix Halo's gfx1151. A kernel that does not build, or asks a block for more shared memory (LDS) than the target
gives, is what an operator would meet as a crash at the first request; here it fails unless its op is in
guard.NOT_BUILT for that target, where the engine runs the op's torch form instead."""

from __future__ import annotations

import functools
import json
import importlib
import pkgutil

import pytest
import torch

from qwen4exp import kernels
from qwen4exp.checkpoint.presets import preset_config
from qwen4exp.engine.model import backend, kernel_launches
from qwen4exp.engine.model.config import ModelConfig
from qwen4exp.engine.model.ops import TORCH_OPS, TorchOps
from qwen4exp.engine.model.triton_ops import TRITON_OPS, TritonOps
from qwen4exp.engine.warm_up import warm_up_chunks
from qwen4exp.kernels import ahead_of_time, guard, quant_tiles

triton = pytest.importorskip("triton")

TARGETS = sorted(guard.CHECKED_TARGETS)
META = torch.device("meta")


@functools.cache
def recorded(preset: str, target: str, quant: str | None = None, **shapes) -> tuple[ahead_of_time.Launch, ...]:
    config = ModelConfig.from_dict(preset_config(preset, dtype="bfloat16"))
    quantized = kernel_launches.quantized_for(config, quant) if quant else None
    return tuple(kernel_launches.record(config, guard.CHECKED_TARGETS[target], quantized=quantized, **shapes))


def engine_launches(target: str) -> list[ahead_of_time.Launch]:
    """The bench and full presets in bfloat16 and as the UD-Q4_K_XL GGUF, and the bench preset's experts and PLE
    table in each block type (prompt chunks and decode steps of two sizes: the block kernels' code is the same
    at any)."""
    launches = recorded("bench", target) + recorded("full", target) + recorded("full", target, "ud-q4_k_xl")
    for qtype in quant_tiles.QTYPES:      # Q8_0_R: the Q8_0 projections, regrouped as a load regroups them
        if qtype != "Q8_0_R":
            launches += recorded("bench", target, qtype, chunks=(37, 512), decode_rows=(1, 4))
    return ahead_of_time.distinct(launches)


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_every_kernel_builds_for_each_checked_gpu(target):
    builds = [ahead_of_time.build(launch, guard.CHECKED_TARGETS[target]) for launch in engine_launches(target)]
    failed = [build for build in builds if build.error]
    report = "\n".join(f"{build.launch.describe()}: {build.error}" for build in failed)
    expected = guard.NOT_BUILT.get(target, {})
    assert {build.launch.op for build in failed} == set(expected), \
        f"kernels that do not build for {target} (guard.NOT_BUILT lists {sorted(expected)}):\n{report}"
    assert all(build.shared is not None for build in builds if build.launch.op not in expected)


def package_kernels() -> set[str]:
    """The launchable kernels (named *_kernel; the other jitted functions are called from kernels)."""
    names = set()
    for module in pkgutil.iter_modules(kernels.__path__):
        for name, value in vars(importlib.import_module(f"qwen4exp.kernels.{module.name}")).items():
            if isinstance(value, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                names.add(name)
    return names


@pytest.mark.parametrize("preset, quant", [("bench", None), ("full", "ud-q4_k_xl")])
def test_a_prompt_of_any_length_runs_the_binaries_the_warm_up_built(preset, quant):
    """The chunks a worker runs before it serves (engine/warm_up.py, at the shipped 4096-token chunk) launch every
    binary that prompt chunks of other lengths launch: a request never waits on a compile. A kernel specializing
    on a count that follows the prompt's length (rows, expert pairs) would give the lengths new binaries."""
    config = ModelConfig.from_dict(preset_config(preset, dtype="bfloat16"))
    kinds = tuple(sorted({rows for _, rows in warm_up_chunks(config, 4096, capacity=1 << 20)}))
    warmed = {launch.key() for launch in recorded(preset, "sm_90", quant, chunks=kinds, decode_rows=(1,))}
    lengths = (2, 5, 17, 48, 100, 333, 500, 2047, 3000, 4096)   # the grid's last position: 4096, as warmed
    others = recorded(preset, "sm_90", quant, chunks=lengths, decode_rows=(1,))
    assert [launch.describe() for launch in others if launch.key() not in warmed] == []


def test_a_long_prompts_far_chunks_run_the_binaries_the_warm_up_built():
    """Far into a 262144-token context the indexer ranks a 4096-token chunk's queries in slices (3 to 8 of them
    on the bench shape); each slice's launches must be the warm-up's binaries too. Slices that started at any
    row had unaligned views, and the H200 compiled two more binaries of the selection kernel during a first
    262144-token prompt (docs/PERFORMANCE.md)."""
    config = ModelConfig.from_dict(preset_config("bench", dtype="bfloat16"))
    kinds = tuple(sorted({rows for _, rows in warm_up_chunks(config, 4096, capacity=1 << 20)}))
    warmed = {launch.key() for launch in recorded("bench", "sm_90", chunks=kinds, decode_rows=(1,))}
    far = recorded("bench", "sm_90", chunks=(4096,), decode_rows=(1,), capacity=262144,
                   starts=tuple(4096 * k for k in (20, 36, 44, 52, 63)))
    assert [launch.describe() for launch in far if launch.key() not in warmed] == []


def test_the_recorded_launches_reach_every_kernel_of_the_package():
    launched = {launch.name for launch in engine_launches("sm_90")}
    assert package_kernels() - launched == set()
    block_types = {launch.constexprs[(list(launch.signature).index("QTYPE"),)]
                   for launch in engine_launches("sm_90") if "QTYPE" in launch.signature}
    assert block_types >= set(quant_tiles.QTYPES)     # every block type's in-register form, on every target
    ops = {launch.op for launch in engine_launches("sm_90")}
    assert ops <= {name for name in vars(TritonOps) if not name.startswith("_")}, ops


def stages(target: str, kernel: str) -> set[int]:
    return {launch.options["num_stages"] for launch in engine_launches(target) if launch.name == kernel}


def test_amd_gpus_pipeline_within_their_64_kib_of_lds():
    # Tuned on the H200 at 4 stages; AMD's pipeliner keeps 3 copies of a 24 KiB step there (72 KiB): 3 stages fit.
    # The row kernel's narrow tiles (the projections', 8 KiB a step) keep all 4.
    for kernel, amd in (("_rows_kernel", {3, 4}), ("_grouped_gate_up_kernel", {3}), ("_grouped_down_kernel", {3})):
        assert stages("sm_90", kernel) == {4}
        assert stages("gfx1201", kernel) == stages("gfx1151", kernel) == amd, kernel


def test_an_op_whose_kernels_do_not_build_runs_its_torch_form_on_that_gpu(monkeypatch, caplog):
    monkeypatch.setitem(guard.NOT_BUILT, "gfx1151", {"experts": "a made-up reason"})
    weight = torch.empty(4, 4, dtype=torch.bfloat16, device=META)
    with guard.compiling_for(guard.CHECKED_TARGETS["gfx1151"]):
        ops = backend.ops_for(weight)
    assert ops.experts.__func__ is TorchOps.experts
    assert ops.linear.__func__ is TritonOps.linear and ops.qsa_attention.__func__ is TritonOps.qsa_attention
    assert "experts runs its torch form on gfx1151" in caplog.text and "a made-up reason" in caplog.text
    with guard.compiling_for(guard.CHECKED_TARGETS["gfx1201"]):
        assert backend.ops_for(weight) is TRITON_OPS


@pytest.mark.parametrize("target, dtype, served", [
    (guard.Target("sm_120", "cuda", 120, 32, 101376), torch.bfloat16, True),     # newer NVIDIA GPUs: sm_80 on
    (guard.Target("sm_75", "cuda", 75, 32, 65536), torch.float16, False),        # no bfloat16 tensor cores
    (guard.Target("gfx942", "hip", "gfx942", 64, 65536), torch.bfloat16, False),  # never compiled for it
    (guard.CHECKED_TARGETS["gfx1151"], torch.bfloat16, True),
    (guard.CHECKED_TARGETS["gfx1201"], torch.float32, False),
])
def test_the_kernels_serve_the_gpus_they_are_checked_for(target, dtype, served):
    with guard.compiling_for(target):
        assert guard.serves(META, dtype) == served
        why = guard.why_not(META, dtype)
        weight = torch.empty(2, 2, dtype=dtype, device=META)
        assert (backend.ops_for(weight) is TRITON_OPS) == served
    if target.name == "gfx942":
        assert "gfx1201" in why and "gfx942" in why
    if target.name == "sm_75":
        assert "sm_80" in why
    assert guard.why_not(torch.device("cpu"), torch.bfloat16) is not None
    assert backend.ops_for(torch.empty(1, dtype=dtype)) is TORCH_OPS


@pytest.mark.gpu
def test_the_recorded_launches_are_the_ones_the_gpu_runs_and_compile_to_its_binaries():
    """On a GPU: the launches recorded on the meta device are the launches the model makes there, and each
    compiled ahead of time is the binary Triton's launcher built (same specialization, same cache key)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    gpu = torch.device("cuda", 0)
    target = guard.target_of(gpu)
    config = ModelConfig.from_dict(preset_config("tiny", dtype="bfloat16"))
    shapes = dict(chunks=(37, 512), decode_rows=(1, 3))
    for quantized in ({}, kernel_launches.quantized_for(config, "ud-q4_k_xl")):
        real = kernel_launches.record(config, target, device=gpu, quantized=quantized, **shapes)
        meta = kernel_launches.record(config, target, quantized=quantized, **shapes)
        assert len(real) > 10
        assert {launch.key() for launch in real} == {launch.key() for launch in meta}
        for launch in real:
            assert ahead_of_time.build(launch, target).hash == launch.launched_hash, launch.describe()


def test_the_kernels_command_reports_each_build_for_a_target(capsys):
    from qwen4exp.cli import main

    assert main(["kernels", "--model", "bench", "--target", "gfx1201", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["failed"] == 0 and len(report["builds"]) == len(recorded("bench", "gfx1201"))
    assert {row["target"] for row in report["builds"]} == {"gfx1201"}
    assert all(0 <= row["shared_bytes"] <= 65536 and row["error"] is None for row in report["builds"])
    with pytest.raises(SystemExit, match="choose one of sm_90, sm_80, gfx1201, gfx1151"):
        main(["kernels", "--model", "bench", "--target", "gfx90a"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA or ROCm GPU"):
            main(["kernels", "--target", "here"])
