"""Shared fixtures: small random-weight checkpoints written once per test session."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The tiny preset in float32 (8 layers: 6 Gated DeltaNet + 2 QSA, PLE on layer 2, an MTP head)."""
    from qwen4exp.checkpoint.writer import write_random_checkpoint

    out = tmp_path_factory.mktemp("tiny") / "ckpt"
    write_random_checkpoint(out, preset="tiny", seed=1, dtype=torch.float32, progress=False)
    return out
