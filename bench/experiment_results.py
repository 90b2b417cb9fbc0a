"""The results file of the kernel experiments (bench/*_variants.py): the device and versions, then the entries
measured so far."""

from __future__ import annotations

import json

import torch
import triton


def save(path: str | None, results: list[dict]) -> None:
    """Write `results` to `path` (nothing without one). Called after each entry, so a run cut short keeps what it
    measured."""
    if not path:
        return
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "results": results}, f, indent=1)
