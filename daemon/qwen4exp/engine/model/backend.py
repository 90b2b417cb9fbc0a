"""Which ops backend a model runs, chosen from its weights' device and dtype when it is built or moved."""

from __future__ import annotations

import torch

from ...kernels import guard
from .ops import TORCH_OPS, TorchOps
from .triton_ops import TRITON_OPS


def ops_for(weight: torch.Tensor) -> TorchOps:
    """The Triton backend where guard.serves the weights' device and dtype, else the torch forms."""
    return TRITON_OPS if guard.serves(weight.device, weight.dtype) else TORCH_OPS
