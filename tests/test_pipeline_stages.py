"""Pipeline depth per GPU (guard.py): the H200 keeps the 4 stages the kernels were tuned with, and a GPU with
64 KiB of shared memory per block (AMD's LDS per workgroup) gets the stages whose buffered tiles fit, for the
few-row products of decode and the MoE's grouped GEMMs of prefill alike (test_kernel_builds.py compiles them)."""

from __future__ import annotations

import pytest
import torch

from qwen4exp.kernels import guard, moe, row_products

pytest.importorskip("triton")      # the kernels' block shapes come from Triton's helpers

META = torch.device("meta")        # the compile check's stand-in for the target's device


def configs(target: guard.Target) -> list[tuple[dict, int]]:
    """(config, bytes per stage) of every pipelined kernel launch, on `target`."""
    launches = []
    with guard.compiling_for(target):
        # LM head, hyper stack, MoE stack (wide tiles); a Gated DeltaNet projection (narrow tiles)
        for n, k in ((248320, 2560), (324, 10240), (1793, 2560), (2560, 6144)):
            config = row_products.fitted(row_products.plan(n, k), META, 2)
            launches.append((config, (row_products.MAX_ROWS + config["BLOCK_N"]) * config["BLOCK_K"] * 2))
        gate_up, down = moe.grouped_configs(META, 2)
    m = moe.GROUPED_BLOCK_M
    launches.append((gate_up, (m + 2 * gate_up["BLOCK_N"]) * gate_up["BLOCK_K"] * 2))
    launches.append((down, (m + down["BLOCK_N"]) * down["BLOCK_K"] * 2))
    return launches


def test_h200_keeps_the_tuned_depth():
    assert [config["num_stages"] for config, _ in configs(guard.CHECKED_TARGETS["sm_90"])] == [4] * 6


@pytest.mark.parametrize("name", ["gfx1201", "gfx1151"])
def test_a_64_kib_gpu_gets_the_stages_that_fit(name):
    target = guard.CHECKED_TARGETS[name]
    depths = []
    for config, stage in configs(target):
        depth = config["num_stages"]
        assert 1 <= depth <= 4 and target.buffers(depth) * stage <= 65536, (config, stage)
        assert depth == 4 or target.buffers(depth + 1) * stage > 65536, (config, stage)
        depths.append(depth)
    # The wide tiles (32 x 256) lose stages there; the narrow ones (16 x 128) keep all four.
    assert depths[3] == 4 and all(depth < 4 for depth in depths[:3] + depths[4:]), depths


def test_unknown_limit_or_cpu_keeps_the_asked_depth():
    assert guard.stages_within(None, 24576, 4) == 4
    unknown = guard.Target("sm_90", "cuda", 90, 32, None)
    assert guard.stages_within(unknown, 24576, 4) == 4
    assert guard.stages_within(guard.Target("x", "cuda", 90, 32, 1000), 24576, 4) == 1
    assert guard.stages_for(torch.device("cpu"), 24576, 4) == 4
