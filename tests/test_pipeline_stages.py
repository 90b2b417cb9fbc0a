"""Pipeline depth per device (guard.py): the H200 keeps the 4 stages the kernels were tuned with, and
a GPU with 64 KiB of shared memory per block (AMD's LDS per workgroup) gets the stages that fit, for the
few-row products of decode and the MoE's grouped GEMMs of prefill alike."""

from __future__ import annotations

import pytest
import torch

from qwen4exp.kernels import guard, moe, row_products

pytest.importorskip("triton")      # the kernels' block shapes come from Triton's helpers

H200 = 232448        # 227 KiB per block with the opt-in
AMD = 65536          # 64 KiB of LDS per workgroup (RDNA and CDNA)
GPU = torch.device("cuda", 0)


def configs(monkeypatch, limit: int) -> list[tuple[dict, int]]:
    """(config, bytes per stage) of every pipelined kernel launch, on a GPU reporting `limit` bytes."""
    monkeypatch.setattr(guard, "shared_memory_bytes", lambda device: limit)
    launches = []
    for n, k in ((248320, 2560), (324, 10240), (1793, 2560)):       # LM head, hyper stack, MoE stack
        config = row_products.fitted(row_products.plan(n, k), GPU, 2)
        launches.append((config, (row_products.MAX_ROWS + config["BLOCK_N"]) * config["BLOCK_K"] * 2))
    gate_up, down = moe.grouped_configs(GPU, 2)
    m = moe.GROUPED_BLOCK_M
    launches.append((gate_up, (m + 2 * gate_up["BLOCK_N"]) * gate_up["BLOCK_K"] * 2))
    launches.append((down, (m + down["BLOCK_N"]) * down["BLOCK_K"] * 2))
    return launches



def test_h200_keeps_the_tuned_depth(monkeypatch):
    assert [config["num_stages"] for config, _ in configs(monkeypatch, H200)] == [4] * 5


def test_a_64_kib_gpu_gets_the_stages_that_fit(monkeypatch):
    for config, stage in configs(monkeypatch, AMD):
        assert 1 <= config["num_stages"] < 4 and config["num_stages"] * stage <= AMD, (config, stage)


def test_unknown_limit_or_cpu_keeps_the_asked_depth():
    assert guard.stages_within(None, 24576, 4) == 4
    assert guard.stages_within(1000, 24576, 4) == 1
    assert guard.shared_memory_bytes(torch.device("cpu")) is None
