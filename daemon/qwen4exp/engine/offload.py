"""A parked model's weights in pinned host memory (park level "offload"): unparking copies them back at the link's
speed instead of reading the checkpoint again.

The model moves as a whole through its own `_apply` (as `.to()` does), so the modules that keep their weights
stacked (shared_input.py) or on the host (QuantizedStack.keep_on_host: a PLE table already in host memory stays
where it is) rebuild themselves as they do on any move; stacks of pinned parts are pinned too.
"""

from __future__ import annotations

import torch


def offload(model: torch.nn.Module) -> int:
    """Move every tensor the model keeps on a GPU to pinned host memory; returns the bytes moved."""
    moved = 0

    def to_pinned_host(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal moved
        if tensor.device.type == "cpu":
            return tensor
        moved += tensor.numel() * tensor.element_size()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor)

    model.release_rope_table()            # a table grown for the longest prompt: made again on first use
    model._apply(to_pinned_host)
    return moved


def restore(model: torch.nn.Module, device: torch.device) -> None:
    """Bring an offloaded model back to `device`, a split model's layers to their devices (a no-op for a model
    that never left the CPU)."""
    placement = getattr(model, "placement", None)
    if placement is not None:
        model.place(placement)
    else:
        model.to(device)
    for name in placement.devices if placement is not None else [str(device)]:
        if torch.device(name).type == "cuda":
            torch.cuda.synchronize(torch.device(name))
