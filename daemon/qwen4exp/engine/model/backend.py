"""Which ops backend a model runs, chosen from its weights' device and dtype when it is built or moved."""

from __future__ import annotations

import functools
import logging

import torch

from ...kernels import guard
from .ops import TORCH_OPS, TorchOps
from .triton_ops import TRITON_OPS, with_torch_forms

log = logging.getLogger(__name__)


@functools.cache
def _say(message: str) -> None:
    log.warning(message)   # once per message: a model is moved and cast several times while it loads


def ops_for(weight: torch.Tensor) -> TorchOps:
    """The Triton backend where guard.serves the weights' device and dtype (with the torch form of each op whose
    kernels do not build for that GPU), else the torch forms."""
    why = guard.why_not(weight.device, weight.dtype)
    if why is not None:
        if weight.device.type == "cuda" and weight.dtype in guard.SUPPORTED_DTYPES:
            _say(f"{weight.device} runs the torch forms, not the Triton kernels: {why}")
        return TORCH_OPS
    unbuilt = guard.unbuilt_ops(weight.device)
    if not unbuilt:
        return TRITON_OPS
    for op, reason in sorted(unbuilt.items()):
        _say(f"{op} runs its torch form on {guard.target_of(weight.device).name}: its kernels do not build there "
             f"({reason})")
    return with_torch_forms(frozenset(unbuilt))
